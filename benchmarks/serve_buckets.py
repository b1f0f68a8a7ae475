"""How many step shapes ``edl serve`` needs: the serving step's time against its shape, and
what coarser buckets would cost.

``Engine`` compiles ``model_step`` once per ``(rows, width, pages)`` shape: rows in powers of
two up to ``max_batch``, prefill widths in powers of four from 16, page tables in powers of
four from 4 (``Engine.step_shapes``). Each shape costs a compile (seconds for a deep model);
a coarser set costs padding instead (a call for 5 requests runs 8 rows, or 16). This
measures, on a random byte-level Llama (``--hidden`` / ``--layers``; defaults: hidden 256,
8 layers, as ``benchmarks.serve_start``), the compiled step's median time for

- decode (width 1) at every row count 1..``--max-batch``, 16 pages (256 tokens) per row;
- decode at ``--max-batch`` / 2 rows, tables of 4..64 pages (each row's tokens filling them);
- prefill of one row at widths 16..256 (all tokens real);

each shape's median over interleaved rounds (the machine is shared) and its compile time,
then the mean decode step over 1..max_batch running
requests (each count equally likely) under several row-bucket sets, against how many
shapes each set compiles.

    python -m benchmarks.serve_buckets [--hidden 256] [--layers 8] [--max-batch 16]

Prints tables, then LAST one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import byte_llama_config
from edl.models import LlamaForCausalLM
from edl.serve import shapes
from edl.serve.engine import Engine
from edl.serve.step import model_step

_PAGE = 16


def _engine(hidden: int, layers: int, max_batch: int) -> Engine:
    config = byte_llama_config(hidden, layers, 1024)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    return Engine(model, max_batch=max_batch, max_model_len=1024, page_size=_PAGE)


def _arguments(engine: Engine, rows: int, width: int, pages: int) -> list:
    """A step's arguments with every row busy: row ``i`` holds pages ``i * pages_per_seq
    ...``, filled up to its new tokens."""
    per_seq = engine.pages_per_seq
    table = np.array([[i * per_seq + j for j in range(pages)] for i in range(rows)], np.int32)
    lengths = np.full(rows, pages * _PAGE - width, np.int32)
    return [
        jnp.asarray(table),
        jnp.asarray(lengths),
        jnp.ones((rows, width), jnp.int32),
        jnp.full(rows, width, jnp.int32),
    ]


def _calls(engine: Engine, args: list, n: int) -> float:
    """Seconds of ``n`` steps of ``args``' shape, one after another (the pools donated)."""
    start = time.perf_counter()
    for _ in range(n):
        engine._k_pages, engine._v_pages, out, _ = model_step(
            engine._model, engine._k_pages, engine._v_pages, *args
        )
        out.block_until_ready()
    return time.perf_counter() - start


def _time_shapes(engine: Engine, shapes: list[tuple], repeats: int, rounds: int) -> dict:
    """Per shape: its first call's seconds (the compile) and the median over ``rounds``
    interleaved rounds (every shape in turn, so the shared machine's drift hits all alike)
    of its mean step milliseconds over ``repeats`` calls."""
    args = {shape: _arguments(engine, *shape) for shape in shapes}
    compile_s = {shape: _calls(engine, args[shape], 1) for shape in shapes}
    samples: dict[tuple, list[float]] = {shape: [] for shape in shapes}
    for _ in range(rounds):
        for shape in shapes:
            samples[shape].append(1e3 * _calls(engine, args[shape], repeats) / repeats)
    return {
        shape: {"compile_s": compile_s[shape], "step_ms": statistics.median(samples[shape])}
        for shape in shapes
    }


def _bucket_sets(max_batch: int) -> dict[str, tuple[int, ...]]:
    return {
        "powers of 2 (today)": shapes.buckets(max_batch, 1, 2),
        "powers of 4": shapes.buckets(max_batch, 1, 4),
        "1, 8, max": tuple(sorted({1, min(8, max_batch), max_batch})),
        "max only": (max_batch,),
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    parser.add_argument("--layers", type=int, default=8, help="layers (default: 8)")
    parser.add_argument("--max-batch", type=int, default=16, help="rows at most (default: 16)")
    parser.add_argument("--repeats", type=int, default=10, help="calls per shape a round (10)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    engine = _engine(args.hidden, args.layers, args.max_batch)
    half = max(1, args.max_batch // 2)
    shapes = [(rows, 1, 16) for rows in range(1, args.max_batch + 1)]
    shapes += [(half, 1, p) for p in (4, 8, 32, 64)]
    shapes += [(1, w, 16) for w in (16, 32, 64, 128, 256)]
    timed = _time_shapes(engine, shapes, args.repeats, args.rounds)
    decode = {rows: timed[rows, 1, 16] for rows in range(1, args.max_batch + 1)}
    pages = {p: timed[half, 1, p] for p in (4, 8, 16, 32, 64)}
    prefill = {w: timed[1, w, 16] for w in (16, 32, 64, 128, 256)}
    print("decode, 16 pages per row: rows -> step ms (compile s)")
    for rows, got in decode.items():
        print(f"  {rows:3d}  {got['step_ms']:8.2f}  ({got['compile_s']:.1f})")
    print(f"decode, {half} rows: pages per row -> step ms (compile s)")
    for p, got in pages.items():
        print(f"  {p:3d}  {got['step_ms']:8.2f}  ({got['compile_s']:.1f})")
    print("prefill, 1 row: width -> step ms, ms per token (compile s)")
    for w, got in prefill.items():
        print(
            f"  {w:3d}  {got['step_ms']:8.2f}  {got['step_ms'] / w:6.3f}  ({got['compile_s']:.1f})"
        )
    sets = {}
    for name, buckets in _bucket_sets(args.max_batch).items():
        padded = [
            decode[shapes.bucket(buckets, n)]["step_ms"] for n in range(1, args.max_batch + 1)
        ]
        exact = [decode[n]["step_ms"] for n in range(1, args.max_batch + 1)]
        sets[name] = {
            "buckets": buckets,
            "mean_step_ms": statistics.mean(padded),
            "vs_exact": statistics.mean(padded) / statistics.mean(exact),
        }
    print("decode row buckets: mean step over 1..max_batch requests (vs exact rows)")
    for name, got in sets.items():
        print(
            f"  {name:22s} {got['buckets']!s:18s} {got['mean_step_ms']:8.2f} ms "
            f"x{got['vs_exact']:.2f}"
        )
    print(
        json.dumps(
            {
                "args": vars(args),
                "decode": decode,
                "pages": pages,
                "prefill": prefill,
                "bucket_sets": sets,
            }
        )
    )


if __name__ == "__main__":
    main()
