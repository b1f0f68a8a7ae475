"""What log-probs cost the serving engine: the same batch of greedy requests through
``edl.serve.Engine`` without log-probs, with the generated tokens' top-k log-probs, and with
prompt log-probs too (echo, lm-evaluation-harness's loglikelihood requests), in interleaved
rounds on one engine, after one untimed round per mode (which compiles the step programs
the rounds use; ``Engine.warmup`` would compile every shape, minutes here).

    python -m benchmarks.serve_logprobs [--quick] [--requests 16] [--prompt-len 100]
                                        [--max-tokens 32] [--rounds 5]

Reports per mode the median seconds of a round (all requests, admitted at once and run to
the end), generated tokens/s and the ratio to the mode without log-probs; writes
``benchmarks/results/serve_logprobs.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks._common import byte_llama_config, table, write_json
from edl.models import LlamaForCausalLM
from edl.serve.engine import Engine
from edl.serve.types import SamplingParams

MODES = {
    "off": {},
    "logprobs 5": {"logprobs": 5},
    "logprobs 5 + prompt": {"logprobs": 5, "prompt_logprobs": 5},
}


def _round(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~3M model, 3 rounds")
    parser.add_argument("--requests", type=int, default=16, help="requests per round (batch)")
    parser.add_argument("--prompt-len", type=int, default=100, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--hidden", type=int, default=384, help="the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=6, help="its decoder layers")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per mode")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.hidden, args.layers, args.rounds = 128, 2, 3
    max_len = args.prompt_len + args.max_tokens
    model = LlamaForCausalLM.init(
        byte_llama_config(args.hidden, args.layers, max_len), key=jax.random.key(0)
    )
    engine = Engine(
        model,
        max_batch=args.requests,
        max_model_len=max_len,
        prefill_chunk=128,
        prefill_tokens=256,
        prefix_caching=False,  # every round computes its prompts, in every mode alike
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(args.requests)]
    params = {
        name: SamplingParams(max_tokens=args.max_tokens, temperature=0.0, **kw)
        for name, kw in MODES.items()
    }
    start = time.perf_counter()
    for p in params.values():  # one untimed round each: compiles, host caches, allocator
        _round(engine, prompts, p)
    print(f"first rounds (compiling): {time.perf_counter() - start:.0f} s", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, p in params.items():
            seconds[name].append(_round(engine, prompts, p))
    tokens = args.requests * args.max_tokens
    base = statistics.median(seconds["off"])
    rows = [
        {
            "mode": name,
            "median_s": statistics.median(s),
            "tokens_per_s": tokens / statistics.median(s),
            "relative_throughput": base / statistics.median(s),
        }
        for name, s in seconds.items()
    ]
    header = ["mode", "median s", "tokens/s", "throughput vs off"]
    print(table(header, [list(r.values()) for r in rows]))
    write_json("serve_logprobs", rows, **vars(args))


if __name__ == "__main__":
    main()
