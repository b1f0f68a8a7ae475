"""Attention throughput: the Pallas kernel against the plain-jnp reference (and cuDNN on GPU,
the native C++ kernel and XLA's custom-VJP form on CPU).

FLOPs follow the usual convention: forward ``4 * batch * heads * q_len * kv_len * head_dim``,
halved when causal; backward 2.5x forward, so forward+backward counts 3.5x. Every impl of a
row is timed in the same run, side by side. The number of tokens per call is fixed
(``--tokens``), so longer sequences mean smaller batches; heads = ``--hidden / head_dim``.

    python -m benchmarks.attention [--quick] [--seqs 512,1024] [--dtype bfloat16]

Defaults: on GPU seq 512..16k, head_dim 64/128, bf16, causal and not, impls
pallas/reference/cudnn; on CPU seq 256..2048 in float32 (XLA:CPU's bf16 matmuls are slower
than float32 ones), impls native/pallas (interpreted)/reference/xla.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks._common import table, time_call, write_json
from edl.ops import attention


def _flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    return 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)


def _measure(impl, q, k, v, causal, repeats):
    fwd = jax.jit(functools.partial(attention, causal=causal, impl=impl))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=causal, impl=impl).astype(jnp.float32))

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    timings = []
    for fn in (fwd, fwd_bwd):
        try:
            timings.append(
                time_call(lambda fn=fn: fn(q, k, v), warmup=1, repeats=repeats, number=3)
            )
        except Exception as err:  # an OOM of one impl is a result, not a crash
            if "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
                raise
            timings.append(float("nan"))
    return timings


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short sequence, one head_dim")
    parser.add_argument(
        "--seqs",
        default="512,1024,2048,4096,8192,16384" if gpu else "256,512,1024,2048",
        help="comma-separated sequence lengths (quick: the first)",
    )
    parser.add_argument(
        "--head-dims", default="64,128", help="comma-separated head sizes (quick: the first)"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16" if gpu else "float32",
        help="dtype of q, k, v (bfloat16 on GPU, else float32)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=16384 if gpu else 4096,
        help="tokens per call: batch = tokens // seq",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=2048 if gpu else 256,
        help="heads x head_dim: heads = hidden // head_dim",
    )
    parser.add_argument("--kv-group", type=int, default=1, help="query heads per kv head")
    parser.add_argument(
        "--impls",
        default="pallas,reference,cudnn" if gpu else "native,pallas,reference,xla",
        help="comma-separated attention impls to time",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats per measurement (median)"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    seqs = [int(s) for s in args.seqs.split(",")][: 1 if args.quick else None]
    head_dims = [int(d) for d in args.head_dims.split(",")][: 1 if args.quick else None]
    impls = args.impls.split(",")
    dtype = jnp.dtype(args.dtype)

    rows, printed = [], []
    for head_dim in head_dims:
        heads = args.hidden // head_dim
        for seq in seqs:
            batch = max(1, args.tokens // seq)
            keys = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
            k, v = (
                jax.random.normal(key, (batch, seq, heads // args.kv_group, head_dim), dtype)
                for key in keys[1:]
            )
            for causal in (True, False):
                flops = _flops(batch, heads, seq, head_dim, causal)
                times = {impl: _measure(impl, q, k, v, causal, args.repeats) for impl in impls}
                for impl, (t_fwd, t_all) in times.items():
                    row = {
                        "impl": impl,
                        "seq": seq,
                        "batch": batch,
                        "heads": heads,
                        "head_dim": head_dim,
                        "causal": causal,
                        "dtype": dtype.name,
                        "fwd_ms": t_fwd * 1e3,
                        "fwd_tflops": flops / t_fwd / 1e12,
                        "fwd_bwd_ms": t_all * 1e3,
                        "fwd_bwd_tflops": 3.5 * flops / t_all / 1e12,
                        "fwd_vs_reference": times["reference"][0] / t_fwd
                        if "reference" in times
                        else None,
                        "fwd_bwd_vs_reference": times["reference"][1] / t_all
                        if "reference" in times
                        else None,
                    }
                    rows.append(row)
                    printed.append(
                        [
                            seq,
                            head_dim,
                            "yes" if causal else "no",
                            impl,
                            row["fwd_ms"],
                            row["fwd_tflops"],
                            row["fwd_bwd_ms"],
                            row["fwd_bwd_tflops"],
                            row["fwd_vs_reference"] or "",
                            row["fwd_bwd_vs_reference"] or "",
                        ]
                    )
    header = [
        "seq",
        "d",
        "causal",
        "impl",
        "fwd ms",
        "fwd TF/s",
        "f+b ms",
        "f+b TF/s",
        "fwd speedup",
        "f+b speedup",
    ]
    print(
        f"attention, {dtype.name}, {args.tokens} tokens/call, hidden {args.hidden}, "
        f"backend {jax.default_backend()} (speedup = reference time / impl time)"
    )
    print(table(header, printed))
    print("wrote", write_json("attention", rows, tokens=args.tokens, hidden=args.hidden))


if __name__ == "__main__":
    main()
