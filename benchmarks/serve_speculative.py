"""Speculative decoding in the serving engine: tokens/s with and without prompt lookup.

The generate benchmark's tiny Llama (hidden 256, 4 layers, vocab 1024, float32, random
weights), ``--batch`` requests of 32 random prompt tokens added at once, 64 greedy new
tokens each, through ``edl.serve.Engine`` (``max_batch`` 8, pages of 16). Random weights
copy nothing, so the two settings of ``benchmarks/speculative.py`` show prompt lookup's
mechanics:

- ``repeats``: the model as initialised, whose greedy continuation repeats a token or a
  short cycle (text that copies: prompt lookup's best case);
- ``varied``: the weights scaled by 4 (a continuation that never repeats: every draft
  rejected, what speculating costs for nothing; most steps then have no draft at all and
  run the plain width-1 decode call).
- ``damped tail`` (``--draft``): a draft model, ``benchmarks/speculative.py``'s setting:
  the varied model with its layers 2-4's output projections scaled by ``--tail-scale``,
  drafted for by its own first layer (a quarter of the cost).

Tokens/s = all requests' new tokens / the seconds from adding them to the last one
finishing (prefill included), medians of ``--rounds`` interleaved rounds after an untimed
run that compiles every shape used. Acceptance = accepted / drafted tokens
(``Engine.speculation_counts``); ``same``: requests whose tokens equal plain decoding's.

    python -m benchmarks.serve_speculative [--quick] [--k 2 4 8] [--batch 1 8] [--rounds 5]
        [--draft] [--tail-scale 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks._common import table, write_json
from benchmarks.speculative import _damped_tail, _scaled, _target, first_layers
from edl.generate import SpeculativeConfig
from edl.serve import Engine, SamplingParams


def _serve(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    """Every prompt at once, greedy, until all finish: their tokens and the seconds."""
    params = SamplingParams(max_tokens=new, temperature=0.0)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids], time.perf_counter() - start


def _rows(name, model, prompts, new, ks, rounds, draft=None):
    """One table row per k: acceptance, plain and speculative tokens/s, the speed-up."""
    # No prefix caching: every round prefills its prompts whole, in the shapes compiled.
    geometry = dict(
        max_batch=8, max_model_len=128, page_size=16, prefill_chunk=64, prefix_caching=False
    )
    engines = {"plain": Engine(model, **geometry)}
    for k in ks:
        method = "ngram" if draft is None else "draft"
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
        engines[k] = Engine(model, speculative=spec, draft_model=draft, **geometry)
    first = {key: _serve(engine, prompts, new)[0] for key, engine in engines.items()}  # compiles
    counts = {k: engines[k].speculation_counts for k in ks}
    seconds: dict[object, list[float]] = {key: [] for key in engines}
    for _ in range(rounds):
        for key, engine in engines.items():
            seconds[key].append(_serve(engine, prompts, new)[1])
    total = len(prompts) * new
    base = statistics.median(seconds["plain"])
    rows = []
    for k in ks:
        drafted, accepted = counts[k]
        median = statistics.median(seconds[k])
        same = sum(a == b for a, b in zip(first[k], first["plain"], strict=True))
        rows.append(
            {
                "setting": name,
                "batch": len(prompts),
                "k": k,
                "acceptance": accepted / max(drafted, 1),
                "same": f"{same}/{len(prompts)}",
                "plain_tokens_per_s": total / base,
                "spec_tokens_per_s": total / median,
                "speedup": base / median,
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a narrow model, 16 new tokens")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="draft lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests at once")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--draft", action="store_true", help="also the draft-model setting")
    parser.add_argument(
        "--tail-scale", type=float, default=0.2, help="draft setting: layers 2-4's output scale"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    new = 16 if args.quick else 64
    rounds = 2 if args.quick else args.rounds
    repeats = _target(args.quick)
    varied = _scaled(repeats, 4.0)
    rows = []
    for batch in args.batch:
        ids = np.asarray(jax.random.randint(jax.random.key(batch), (batch, 32), 1, 1024))
        prompts = ids.tolist()
        rows += _rows("repeats", repeats, prompts, new, args.k, rounds)
        rows += _rows("varied", varied, prompts, new, args.k, rounds)
        if args.draft:
            damped = _damped_tail(varied, args.tail_scale)
            draft = first_layers(damped, 1)
            rows += _rows("damped tail", damped, prompts, new, args.k, rounds, draft)
    keys = list(rows[0])
    print(table(keys, [[r[key] for key in keys] for r in rows]))
    path = write_json("serve_speculative", rows, rounds=rounds, new_tokens=new)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
