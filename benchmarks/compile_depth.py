"""Compile time of a forward pass against depth, layers scanned as periods vs unrolled.

Gemma 3's five sliding layers per global one (two RoPE bases) and SmolLM3's NoPE layer every
fourth are layer patterns; edl scans each repeated pattern as one ``lax.scan`` over periods
(``edl.nn.schedule.plan_schedule``), so the compiled program, and the time to compile it,
should not grow with depth, where the unrolled form (``scan_layers=False``) grows linearly.
Each row lowers and compiles a fresh ``jax.jit`` of the logits of a small model (hidden 64,
batch 1 x 16 tokens) ``--repeats`` times and reports the median.

    python -m benchmarks.compile_depth [--family gemma3_text] [--layers 12 24 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from edl.models import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    configure,
)

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
FAMILIES = {
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, dict(sliding_window=8)),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {}),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_depth", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--family", choices=sorted(FAMILIES), default="gemma3_text", help="the model family"
    )
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[12, 24, 48], help="depths to compile"
    )
    parser.add_argument("--repeats", type=int, default=3, help="compiles per row (median)")
    return parser


def compile_seconds(model, ids, repeats: int) -> float:
    """Median seconds to lower and compile a fresh jit of ``model``'s logits."""
    times = []
    for _ in range(repeats):
        fn = jax.jit(lambda m, i: m(i).logits)
        start = time.perf_counter()
        fn.lower(model, ids).compile()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config_cls, model_cls, extra = FAMILIES[args.family]
    ids = jnp.zeros((1, 16), jnp.int32)
    print(f"{args.family}: layers | scanned s | unrolled s")
    for n in args.layers:
        config = config_cls(**SMALL, **extra, num_hidden_layers=n)
        model = model_cls.init(config, key=jax.random.key(0))
        scanned = compile_seconds(model, ids, args.repeats)
        unrolled = compile_seconds(configure(model, scan_layers=False), ids, args.repeats)
        print(f"{n:6d} | {scanned:9.2f} | {unrolled:10.2f}")


if __name__ == "__main__":
    main()
