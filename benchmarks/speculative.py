"""Speculative decoding in ``generate``: acceptance rate and tokens/s against plain greedy.

The generate benchmark's tiny Llama (hidden 256, 4 layers, vocab 1024, float32, random
weights), 32-token random prompts, 64 new tokens, greedy, batch 1 and 8. Random weights
copy nothing and draft badly, so each drafter gets the setting that shows its mechanics:

- ``ngram, repeats``: prompt lookup on the model as initialised, whose greedy continuation
  repeats one token or a short cycle (text that repeats: prompt lookup's best case).
- ``ngram, varied``: prompt lookup on the weights scaled by 4 (a varied continuation that
  never repeats: drafts rejected; the cost of speculating for nothing).
- ``draft``: the scaled model with the output projections (``o_proj``, ``down_proj``) of
  its layers 2-4 scaled by ``--tail-scale``, so that its first layer alone (the draft
  model, a quarter of the cost) agrees with it part of the time, as a smaller model of the
  same family would.

Speed-up = plain greedy's seconds / speculative's, medians of ``--rounds`` interleaved
rounds (each timed call right after an untimed one of itself). ``same_rows``: rows whose
output equals plain greedy's (the untrained model's logits have near-ties, one float32 ulp
apart, where a ``k + 1``-token forward's rounding can pick the other token). Acceptance =
accepted / drafted tokens; tokens per forward = new tokens per target forward (the
prefill's included).

    python -m benchmarks.speculative [--quick] [--k 2 4 8] [--rounds 7] [--tail-scale 0.2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import numpy as np

from benchmarks._common import interleaved_rounds, table, write_json
from edl.generate import SpeculativeConfig, generate
from edl.models import LlamaConfig, LlamaForCausalLM


def _target(quick: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64 if quick else 256,
        intermediate_size=172 if quick else 688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(0))


def _scaled(model, factor: float):
    return jax.tree.map(lambda x: x * factor if x.ndim > 1 else x, model)


def _damped_tail(model, scale: float):
    """Layers 2.. with their residual contributions (``o_proj``, ``down_proj``) scaled."""

    def damp(path, x):
        name = jax.tree_util.keystr(path)
        if "o_proj" in name or "down_proj" in name:
            return x.at[1:].multiply(scale)
        return x

    layers = jax.tree_util.tree_map_with_path(damp, model.model.layers)
    return dataclasses.replace(model, model=dataclasses.replace(model.model, layers=layers))


def first_layers(model, n: int):
    """``model`` with only its first ``n`` layers (the draft model here)."""
    trunk = model.model
    layers = jax.tree.map(lambda x: x[:n], trunk.layers)
    config = trunk.config.replace(num_hidden_layers=n)
    return dataclasses.replace(
        model, model=dataclasses.replace(trunk, layers=layers, config=config)
    )


def _call(model, ids, new, spec=None, draft=None):
    return lambda: generate(model, ids, max_new_tokens=new, speculative=spec, draft_model=draft)


def _rows(name, model, ids, new, ks, rounds, draft=None):
    """One table row per k: acceptance, tokens per target forward and the speed-up."""
    method = "draft" if draft is not None else "ngram"
    plain = _call(model, ids, new)
    expected = np.asarray(plain().sequences)
    calls = {"plain": plain}
    stats = {}
    for k in ks:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
        calls[k] = _call(model, ids, new, spec, draft)
        out = calls[k]()
        stats[k] = out
    samples = interleaved_rounds(calls, rounds, warm_each=True)
    base = statistics.median(samples["plain"])
    rows = []
    for k in ks:
        out, seconds = stats[k], statistics.median(samples[k])
        s = out.speculative
        accepted, drafted = int(np.sum(s.accepted)), int(np.sum(s.drafted))
        rows.append(
            {
                "setting": name,
                "method": method,
                "batch": ids.shape[0],
                "k": k,
                "acceptance": accepted / max(drafted, 1),
                # rows token-identical to plain greedy (a float near-tie may part them)
                "same_rows": int(np.sum(np.all(np.asarray(out.sequences) == expected, axis=1))),
                # the prefill's forward gives the first token
                "tokens_per_forward": float(np.mean(np.asarray(out.num_new) / (s.steps + 1))),
                "plain_tokens_per_s": ids.shape[0] * new / base,
                "spec_tokens_per_s": ids.shape[0] * new / seconds,
                "speedup": base / seconds,
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a narrow model, 16 new tokens")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="draft lengths")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument(
        "--tail-scale", type=float, default=0.2, help="draft setting: layers 2-4's output scale"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    new = 16 if args.quick else 64
    rounds = 2 if args.quick else args.rounds
    plain = _target(args.quick)
    varied = _scaled(plain, 4.0)
    damped = _damped_tail(varied, args.tail_scale)
    rows = []
    for batch in (1, 8):
        ids = np.asarray(jax.random.randint(jax.random.key(batch), (batch, 32), 1, 1024))
        rows += _rows("repeats", plain, ids, new, args.k, rounds)
        rows += _rows("varied", varied, ids, new, args.k, rounds)
        rows += _rows("damped tail", damped, ids, new, args.k, rounds, first_layers(damped, 1))
    keys = [
        "setting",
        "method",
        "batch",
        "k",
        "acceptance",
        "same_rows",
        "tokens_per_forward",
        "plain_tokens_per_s",
        "spec_tokens_per_s",
        "speedup",
    ]
    print(table(keys, [[r[key] for key in keys] for r in rows]))
    path = write_json("speculative", rows, rounds=rounds, tail_scale=args.tail_scale)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
