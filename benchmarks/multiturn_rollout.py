"""Multi-turn rollout time: each turn decoding only the rows still going (batches padded to
the next power of two, ``edl.train.multiturn.turn_batch_size``) against the former full
batch of every row, finished ones repeated.

Setting: ``benchmarks.grpo_tools``' rollout shape (64 rows: 8 prompts x 8 samples, a 2-layer
width-64 byte-level Llama, up to 64 new tokens per turn) with 3 turns against a chat
environment that answers every turn and ends a conversation when the turn's text has an
even length, so rows end at different turns. The random model's EOS logit is raised
(``--eos-bias``) so that turns end within the budget. Both paths draw the same tokens
(``tests/test_train_multiturn_compact.py``); the time is the median over ``--repeats``
rollouts on 4 keys after a warm-up over the same keys (compiling excluded).

    python -m benchmarks.multiturn_rollout [--eos-bias 0.3] [--repeats 9]

Prints per path the median seconds and every time, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import equinox as eqx
import jax

from benchmarks.grpo_tools import tool_tokenizer
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import multiturn


class Chatter:
    """Answers every turn; done when the turn's text has an even length."""

    tools = None
    stop = None

    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, message):
        n = len(message["content"])
        return [{"role": "user", "content": "go on"}], float(n), n % 2 == 0


def eos_prone_model(tok, bias: float):
    """A random 2-layer width-64 Llama with a constant direction in every embedding that the
    EOS row of the LM head reads (weight ``bias``)."""
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    embed = model.model.embed_tokens.weight.at[:, 0].add(3.0)
    head = model.lm_head.weight.at[tok.eos_id, 0].set(bias)
    where = lambda m: (m.model.embed_tokens.weight, m.lm_head.weight)
    return eqx.tree_at(where, model, (embed, head))


def rollout(model, tok, key: int, full: bool) -> tuple[float, list]:
    """One rollout's seconds and rows; ``full``: every turn a batch of all the rows."""
    compact = multiturn.turn_batch_size
    if full:
        multiturn.turn_batch_size = lambda active, rows: rows
    try:
        t0 = time.perf_counter()
        rows = multiturn.multi_turn_rollout(
            model,
            tok,
            [Chatter() for _ in range(64)],
            [{"prompt": f"{i * 37 % 1000}*{i * 91 % 1000}"} for i in range(8) for _ in range(8)],
            key=jax.random.key(key),
            max_turns=3,
            eos_id=tok.eos_id,
            sampling={"max_new_tokens": 64, "temperature": 1.0, "pad_token_id": tok.pad_id},
        )
        return time.perf_counter() - t0, rows
    finally:
        multiturn.turn_batch_size = compact


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eos-bias", type=float, default=0.3, help="the EOS logit's weight")
    p.add_argument("--repeats", type=int, default=9, help="timed rollouts per path")
    return p


def main() -> None:
    args = build_parser().parse_args()
    tok = tool_tokenizer()
    model = eos_prone_model(tok, args.eos_bias)
    for full in (True, False):  # warm-up: every width and batch size compiled
        for k in range(8):
            rollout(model, tok, k % 4, full)
    times: dict[str, list[float]] = {"full": [], "compacted": []}
    for k in range(args.repeats):
        for name in times:
            seconds, rows = rollout(model, tok, k % 4, name == "full")
            times[name].append(seconds)
        turns = [sum(r.turns == t for r in rows) for t in (1, 2, 3)]
        own = sum(sum(r.own) for r in rows) / len(rows)
        print(f"rows ending at turns 1/2/3: {turns}, own tokens per row {own:.1f}", flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    for name, values in times.items():
        print(f"{name}: median {medians[name]:.3f} s, {[round(v, 3) for v in values]}")
    print(json.dumps({"eos_bias": args.eos_bias, "median_s": medians}))


if __name__ == "__main__":
    main()
