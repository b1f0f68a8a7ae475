"""GRPO worked example: a tiny byte-level Llama learns, by reinforcement alone, to repeat the
prompt's letter; the sampler and the trainer share one parameter pytree.

Task: the prompt is ``"<c>>"`` with ``c`` one of ``a b c d``; the reward is the fraction of
the completion's first 8 characters equal to ``c`` (``match``), plus, weighted 0.5, a length
term ``-|len - 8| / 8`` (``length``). A 2-layer Llama (hidden 64, byte tokenizer,
``edl.train.ByteTokenizer``) is initialised from scratch and warmed up by a short SFT on
*random* ``a-d`` strings of 4-12 letters after the prompt (so it writes letters and stops,
but ignores the prompt: expected match 0.25); GRPO (``edl.train.make_grpo_step``: 8 prompts
x 8 completions per step, temperature 1, two updates per batch, beta 0) must then teach it
to copy the letter, which only the reward says.

The loop is ``edl.train.train`` itself (the GRPO step is a step function like any other;
here without an output directory, so no checkpoints). Memory: the params' bytes, the state's
(params + AdamW moments) and the largest total of live jax arrays measured right after each
rollout's sampling: below state + params means generation used the state's own arrays, not
a copy.

    python -m benchmarks.grpo [--steps 300] [--sft-steps 300]

Prints progress, then LAST one JSON line: ``reward_first`` / ``reward_last`` (mean reward
over the first / last 10% of GRPO steps), ``sample_s`` / ``train_s`` / ``reward_s``
(seconds in sampling, in scoring + updates, in decoding + reward functions), memory numbers.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import (
    ByteTokenizer,
    GRPOConfig,
    LogConfig,
    RunConfig,
    callback,
    make_grpo_step,
    make_train_step,
    train,
)

LETTERS = "abcd"
TARGET = 8


def match(prompts: list[str], completions: list[str], ids: list[list[int]]) -> list[float]:
    """Fraction of the first TARGET characters equal to the prompt's letter."""
    return [
        sum(ch == p[0] for ch in c[:TARGET]) / TARGET
        for p, c in zip(prompts, completions, strict=True)
    ]


def length(prompts: list[str], completions: list[str], ids: list[list[int]]) -> list[float]:
    """-|len - TARGET| / TARGET."""
    return [-abs(len(c) - TARGET) / TARGET for c in completions]


def _sft_batches(tok: ByteTokenizer, rng: np.random.Generator, batch: int, seq: int):
    """Prompt ``"<c>>"`` then a random a-d string of 4-12 letters and EOS, right-padded;
    labels -100 on the prompt and padding."""
    while True:
        ids = np.full((batch, seq), tok.pad_id, np.int32)
        labels = np.full((batch, seq), -100, np.int32)
        for i in range(batch):
            prompt = tok.encode(rng.choice(list(LETTERS)) + ">")
            body = tok.encode("".join(rng.choice(list(LETTERS), rng.integers(4, 13))))
            row = prompt + body + [tok.eos_id]
            ids[i, : len(row)] = row
            labels[i, len(prompt) : len(row)] = row[len(prompt) :]
        yield {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels)}


def _sft(model, tok, steps: int, rng) -> LlamaForCausalLM:
    tx = optax.adam(3e-3)
    state = edl.create_state(model, tx)

    def loss_fn(m, b):
        return m.compute_loss(b["input_ids"], b["labels"], attention_mask=b["input_ids"] != 256)

    step = make_train_step(loss_fn, tx)
    data = _sft_batches(tok, rng, 32, 16)
    for i in range(steps):
        state, metrics = step(state, next(data))
        if (i + 1) % 100 == 0:
            print(f"sft step {i + 1}: loss {float(metrics['loss']):.3f}", flush=True)
    return edl.state.model(state)


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="GRPO steps")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t_start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    tok = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(args.seed))
    t0 = time.perf_counter()
    model = _sft(model, tok, args.sft_steps, rng)
    sft_s = time.perf_counter() - t0

    grpo = GRPOConfig(
        num_generations=args.generations,
        max_new_tokens=TARGET + 4,
        temperature=1.0,
        num_iterations=2,
        loss_type="grpo",
        reward_weights=(1.0, 0.5),
    )
    tx = optax.adam(args.lr)
    state = edl.create_state(model, tx)
    del model
    step = make_grpo_step(tx, tok, [match, length], grpo, key=jax.random.key(args.seed + 1))
    live = []
    rollout = step.rollout

    def measured_rollout(*a, **k):
        out = rollout(*a, **k)
        live.append(_live_bytes())  # the state, the rollout's batch, the sampler's outputs
        return out

    step.rollout = measured_rollout
    history = []

    def log(info):
        history.append(dict(info.metrics))
        if info.step % 10 == 0 or info.step == 1:
            m = info.metrics
            print(
                f"grpo step {info.step}: reward {m['reward_mean']:.3f} (match "
                f"{m['reward/match']:.3f}, length {m['reward/length']:.3f}) len "
                f"{m['completion_length']:.1f} loss {m['loss']:.4f} clip {m['clip_ratio']:.3f} "
                f"sample {m['sample_s'] * 1e3:.0f} ms train {m['train_s'] * 1e3:.0f} ms",
                flush=True,
            )

    def prompts():
        while True:
            yield [rng.choice(list(LETTERS)) + ">" for _ in range(args.prompts)]

    state, _ = train(
        state,
        step,
        prompts(),
        RunConfig(steps=args.steps, log=LogConfig(progress=False)),
        callbacks=[callback(log)],
    )
    last = step.last_rollout
    print("samples:", list(zip(last["prompts"], last["completions"], strict=True))[:6])
    tenth = max(1, len(history) // 10)
    mean = lambda rows, k: float(np.mean([r[k] for r in rows]))
    params_bytes, state_bytes = edl.nbytes(state.params), edl.nbytes(state)
    result = {
        "benchmark": "grpo",
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "steps": len(history),
        "rows_per_step": args.prompts * args.generations,
        "parameters": edl.count_params(state.params),
        "reward_first": mean(history[:tenth], "reward_mean"),
        "reward_last": mean(history[-tenth:], "reward_mean"),
        "match_first": mean(history[:tenth], "reward/match"),
        "match_last": mean(history[-tenth:], "reward/match"),
        "length_last": mean(history[-tenth:], "completion_length"),
        "sample_s": sum(r["sample_s"] for r in history),
        "train_s": sum(r["train_s"] for r in history),
        "reward_s": sum(r["reward_s"] for r in history),
        "first_step_s": history[0]["sample_s"] + history[0]["train_s"],
        "sft_s": sft_s,
        "total_s": time.perf_counter() - t_start,
        "params_bytes": params_bytes,
        "state_bytes": state_bytes,
        "live_bytes_after_sampling_max": max(live),
        "no_param_copy": max(live) < state_bytes + params_bytes,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
