"""GPT-OSS tiny forward and train step: edl (jax.jit) vs transformers + torch, side by side.

A GPT-OSS of ``benchmarks.model``'s widths: hidden 256, 8 heads of 32 / 4 kv heads, vocab
1024, batch 4 x seq 256, float32, attention sinks and biases, sliding window 128 on every
other layer, YaRN, and an MoE of 8 experts (width 256), top-2, in every layer (biased router
and experts, clamped SwiGLU). edl and torch get the same weights (``edl.to_torch``) and batch;
the train step is AdamW on the causal-LM loss, timed as in ``benchmarks.model`` (its
``_measure_edl`` / ``_measure_torch``: medians of several runs). On CPU edl's attention runs
as XLA (the native kernel has no sinks) and its experts as ``jax.lax.ragged_dot`` (a masked
dense product on CPU: every expert's FLOPs); transformers runs its experts through its
``grouped_mm`` experts implementation.

    python -m benchmarks.gpt_oss [--quick] [--layers 4]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import edl
from benchmarks._common import table, write_json
from benchmarks.model import _measure_edl, _measure_torch
from edl.cli.allocator import reexec_with_huge_pages
from edl.models import GptOssConfig, GptOssForCausalLM


def _config(layers: int, quick: bool) -> GptOssConfig:
    width = 64 if quick else 256
    return GptOssConfig(
        vocab_size=1024,
        hidden_size=width,
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=width // 8,
        max_position_embeddings=131072,  # YaRN x32 of 4096, as gpt-oss
        sliding_window=128,
        num_experts=8,
        num_experts_per_tok=2,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="width 64, batch 2 x seq 64")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=None, help="depths to time (default 4)"
    )
    return parser


def main() -> None:
    reexec_with_huge_pages(["-m", "benchmarks.gpt_oss", *sys.argv[1:]])
    jnp.zeros(())  # initialise the backend before timing anything
    args = build_parser().parse_args()
    batch, seq = (2, 64) if args.quick else (4, 256)
    reps = {"warmup": 2, "repeats": 3 if args.quick else 5, "number": 1}
    import torch

    torch.manual_seed(0)
    rows = []
    for layers in args.layers or [4]:
        config = _config(layers, args.quick)
        model = GptOssForCausalLM.init(config, key=jax.random.key(layers))
        ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab_size)
        # torch first: the edl train step donates (deletes) the model's arrays.
        torch_fwd, torch_train = _measure_torch(model, np.asarray(ids), reps)
        edl_fwd, edl_train, compile_s = _measure_edl(model, ids, reps)
        rows.append(
            {
                "model": "gpt_oss",
                "layers": layers,
                "params": edl.count_params(model),
                "edl_forward_s": edl_fwd,
                "torch_forward_s": torch_fwd,
                "edl_train_s": edl_train,
                "torch_train_s": torch_train,
                "forward_vs_torch": edl_fwd / torch_fwd,
                "train_vs_torch": edl_train / torch_train,
                "edl_compile_s": compile_s,
            }
        )
        print(f"gpt_oss {layers} layers done", flush=True)
    header = [
        "layers",
        "params",
        "edl fwd ms",
        "torch fwd ms",
        "fwd edl/torch",
        "edl train ms",
        "torch train ms",
        "train edl/torch",
        "compile s",
    ]
    body = [
        [
            r["layers"],
            f"{r['params'] / 1e6:.1f}M",
            f"{r['edl_forward_s'] * 1e3:.1f}",
            f"{r['torch_forward_s'] * 1e3:.1f}",
            f"{r['forward_vs_torch']:.2f}",
            f"{r['edl_train_s'] * 1e3:.1f}",
            f"{r['torch_train_s'] * 1e3:.1f}",
            f"{r['train_vs_torch']:.2f}",
            f"{r['edl_compile_s']:.1f}",
        ]
        for r in rows
    ]
    print(table(header, body))
    write_json("gpt_oss", rows, batch=batch, seq=seq)


if __name__ == "__main__":
    main()
