"""Attention against a KV cache on CPU: ``edl.ops.cached_attention``'s impls side by side.

A decode step's attention reads a ``(batch, len, kv_heads, head_dim)`` cache. "reference" is
the grouped einsum (XLA:CPU first copies the cache into ``(batch, kv_heads, len, head_dim)``),
"xla" what edl runs on CPU (with one new token, a block-diagonal query against the cache as
it lies: ``kv_heads`` times the multiply-adds, no copy; and only up to the longest row,
rounded up to one of ``live_lengths(len)``), "pallas" the decode kernel
(interpreted on CPU). Each timed call runs 20 attention steps in a ``fori_loop`` whose
output feeds the next query, over random caches with random valid lengths; the impls
alternate in every round. The table checks where the one-token form pays (shapes: the
generate benchmark's Llama, then 7B/8B-like heads).

    python -m benchmarks.cached_attention [--quick] [--rounds 7] [--impls reference xla pallas]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp

from benchmarks._common import interleaved_rounds, table, write_json
from edl.ops.cached_attention import cached_attention

STEPS = 20
# (heads, kv_heads, head_dim, cache_len)
SHAPES = [
    (8, 4, 32, 160),
    (8, 8, 32, 160),
    (16, 2, 64, 1024),
    (32, 8, 128, 512),
    (32, 32, 128, 512),
]
QUICK_SHAPES = [(8, 4, 32, 160)]


def _runner(impl: str):
    @jax.jit
    def run(q, k, v, lengths):
        def step(_, q):
            out = cached_attention(q, k, v, lengths, impl=impl)
            return q + jnp.asarray(1e-3, q.dtype) * out

        return jax.lax.fori_loop(0, STEPS, step, q)

    return run


def measure(shape, batch: int, new: int, impls, rounds: int) -> dict:
    heads, kv_heads, head_dim, cache_len = shape
    kq, kk, kv, kl = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (batch, new, heads, head_dim))
    k = jax.random.normal(kk, (batch, cache_len, kv_heads, head_dim))
    v = jax.random.normal(kv, (batch, cache_len, kv_heads, head_dim))
    lengths = jax.random.randint(kl, (batch,), cache_len // 4, cache_len + 1)
    calls = {impl: functools.partial(_runner(impl), q, k, v, lengths) for impl in impls}
    outs = {impl: call() for impl, call in calls.items()}  # compile
    for impl, out in outs.items():
        err = float(jnp.max(jnp.abs(out - outs[impls[0]])))
        if err > 1e-4:
            raise RuntimeError(f"{impl} differs from {impls[0]} by {err} at {shape}")
    samples = interleaved_rounds(calls, rounds)
    row = {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "cache_len": cache_len,
        "batch": batch,
        "new_tokens": new,
    }
    for impl, s in samples.items():
        row[f"{impl}_us"] = min(s) / STEPS * 1e6
        if impl != "reference" and "reference" in samples:
            row[f"{impl}_ratio"] = min(s) / min(samples["reference"])
            row[f"{impl}_median_ratio"] = statistics.median(s) / statistics.median(
                samples["reference"]
            )
    return row


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape, 3 rounds")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (quick: 3)")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["reference", "xla", "pallas"],
        help="edl.ops.cached_attention impls to time (pallas: small shapes only)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rounds = 3 if args.quick else args.rounds
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        # The interpreted kernel runs one (row, kv head) program at a time: skip it where
        # that takes minutes (it is timed on the small shapes).
        big = shape[1] * shape[2] * shape[3] > 2**17
        impls = [i for i in args.impls if not (big and i == "pallas")]
        for batch in (1, 8):
            for new in (1, 4):
                rows.append(measure(shape, batch, new, impls, rounds))
                print(f"{shape} batch {batch} new {new} done", flush=True)
    header = ["heads/kv/dim/len", "batch", "new"]
    for impl in args.impls:
        header += [f"{impl} us"] + ([f"x ref ({impl})"] if impl != "reference" else [])
    body = []
    for r in rows:
        cells = [
            f"{r['heads']}/{r['kv_heads']}/{r['head_dim']}/{r['cache_len']}",
            r["batch"],
            r["new_tokens"],
        ]
        for impl in args.impls:
            cells.append(r.get(f"{impl}_us", "-"))
            if impl != "reference":
                cells.append(r.get(f"{impl}_ratio", "-"))
        body.append(cells)
    print(table(header, body))
    print("wrote", write_json("cached_attention", rows, steps=STEPS, rounds=rounds))


if __name__ == "__main__":
    main()
