"""Llama forward time and parameter bytes: float32 vs int8 vs nf4 weights, side by side.

The model benchmark's config (hidden 256, intermediate 688, 8 heads / 4 kv heads, vocab
1024, batch 4 x seq 256, float32), 4 layers by default. The attention and MLP projections
are quantized (``edl.quantize.QuantConfig`` defaults: int8 per output channel, nf4 in blocks
of 64); embeddings, norms and the LM head stay float32. Bytes are ``edl.nbytes``; the errors
are relative RMS differences to the float32 projection weights and logits. Forward times are
medians over rounds that interleave the three variants.

    python -m benchmarks.quant [--quick] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import edl
from benchmarks._common import table, time_call, write_json
from benchmarks.model import _config  # the model benchmark's Llama config
from edl.models import LlamaForCausalLM
from edl.nn import Linear, QuantizedLinear
from edl.quantize import QuantConfig, quantize


def _projections(model) -> dict:
    return edl.tree.find(model.model.layers, lambda x: isinstance(x, Linear | QuantizedLinear))


def _weight_error(model, reference) -> float:
    """Relative RMS error of all projection weights against the float32 ones."""
    got, want = _projections(model), _projections(reference)
    num = sum(float(jnp.sum((got[p].weight - want[p].weight) ** 2)) for p in want)
    return (num / sum(float(jnp.sum(want[p].weight ** 2)) for p in want)) ** 0.5


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small widths, 2 layers")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 4; quick 2)"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    layers = args.layers or (2 if args.quick else 4)
    batch, seq = (2, 64) if args.quick else (4, 256)
    rounds, number = (3, 1) if args.quick else (9, 3)

    config = _config(layers, args.quick)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab_size)
    forward = jax.jit(lambda m, ids: m(ids).logits)
    variants = {
        "fp32": model,
        "int8": quantize(model, QuantConfig("int8")),
        "nf4": quantize(model, QuantConfig("nf4")),
    }
    # Rounds interleave the variants, so drifting load on a shared machine hits all alike.
    samples = {name: [] for name in variants}
    for r in range(rounds):
        for name, m in variants.items():
            call = lambda m=m: forward(m, ids)
            samples[name].append(
                time_call(call, warmup=2 if r == 0 else 1, repeats=1, number=number)
            )
    ref = np.asarray(forward(model, ids), np.float64)
    rows = []
    for name, m in variants.items():
        logits = np.asarray(forward(m, ids), np.float64)
        rows.append(
            {
                "format": name,
                "param_bytes": edl.nbytes(m),
                "projection_bytes": edl.nbytes(list(_projections(m).values())),
                "weight_rel_rms_error": _weight_error(m, model),
                "forward_s": statistics.median(samples[name]),
                "logits_rel_rms_error": float(
                    np.sqrt(np.mean((logits - ref) ** 2) / np.mean(ref**2))
                ),
                "logits_max_abs_error": float(np.abs(logits - ref).max()),
                "argmax_agreement": float(np.mean(logits.argmax(-1) == ref.argmax(-1))),
            }
        )
    base = rows[0]
    for row in rows:
        row["projection_ratio"] = row["projection_bytes"] / base["projection_bytes"]
        row["param_ratio"] = row["param_bytes"] / base["param_bytes"]
        row["forward_ratio"] = row["forward_s"] / base["forward_s"]
    header = [
        "format",
        "params MB",
        "proj MB",
        "proj / fp32",
        "all / fp32",
        "fwd ms",
        "fwd / fp32",
        "weight rel err",
        "logits rel err",
        "argmax agree",
    ]
    print(
        table(
            header,
            [
                [
                    r["format"],
                    r["param_bytes"] / 1e6,
                    r["projection_bytes"] / 1e6,
                    r["projection_ratio"],
                    r["param_ratio"],
                    r["forward_s"] * 1e3,
                    r["forward_ratio"],
                    r["weight_rel_rms_error"],
                    r["logits_rel_rms_error"],
                    r["argmax_agreement"],
                ]
                for r in rows
            ],
        )
    )
    path = write_json("quant", rows, layers=layers, batch=batch, seq=seq, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
