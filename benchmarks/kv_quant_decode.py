"""Decode speed on CPU with the KV cache's pages stored as float32, int8 or fp8_e4m3, read by
the native paged kernel (``edl.kernels.native``; ``"auto"`` on CPU), and int8 / fp8 through
XLA's dequantizing gather (``"xla"``, what ``"auto"`` ran before the kernels read quantized
pages).

A random byte-level Llama (``benchmarks._common.byte_llama_config``: ``--hidden`` wide,
``--layers`` layers, 64-wide heads) continues ``--batch`` prompts of ``--prompt`` tokens
greedily for ``--new`` tokens through the paged cache (``generate(..., page_size=16)``).
Each variant is compiled first, then the variants are called in interleaved rounds
(``benchmarks._common.interleaved_rounds``); reported: the median seconds per call and
``batch * new / median`` generated tokens per second (prefill included, a short share with
these defaults).

    python -m benchmarks.kv_quant_decode [--rounds 5] [--batch 8] [--prompt 240] [--new 64]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from benchmarks._common import byte_llama_config, interleaved_rounds, table, write_json
from edl.generate import generate
from edl.models import LlamaForCausalLM

VARIANTS = {  # name: (kv_cache_dtype, attention_impl)
    "float32 / native": ("auto", "auto"),
    "int8 / native": ("int8", "auto"),
    "fp8_e4m3 / native": ("fp8_e4m3", "auto"),
    "int8 / xla": ("int8", "xla"),
    "fp8_e4m3 / xla": ("fp8_e4m3", "xla"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--hidden", type=int, default=256, help="the model's width (64-wide heads)")
    add("--layers", type=int, default=4, help="decoder layers")
    add("--batch", type=int, default=8, help="prompts decoded at once")
    add("--prompt", type=int, default=240, help="tokens per prompt")
    add("--new", type=int, default=64, help="tokens generated per prompt")
    add("--rounds", type=int, default=5, help="interleaved timed rounds (medians over them)")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    config = byte_llama_config(args.hidden, args.layers, args.prompt + args.new + 16)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.prompt))
    calls = {}
    for name, (dtype, impl) in VARIANTS.items():
        model = LlamaForCausalLM.init(config.replace(attention_impl=impl), key=jax.random.key(0))

        def call(model=model, dtype=dtype):
            return generate(
                model, ids, max_new_tokens=args.new, page_size=16, kv_cache_dtype=dtype
            ).sequences

        jax.block_until_ready(call())  # compile
        calls[name] = call
    samples = interleaved_rounds(calls, args.rounds)
    rows = []
    for name, times in samples.items():
        median = statistics.median(times)
        tok_per_s = round(args.batch * args.new / median, 1)
        rows.append({"variant": name, "median_s": round(median, 3), "tok_per_s": tok_per_s})
    print(table(list(rows[0]), [list(r.values()) for r in rows]))
    write_json("kv_quant_decode", rows, **vars(args))


if __name__ == "__main__":
    main()
