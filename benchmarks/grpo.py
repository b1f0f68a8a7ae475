"""GRPO worked example: a tiny byte-level Llama learns, by reinforcement alone, to repeat its
prompt's letter, over several seeds; the sampler and the trainer share one parameter pytree.

Task: the prompt is ``"<c>>"`` with ``c`` one of ``a b c d``; the reward is the fraction of
the completion's first 8 characters equal to ``c`` (``match``), plus, weighted 0.5, a length
term ``-|len - 8| / 8`` (``length``). For each seed a 2-layer Llama (hidden 64, byte
tokenizer, ``edl.train.ByteTokenizer``) is initialised from scratch and warmed up by a short
SFT on *random* ``a-d`` strings of 4-12 letters after the prompt (so it writes letters and
stops, but ignores the prompt: expected match 0.25); GRPO (``edl.train.make_grpo_step``)
must then teach it to copy the letter, which only the reward says.

What keeps every seed learning (one seed's run is chaotic: a flipped sampled token sends it
down another path): each step's prompts hold every letter equally often (``--prompts`` a
multiple of 4, default 16), so the part of an update that raises one letter for *every*
prompt cancels within the step; with 8 prompts drawn at random (this example's earlier
setting) it did not, and runs drifted to one letter for all prompts, after which every
completion of a group is equal, the advantages are 0 and learning stops. And a smaller
learning rate (Adam 1e-3, 300 steps; 3e-3 over 200 let a prompt settle on a wrong letter
in 2 of 5 seeds, which the length term then kept reinforcing). ``--beta`` adds GRPO's KL
term to the SFT model (a frozen copy, ``reference=``); 0 by default, as in TRL: at 0.04 it
held seed 0 at chance for 200 steps.

The loop is ``edl.train.train`` itself (without an output directory, so no checkpoints).
Memory: the params' bytes, the state's (params + AdamW moments) and the largest total of
live jax arrays measured right after each rollout's sampling: below state + params (+ the
reference with ``--beta``) means generation used the state's own arrays, not a copy.

    python -m benchmarks.grpo [--seeds 0 1 2 3 4] [--steps 300] [--lr 1e-3] [--beta 0]

Prints progress, a markdown table (per seed: reward and match over the first / last 10% of
GRPO steps; then their mean, min and max over the seeds), then LAST one JSON line: the
settings, per-seed results (also ``sample_s`` / ``train_s`` / ``reward_s``, seconds in
sampling, in scoring + updates, in decoding + reward functions; memory numbers) and the
summary over seeds.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import equinox as eqx
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
    for _ in range(steps):
        state, metrics = step(state, next(data))
    print(f"  sft {steps} steps: loss {float(metrics['loss']):.3f}", flush=True)
    return edl.state.model(state)


def _prompt_batches(rng: np.random.Generator, size: int):
    """Each batch: every letter ``size / 4`` times, shuffled."""
    while True:
        yield [c + ">" for c in rng.permutation(list(LETTERS) * (size // len(LETTERS)))]


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def _sft_model(seed: int, sft_steps: int, rng: np.random.Generator) -> LlamaForCausalLM:
    """The seed's 2-layer Llama, from scratch, after the SFT warm-up."""
    config = LlamaConfig(
        vocab_size=ByteTokenizer().vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(seed))
    return _sft(model, ByteTokenizer(), sft_steps, rng)


def _history_numbers(history: list[dict]) -> dict:
    """Means over the first / last 10% of steps, and seconds summed over the run."""
    tenth = max(1, len(history) // 10)
    mean = lambda rows, k: float(np.mean([r[k] for r in rows]))
    return {
        "reward_first": mean(history[:tenth], "reward_mean"),
        "reward_last": mean(history[-tenth:], "reward_mean"),
        "match_first": mean(history[:tenth], "reward/match"),
        "match_last": mean(history[-tenth:], "reward/match"),
        "length_last": mean(history[-tenth:], "completion_length"),
        "kl_last": mean(history[-tenth:], "kl"),
        "sample_s": sum(r["sample_s"] for r in history),
        "train_s": sum(r["train_s"] for r in history),
        "reward_s": sum(r["reward_s"] for r in history),
        "first_step_s": history[0]["sample_s"] + history[0]["train_s"],
        "extra_rounds": sum(r.get("dynamic_sampling/rounds", 0.0) for r in history),
        "filled_groups": sum(r.get("dynamic_sampling/filled_groups", 0.0) for r in history),
    }


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    """SFT warm-up then GRPO for one seed; returns that run's numbers."""
    gc.collect()  # the previous seed's arrays are not counted as this one's live bytes
    t_start = time.perf_counter()
    rng = np.random.default_rng(seed)
    tok = ByteTokenizer()
    model = _sft_model(seed, args.sft_steps, rng)
    sft_s = time.perf_counter() - t_start

    grpo = GRPOConfig(
        num_generations=args.generations,
        max_new_tokens=TARGET + 4,
        temperature=args.temperature,
        num_iterations=args.iterations,
        beta=args.beta,
        loss_type=args.loss_type,
        epsilon_high=args.epsilon_high,
        reward_weights=(1.0, args.length_weight),
        dynamic_sampling=args.dynamic_sampling,
        max_dynamic_sampling_rounds=args.max_sampling_rounds,
    )
    tx = optax.adam(args.lr)
    # With beta > 0, the reference for the KL term: the SFT model, frozen (a copy: the
    # state's buffers are donated to the updates; a full fine-tune has no LoRA base).
    reference = "lora_base"
    if args.beta > 0:
        reference = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
    reference_bytes = 0 if isinstance(reference, str) else edl.nbytes(reference)
    state = edl.create_state(model, tx)
    del model
    prompts = _prompt_batches(rng, args.prompts)
    step = make_grpo_step(
        tx,
        tok,
        [match, length],
        grpo,
        key=jax.random.key(seed + 1),
        reference=reference,
        prompt_source=prompts,  # dynamic sampling's further prompts: the run's own stream
    )
    live = []
    rollout = step.rollout

    def measured_rollout(*a, **k):
        out = rollout(*a, **k)
        live.append(_live_bytes())  # the state (and reference), the rollout's batch
        return out

    step.rollout = measured_rollout
    history = []

    def log(info):
        history.append(dict(info.metrics))
        if info.step % args.log_every == 0:
            m = info.metrics
            print(
                f"  grpo step {info.step}: reward {m['reward_mean']:.3f} (match "
                f"{m['reward/match']:.3f}, length {m['reward/length']:.3f}) len "
                f"{m['completion_length']:.1f} kl {m['kl']:.4f} clip {m['clip_ratio']:.3f}",
                flush=True,
            )

    state, _ = train(
        state,
        step,
        prompts,
        RunConfig(steps=args.steps, log=LogConfig(progress=False)),
        callbacks=[callback(log)],
    )
    last = step.last_rollout
    print("  samples:", list(zip(last["prompts"], last["completions"], strict=True))[::16][:4])
    params_bytes, state_bytes = edl.nbytes(state.params), edl.nbytes(state)
    return {
        "seed": seed,
        **_history_numbers(history),
        "sft_s": sft_s,
        "total_s": time.perf_counter() - t_start,
        "parameters": edl.count_params(state.params),
        "params_bytes": params_bytes,
        "state_bytes": state_bytes,
        "live_bytes_after_sampling_max": max(live),
        "no_param_copy": max(live) < state_bytes + reference_bytes + params_bytes,
    }


def summarize(results: list[dict]) -> dict:
    """Mean, min and max over seeds of each per-seed reward / match number, and whether the
    reward rose on every seed."""
    keys = ("reward_first", "reward_last", "match_first", "match_last")
    out = {}
    for k in keys:
        values = [r[k] for r in results]
        out[k] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values)}
    out["rose_on_every_seed"] = all(r["reward_last"] > r["reward_first"] for r in results)
    return out


def markdown(results: list[dict], summary: dict, steps: int) -> str:
    """The per-seed table and the summary rows, ready to paste into RESULTS.md."""
    tenth = max(1, steps // 10)
    lines = [
        f"| seed | reward, steps 1-{tenth} | reward, last {tenth} | match, steps 1-{tenth} "
        f"| match, last {tenth} |",
        "|---|---|---|---|---|",
    ]
    keys = ("reward_first", "reward_last", "match_first", "match_last")
    for r in results:
        lines.append(f"| {r['seed']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    for stat in ("mean", "min", "max"):
        cells = " | ".join(f"**{summary[k][stat]:.3f}**" for k in keys)
        lines.append(f"| {stat} | {cells} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="one run per seed")
    add("--steps", type=int, default=300, help="GRPO steps per seed")
    add("--sft-steps", type=int, default=300, help="SFT warm-up steps (batch 32) per seed")
    add("--prompts", type=int, default=16, help="prompts per GRPO step (a multiple of 4)")
    add("--generations", type=int, default=8, help="completions per prompt")
    add("--iterations", type=int, default=2, help="optimiser updates per batch of rollouts")
    add(
        "--beta",
        type=float,
        default=0.0,
        help="KL coefficient to the SFT model (0: none, TRL's default)",
    )
    add(
        "--loss-type",
        default="grpo",
        help="GRPOConfig.loss_type (edl.train.grpo_losses.GRPO_LOSSES; TRL's default: dapo)",
    )
    add("--epsilon-high", type=float, default=None, help="upper clip (None: 0.2; DAPO: 0.28)")
    add(
        "--dynamic-sampling",
        action="store_true",
        help="DAPO's dynamic sampling: groups of equal rewards replaced by further prompts'",
    )
    add("--max-sampling-rounds", type=int, default=4, help="its extra rollouts per step")
    add("--length-weight", type=float, default=0.5, help="weight of the length reward")
    add("--temperature", type=float, default=1.0, help="sampling temperature")
    add("--lr", type=float, default=1e-3, help="Adam learning rate of the GRPO updates")
    add("--log-every", type=int, default=100, help="print a progress line every N steps")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.prompts % len(LETTERS):
        raise SystemExit(f"--prompts must be a multiple of {len(LETTERS)}, got {args.prompts}")
    t_start = time.perf_counter()
    results = []
    for seed in args.seeds:
        print(f"seed {seed}:", flush=True)
        results.append(run_seed(args, seed))
    summary = summarize(results)
    print(markdown(results, summary, args.steps))
    settings = {k: v for k, v in vars(args).items() if k != "log_every"}
    print(
        json.dumps(
            {
                "benchmark": "grpo",
                "backend": jax.default_backend(),
                "jax": jax.__version__,
                "settings": settings,
                "seeds": results,
                "summary": summary,
                "total_s": time.perf_counter() - t_start,
            }
        )
    )


if __name__ == "__main__":
    main()
