"""``x @ W.T`` at few rows: the weight-right form vs ``edl.ops.linear``'s weight-left form.

XLA:CPU's GEMM is slow when ``x`` has a handful of rows (a decode step's projections);
``edl.ops.linear`` then computes ``(W @ x.T).T`` instead (``edl.ops.cpu.weight_left``). This script
times both forms over a range of row counts and weight shapes, so the row threshold
(``edl.ops.matmul.SMALL_ROWS``) can be checked on a given machine. Each timed call runs up
to 20 steps (fewer for large products) of 16 projections with distinct weights (a decode
step's worth) in a ``fori_loop`` whose carry feeds each output back into the input; the two
forms alternate in every round.

A second table times greedy ``generate`` (the generate benchmark's 4-layer Llama, 32-token
prompts, 128 new tokens) compiled twice in one process, with ``SMALL_ROWS`` at its value and
at 0 (the weight-right form everywhere), the two executables alternating in every round.

    python -m benchmarks.linear [--quick] [--shapes 256x688 688x256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import edl.ops.matmul
from benchmarks._common import interleaved_rounds, table, write_json
from benchmarks.generate import _config  # the generate benchmark's Llama
from edl.generate import generate
from edl.models import LlamaForCausalLM, configure
from edl.ops.cpu import weight_left
from edl.ops.matmul import SMALL_ROWS, _weight_right

FORMS = {"x @ W.T": _weight_right, "(W @ x.T).T": weight_left}
WEIGHTS = 16


def _steps(rows: int, fan_in: int, fan_out: int) -> int:
    """20 steps, fewer (down to 2) when a step is over ~0.25 GFLOP, so large rows stay quick."""
    return max(2, min(20, int(2.5e8 / (2 * rows * fan_in * fan_out * WEIGHTS))))


def _runner(form, fan_in: int, steps: int):
    @jax.jit
    def run(x, weights):
        def step(_, x):
            for w in weights:
                y = form(x, w)
                # Feed back a (rows, fan_in) slice so each product depends on the last.
                y = jnp.tile(y, (1, -(-fan_in // y.shape[1])))[:, :fan_in]
                x = x + jnp.asarray(1e-3, x.dtype) * y
            return x

        return jax.lax.fori_loop(0, steps, step, x)

    return run


def measure(fan_in: int, fan_out: int, rows: int, dtype, rounds: int) -> dict:
    keys = jax.random.split(jax.random.key(0), WEIGHTS)
    weights = [(0.02 * jax.random.normal(k, (fan_out, fan_in))).astype(dtype) for k in keys]
    x = jnp.ones((rows, fan_in), dtype)
    steps = _steps(rows, fan_in, fan_out)
    calls = {
        name: functools.partial(_runner(form, fan_in, steps), x, weights)
        for name, form in FORMS.items()
    }
    for call in calls.values():  # compile
        jax.block_until_ready(call())
    samples = interleaved_rounds(calls, rounds)
    right, left = ([t / (steps * WEIGHTS) for t in samples[name]] for name in FORMS)
    return {
        "shape": f"{fan_in}x{fan_out}",
        "rows": rows,
        "dtype": jnp.dtype(dtype).name,
        "weight_right_us": min(right) * 1e6,
        "weight_left_us": min(left) * 1e6,
        "ratio_min": min(left) / min(right),
        "ratio_median": statistics.median(left) / statistics.median(right),
        "edl_uses_left": 1 < rows <= SMALL_ROWS,
    }


def _compiled_generate(model, ids, max_new: int, small_rows: int):
    """``generate`` compiled with ``edl.ops.matmul.SMALL_ROWS = small_rows`` (restored after)."""
    jax.clear_caches()  # otherwise the trace cached under the other setting is reused
    edl.ops.matmul.SMALL_ROWS = small_rows
    try:
        # generate checks its prompt's values, so the prompt is a constant of the program.
        call = jax.jit(lambda m: generate(m, ids, max_new_tokens=max_new).sequences)
        return call.lower(model).compile()
    finally:
        edl.ops.matmul.SMALL_ROWS = SMALL_ROWS


def measure_generate(impl: str, batch: int, quick: bool, rounds: int) -> dict:
    model = configure(
        LlamaForCausalLM.init(_config(quick), key=jax.random.key(0)), attention_impl=impl
    )
    ids = np.asarray(jax.random.randint(jax.random.key(1), (batch, 32), 1, 1024))
    max_new = 16 if quick else 128
    runs = {
        name: _compiled_generate(model, ids, max_new, rows)
        for name, rows in (("plain", 0), ("small", SMALL_ROWS))
    }
    if runs["plain"].as_text() == runs["small"].as_text():
        raise RuntimeError("generate compiled to the same program with and without SMALL_ROWS")
    outs = {name: np.asarray(run(model)) for name, run in runs.items()}
    calls = {name: functools.partial(run, model) for name, run in runs.items()}
    samples = interleaved_rounds(calls, rounds)
    plain, small = samples["plain"], samples["small"]
    return {
        "impl": impl,
        "batch": batch,
        "plain_tok_s": batch * max_new / min(plain),
        "small_rows_tok_s": batch * max_new / min(small),
        "time_ratio_min": min(small) / min(plain),
        "time_ratio_median": statistics.median(small) / statistics.median(plain),
        "same_tokens": bool(np.array_equal(outs["plain"], outs["small"])),
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 row counts, 3 rounds")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["256x688", "688x256", "1024x1024"],
        help="weights as IN x OUT",
    )
    parser.add_argument("--dtype", default="float32", help="dtype of x and W")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (quick: 3)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    row_counts = [1, 8, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
    rounds = 3 if args.quick else args.rounds
    results = []
    for shape in args.shapes:
        fan_in, fan_out = (int(n) for n in shape.split("x"))
        for rows in row_counts:
            results.append(measure(fan_in, fan_out, rows, jnp.dtype(args.dtype), rounds))
    header = [
        "in x out",
        "rows",
        "x @ W.T us",
        "(W @ x.T).T us",
        "ratio",
        "median ratio",
        "edl uses left",
    ]
    keys = [
        "shape",
        "rows",
        "weight_right_us",
        "weight_left_us",
        "ratio_min",
        "ratio_median",
        "edl_uses_left",
    ]
    print(table(header, [[r[k] for k in keys] for r in results]))
    decode = [
        measure_generate(impl, batch, args.quick, rounds)
        for batch in (1, 8)
        for impl in ("auto", "xla")
    ]
    header = [
        "attention",
        "batch",
        "tok/s x @ W.T",
        "tok/s edl",
        "time ratio",
        "median ratio",
        "same tokens",
    ]
    keys = [
        "impl",
        "batch",
        "plain_tok_s",
        "small_rows_tok_s",
        "time_ratio_min",
        "time_ratio_median",
        "same_tokens",
    ]
    print(table(header, [[r[k] for k in keys] for r in decode]))
    path = write_json("linear", results, dtype=args.dtype, small_rows=SMALL_ROWS, generate=decode)
    print("wrote", path)


if __name__ == "__main__":
    main()
