"""GRPO rollout throughput of the two rollout backends, ``generate`` (``edl.generate``'s
fixed-batch decode loop) and ``engine`` (the serving engine, each prompt's samples sharing its
prompt pages), on the same model, prompts and sampling settings: sampled tokens per second.

Each setting (``--prompt-lens``: one run per prompt length) samples ``--generations``
completions of ``--prompts`` random byte prompts of that length, ``--max-new-tokens`` each,
at temperature 1 from a randomly initialised byte-level Llama (``--model``: ``tiny``, 2
layers of width 64, or ``small``, 4 layers of width 256), through
``edl.train.rollout_backends.ROLLOUT_BACKENDS`` exactly as ``make_grpo_step`` calls it. Both
backends are run ``--warmup-rounds`` times untimed (compiling: the engine compiles a shape
when its rows first finish at such times), then ``--rounds`` timed rounds, the backends
interleaved within a round (``benchmarks._common.interleaved_rounds``) and each round with a
new key; tokens/s is the sampled tokens (the stop token included) over the round's seconds,
reported as the median over rounds.

    python -m benchmarks.grpo_rollouts [--model tiny] [--prompt-lens 8 256] [--rounds 5]

Prints one markdown row per setting, then LAST one JSON line with every round's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from benchmarks._common import interleaved_rounds
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import ByteTokenizer
from edl.train.grpo import _left_pad
from edl.train.rollout_backends import ROLLOUT_BACKENDS

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8
    ),
}


def _model(name: str) -> LlamaForCausalLM:
    sizes = MODELS[name]
    config = LlamaConfig(
        vocab_size=ByteTokenizer().vocab_size,
        num_key_value_heads=sizes["num_attention_heads"] // 2,
        **sizes,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(0))


def run_setting(model, args: argparse.Namespace, prompt_len: int) -> dict:
    """Both backends on ``--prompts`` prompts of ``prompt_len`` tokens: each round's seconds
    and tokens, and the medians."""
    tok = ByteTokenizer()
    rng = np.random.default_rng(prompt_len)
    prompts = [rng.integers(3, 256, prompt_len).tolist() for _ in range(args.prompts)]
    g = args.generations
    padded = _left_pad([p for p in prompts for _ in range(g)], tok.pad_id)
    counts: dict[str, list[int]] = {name: [] for name in args.backends}
    keys = iter(range(10**6))

    def call(name):
        def run():
            tokens, num_new = ROLLOUT_BACKENDS[name].sample(
                model,
                prompts,
                g,
                jax.random.key(next(keys) // len(args.backends)),
                max_new_tokens=args.max_new_tokens,
                temperature=1.0,
                top_k=None,
                top_p=1.0,
                eos_id=tok.eos_id,
                pad_id=tok.pad_id,
                padded=padded,
            )
            counts[name].append(int(np.sum(num_new)))
            return tokens

        return run

    calls = {name: call(name) for name in args.backends}
    t0 = time.perf_counter()
    interleaved_rounds(calls, 1)  # compiles (both backends' programs)
    compile_s = time.perf_counter() - t0
    # The engine's later shapes (rows finishing at other times) compile in the next rounds.
    interleaved_rounds(calls, args.warmup_rounds - 1)
    seconds = interleaved_rounds(calls, args.rounds)
    out = {"prompt_len": prompt_len, "first_round_s": compile_s}
    for name in args.backends:
        timed = counts[name][args.warmup_rounds :]  # the untimed rounds' counts dropped
        rates = [n / s for n, s in zip(timed, seconds[name], strict=True)]
        out[name] = {
            "seconds": seconds[name],
            "tokens": timed,
            "tokens_per_s": rates,
            "median_tokens_per_s": statistics.median(rates),
            "median_s": statistics.median(seconds[name]),
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", choices=sorted(MODELS), default="tiny", help="model size (random init)")
    add("--prompt-lens", type=int, nargs="+", default=[8, 256], help="prompt lengths, one run each")
    add("--prompts", type=int, default=4, help="prompts per rollout")
    add("--generations", type=int, default=8, help="completions per prompt (GRPO's G)")
    add("--max-new-tokens", type=int, default=32, help="tokens per completion, at most")
    add("--rounds", type=int, default=5, help="timed rounds (medians over them)")
    add("--warmup-rounds", type=int, default=3, help="untimed rounds first (compiling), >= 1")
    add(
        "--backends",
        nargs="+",
        default=list(ROLLOUT_BACKENDS),
        choices=list(ROLLOUT_BACKENDS),
        help="the rollout backends to compare",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    model = _model(args.model)
    results = [run_setting(model, args, n) for n in args.prompt_lens]
    names = args.backends
    print("| prompt tokens | " + " | ".join(f"{n} tokens/s" for n in names) + " |")
    print("|---:|" + "---:|" * len(names))
    for r in results:
        rates = " | ".join(f"{r[n]['median_tokens_per_s']:.0f}" for n in names)
        print(f"| {r['prompt_len']} | {rates} |")
    print(
        json.dumps(
            {
                "benchmark": "grpo_rollouts",
                "backend": jax.default_backend(),
                "jax": jax.__version__,
                "settings": vars(args),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
