"""Paged attention on CPU: the native kernel (pages read in place) against XLA's gathered form.

Two tables, each variant compiled side by side in one process and alternated call by call
(medians):

1. **The op** (``edl.ops.paged_attention``, ``impl="native"`` vs ``"xla"``) at the serving
   benchmark's heads (12 query / 6 kv heads of 64), 16 rows with 256 cached positions each in
   pages of 16, for 1-16 new tokens per row: where the kernel's scalar loops stop paying
   against XLA's GEMMs (``edl.ops.cached_attention.NATIVE_MAX_NEW_TOKENS``).
2. **The serving engine's decode step** (``edl.serve.step.model_step`` at ``(rows, 1)`` over
   a full ``(rows, 16)`` page table, layers unstacked as the engine runs them) on
   ``benchmarks.serve``'s ~104M model: ``"auto"`` (the native kernel) vs the same step with
   the kernel off (``NATIVE_MAX_NEW_TOKENS = 0`` while tracing: ``"auto"`` then takes XLA).

    python -m benchmarks.paged_attention [--quick] [--rounds 12] [--rows 16]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import interleaved_rounds, table, write_json
from benchmarks.serve import _model
from edl.serve.step import model_step

# The module (edl.ops exports a function of the same name).
cached_attention = importlib.import_module("edl.ops.cached_attention")

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 12, 6, 64, 16, 16


def _pools(rng, rows: int, layers: int = 1):
    num_pages = rows * PAGES + 8
    shape = (layers, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(2))
    table_ = rng.permutation(num_pages)[: rows * PAGES].reshape(rows, PAGES)
    return k, v, jnp.asarray(table_, jnp.int32)


def op_table(rows: int, rounds: int, news: tuple[int, ...]) -> list[dict]:
    rng = np.random.default_rng(0)
    k, v, page_table = _pools(rng, rows)
    lengths = jnp.full((rows,), PAGES * PAGE_SIZE, jnp.int32)
    results = []
    for new in news:
        q = jnp.asarray(rng.standard_normal((rows, new, HEADS, HEAD_DIM), np.float32))
        calls = {}
        for impl in ("native", "xla"):
            run = jax.jit(
                functools.partial(
                    cached_attention.paged_attention, layer=0, impl=impl, live_prefix=False
                )
            )
            calls[impl] = functools.partial(run, q, k, v, page_table, lengths)
        out = {name: call() for name, call in calls.items()}
        err = float(jnp.max(jnp.abs(out["native"] - out["xla"])))
        if err > 1e-4:
            raise RuntimeError(f"native differs from xla by {err} at {new} new tokens")
        samples = interleaved_rounds(calls, rounds)
        ms = {name: 1e3 * statistics.median(s) for name, s in samples.items()}
        results.append(
            {
                "new_tokens": new,
                **{f"{n}_ms": t for n, t in ms.items()},
                "xla_over_native": ms["xla"] / ms["native"],
            }
        )
    return results


def step_table(rows: int, rounds: int, hidden: int, layers: int) -> dict:
    model = _model(hidden, layers, PAGES * PAGE_SIZE).unstacked()
    config = model.model.config
    rng = np.random.default_rng(1)
    num_pages = rows * PAGES + 8
    shape = (
        config.num_hidden_layers,
        num_pages,
        PAGE_SIZE,
        config.num_key_value_heads,
        config.head_dim,
    )
    k = jnp.asarray(rng.standard_normal(shape, np.float32))
    v = jnp.asarray(rng.standard_normal(shape, np.float32))
    page_table = jnp.asarray(
        rng.permutation(num_pages)[: rows * PAGES].reshape(rows, PAGES), jnp.int32
    )
    lengths = jnp.full((rows,), PAGES * PAGE_SIZE - 1, jnp.int32)
    tokens = jnp.asarray(rng.integers(3, 259, (rows, 1)), jnp.int32)
    num_new = jnp.ones((rows,), jnp.int32)
    step = model_step.__wrapped__
    pools = {}
    compiled = {}
    for name, native_max in (("native", cached_attention.NATIVE_MAX_NEW_TOKENS), ("xla", 0)):
        saved = cached_attention.NATIVE_MAX_NEW_TOKENS
        cached_attention.NATIVE_MAX_NEW_TOKENS = native_max
        try:
            # A fresh function per variant: jax.jit of the same function hands back its first
            # trace whatever module setting changed since (RESULTS.md, serve, 2026-11-25).
            fn = jax.jit(lambda *a, _step=step: _step(*a), donate_argnums=(1, 2))
            compiled[name] = fn.lower(model, k, v, page_table, lengths, tokens, num_new).compile()
        finally:
            cached_attention.NATIVE_MAX_NEW_TOKENS = saved
        pools[name] = (jnp.copy(k), jnp.copy(v))
    calls, firsts = {}, {}

    def call(name):
        k_pool, v_pool = pools[name]
        args = (page_table, lengths, tokens, num_new)
        k_pool, v_pool, logits = compiled[name](model, k_pool, v_pool, *args)
        pools[name] = (k_pool, v_pool)  # the pools are donated: keep the returned ones
        firsts.setdefault(name, jnp.argmax(logits, axis=-1))  # the greedy tokens
        return logits

    for name in compiled:
        calls[name] = functools.partial(call, name)
        calls[name]()
    if not bool(jnp.all(firsts["native"] == firsts["xla"])):
        raise RuntimeError("the native and xla decode steps chose different tokens")
    samples = interleaved_rounds(calls, rounds)
    ms = {name: 1e3 * statistics.median(s) for name, s in samples.items()}
    return {
        "rows": rows,
        **{f"{n}_ms": t for n, t in ms.items()},
        "xla_over_native": ms["xla"] / ms["native"],
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few rounds")
    parser.add_argument(
        "--rounds", type=int, default=12, help="interleaved timed rounds (quick: 3)"
    )
    parser.add_argument("--rows", type=int, default=16, help="sequences decoded at once")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rounds = 3 if args.quick else args.rounds
    news = (1, 4) if args.quick else (1, 2, 4, 8, 16)
    ops = op_table(args.rows, rounds, news)
    print(
        f"paged attention, {args.rows} rows x {PAGES * PAGE_SIZE} positions, "
        f"{HEADS}/{KV_HEADS} heads of {HEAD_DIM}"
    )
    print(
        table(
            ["new tokens", "native ms", "xla ms", "xla / native"],
            [[r["new_tokens"], r["native_ms"], r["xla_ms"], r["xla_over_native"]] for r in ops],
        )
    )
    hidden, layers = (256, 4) if args.quick else (768, 16)
    step = step_table(args.rows, rounds, hidden, layers)
    print(
        f"\ndecode step, hidden {hidden}, {layers} layers, {args.rows} rows x "
        f"{PAGES * PAGE_SIZE} positions"
    )
    print(
        table(
            ["native ms", "xla ms", "xla / native"],
            [[step["native_ms"], step["xla_ms"], step["xla_over_native"]]],
        )
    )
    write_json("paged_attention", ops, step=step, step_rows=args.rows)


if __name__ == "__main__":
    main()
