"""Train-step throughput and MFU: ``edl train``'s default model, and a ~1B Llama on a GPU.

Times the jitted ``make_train_step`` step (AdamW, clipping, chunked loss, donation) on
packed batches of random tokens, after an ahead-of-time compile. MFU = tokens/s *
``flops_per_token`` (3x forward matmul FLOPs, attention included) / the device's peak:
``--peak-tflops`` (default 989 bf16 dense on H100/H200, 0.1 on CPU as in ``edl train``).

    python -m benchmarks.train [--configs default,1b] [--dtype bfloat16] [--steps 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import edl
from benchmarks._common import table, write_json
from edl.cli.allocator import reexec_with_huge_pages
from edl.models import LlamaConfig, LlamaForCausalLM, RunOptions, flops_per_token
from edl.train import OptimizerConfig, make_optimizer, make_train_step

CONFIGS = {
    # edl train's defaults (edl/cli.py TrainConfig): batch 8 x 128, byte vocabulary.
    "default": (
        dict(
            vocab_size=259,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        8,
        128,
    ),
    # Llama-3.2-1B's shape (1.24B parameters), batch 8 x 2048.
    "1b": (
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            run=RunOptions(remat="dots_no_batch"),
        ),
        8,
        2048,
    ),
}


def _measure(name: str, dtype, steps: int, peak: float) -> dict:
    fields, batch, seq = CONFIGS[name]
    config = LlamaConfig(**fields, max_position_embeddings=max(2048, seq), tie_word_embeddings=True)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    model = edl.module.to_dtype(model, dtype)
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=1e-4, total_steps=1000))

    def loss_fn(model, batch):
        return model.compute_loss(batch["input_ids"], segment_ids=batch["segment_ids"])

    step = make_train_step(loss_fn, tx, clip_norm=1.0)
    state = edl.create_state(model, tx)
    rng = np.random.default_rng(0)
    data = {
        "input_ids": jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq)), jnp.int32),
        "segment_ids": jnp.ones((batch, seq), jnp.int32),
    }
    t0 = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, data)  # warm-up
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - t0) / steps
    rate = batch * seq / seconds
    fpt = flops_per_token(config, seq)
    return {
        "config": name,
        "parameters": edl.count_params(model),
        "batch": batch,
        "seq": seq,
        "dtype": jnp.dtype(dtype).name,
        "step_ms": seconds * 1e3,
        "tokens_per_s": rate,
        "tflops": rate * fpt / 1e12,
        "mfu": rate * fpt / peak,
        "compile_s": compile_s,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        default="default,1b" if gpu else "default",
        help="comma-separated configs: default (edl train's model), 1b",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16" if gpu else "float32",
        help="the model's parameter dtype (bfloat16 on GPU, else float32)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed train steps per config")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0 if gpu else 0.1,
        help="the device's peak TFLOP/s, for MFU (989: H100 bf16 dense)",
    )
    return parser


def main() -> None:
    # As the edl command does (edl.cli.allocator); EDL_HUGE_PAGES=0 keeps the environment.
    reexec_with_huge_pages(["-m", "benchmarks.train", *sys.argv[1:]])
    args = build_parser().parse_args()
    peak = args.peak_tflops * 1e12
    rows = [
        _measure(name, jnp.dtype(args.dtype), args.steps, peak) for name in args.configs.split(",")
    ]
    print(f"train step, backend {jax.default_backend()}, peak {args.peak_tflops} TFLOP/s")
    print(
        table(
            [
                "config",
                "params",
                "batch x seq",
                "dtype",
                "step ms",
                "tok/s",
                "TFLOP/s",
                "MFU",
                "compile s",
            ],
            [
                [
                    r["config"],
                    f"{r['parameters']:,}",
                    f"{r['batch']}x{r['seq']}",
                    r["dtype"],
                    r["step_ms"],
                    r["tokens_per_s"],
                    r["tflops"],
                    r["mfu"],
                    r["compile_s"],
                ]
                for r in rows
            ],
        )
    )
    print("wrote", write_json("train", rows, peak_tflops=args.peak_tflops))


if __name__ == "__main__":
    main()
