"""Distillation worked example: a small byte-level Llama student learns a wider, deeper
teacher's next-token distributions on text, off-policy and on-policy; the number that
matters is the student's KL(teacher || student) per completion token on held-out text.

Teacher: a 3-layer Llama of width 96 trained from scratch by SFT (next-token loss) on the
embedded corpus (``edl.train.load_corpus``) for ``--teacher-steps`` steps. Student: a
1-layer Llama of width 48, from scratch. Data: GKD's prompt / completion records cut from
the corpus (a 48-byte prompt, the next 16 bytes as the completion); the held-out records
come from the corpus' held-out documents (``split_corpus``).

For each seed (the student's initialisation, the data order and the on-policy draws), every
mode starts from the same student and runs ``--steps`` ``edl.train.make_distill_step``
steps (Adam ``--lr``), then reports the held-out KL (``beta=0``, temperature 1: forward KL,
whatever the mode trained on) before and after:

- ``off-policy``: ``beta 0`` (forward KL) on the records' own completions;
- ``off-policy-jsd``: ``beta 0.5`` (TRL's JSD, GKD's default) on them;
- ``on-policy``: ``beta 0``, ``lmbda 0.5``: half the steps (a seeded draw) on 16-byte
  completions the student samples itself (GKD);
- ``on-policy-jsd``: ``beta 0.5``, ``lmbda 0.5``;
- ``sft``: the baseline, plain next-token loss on the same completions (no teacher).

    python -m benchmarks.distill [--steps 300] [--teacher-steps 300] [--seeds 0 1 2]

Prints progress, a markdown table (per mode: the median held-out KL after, over the seeds,
and their min / max) and LAST one JSON line with the settings and every number.
"""

from __future__ import annotations

import argparse
import json
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import ByteTokenizer, load_corpus, make_train_step, split_corpus
from edl.train.distill import distill_divergence, make_distill_step
from edl.train.distill_data import DistillBatches, encode_distill

PROMPT, COMPLETION = 48, 16


def _llama(width: int, layers: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=ByteTokenizer().vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(seed))


def _records(docs: list[str], n: int, rng: np.random.Generator) -> list[dict]:
    """``n`` prompt / completion records cut at random places of ``docs``' text."""
    text = "\n".join(docs)
    starts = rng.integers(0, len(text) - PROMPT - COMPLETION, n)
    cut = lambda s: (text[s : s + PROMPT], text[s + PROMPT : s + PROMPT + COMPLETION])
    return [{"prompt": p, "completion": c} for p, c in map(cut, starts)]


def _batches(records: list[dict], batch: int, seed: int) -> DistillBatches:
    tok = ByteTokenizer()
    docs = [encode_distill(tok, r) for r in records]
    width = 2 * (PROMPT + COMPLETION)  # room for multi-byte characters and EOS
    return DistillBatches(docs, batch_size=batch, max_length=width, pad_id=tok.pad_id, seed=seed)


def _sft_step(tx):
    def loss_fn(m, b):
        return m.compute_loss(b["input_ids"], b["labels"], attention_mask=b["attention_mask"])

    return make_train_step(loss_fn, tx)


def _teacher(docs: list[str], steps: int, rng: np.random.Generator) -> LlamaForCausalLM:
    tx = optax.adam(3e-3)
    state = edl.create_state(_llama(96, 3, 1), tx)
    step = _sft_step(tx)
    data = _batches(_records(docs, 4096, rng), 16, 1)
    for i in range(steps):
        batch = next(data)
        batch = {**batch, "labels": np.where(batch["attention_mask"] > 0, batch["input_ids"], -100)}
        state, metrics = step(state, batch)
        if (i + 1) % 100 == 0:
            print(f"  teacher sft step {i + 1}: loss {float(metrics['loss']):.3f}", flush=True)
    return edl.state.model(state)


def _held_out_kl(model, teacher, held_out: list[dict]) -> float:
    """Mean forward KL(teacher || model) per completion token over the held-out batches."""
    fn = jax.jit(lambda m, t, b: distill_divergence(m, t, b, beta=0.0, temperature=1.0))
    sums = counts = 0.0
    for batch in held_out:
        loss, metrics = fn(model, teacher, batch)
        sums += float(loss) * int(metrics["count"])
        counts += int(metrics["count"])
    return sums / counts


def _copy(model):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)


MODES = {  # (beta, lmbda); None: SFT
    "off-policy": (0.0, 0.0),
    "off-policy-jsd": (0.5, 0.0),
    "on-policy": (0.0, 0.5),
    "on-policy-jsd": (0.5, 0.5),
    "sft": None,
}


def run_mode(mode: str, args, seed: int, student, teacher, records, held_out) -> dict:
    tx = optax.adam(args.lr)
    tok = ByteTokenizer()
    if MODES[mode] is None:
        step = _sft_step(tx)
    else:
        beta, lmbda = MODES[mode]
        step = make_distill_step(
            tx,
            teacher,
            beta=beta,
            lmbda=lmbda,
            max_new_tokens=COMPLETION,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
            key=jax.random.key(100 + seed),
            student=student,
        )
    state = edl.create_state(_copy(student), tx)
    data = _batches(records, args.batch, seed)
    t0 = time.perf_counter()
    on_policy = 0
    for i in range(args.steps):
        batch = next(data)
        state, metrics = step(state, batch)
        on_policy += int(float(metrics.get("on_policy", 0.0)))
        if (i + 1) % 50 == 0:
            print(f"  seed {seed} {mode} step {i + 1}: loss {float(metrics['loss']):.4f}")
    seconds = time.perf_counter() - t0
    kl = _held_out_kl(edl.state.model(state), teacher, held_out)
    out = {"mode": mode, "seed": seed, "held_out_kl": kl, "seconds": seconds}
    return {**out, "on_policy_steps": on_policy}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--steps", type=int, default=300, help="distillation (or SFT) steps per mode and seed")
    add("--teacher-steps", type=int, default=300, help="SFT steps (batch 16) of the teacher")
    add("--batch", type=int, default=8, help="records per step")
    add("--lr", type=float, default=3e-3, help="the student's Adam learning rate")
    add("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="modes to run")
    add("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one student per seed")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rng = np.random.default_rng(0)
    train_docs, eval_docs = split_corpus(load_corpus(max_bytes=2_000_000), 0.05)
    t0 = time.perf_counter()
    teacher = _teacher(train_docs, args.teacher_steps, rng)
    teacher_s = time.perf_counter() - t0
    records = _records(train_docs, 4096, rng)
    held = _batches(_records(eval_docs, 64, np.random.default_rng(99)), 16, 0)
    held_out = [next(held) for _ in range(4)]
    results, before = [], {}
    for seed in args.seeds:
        student = _llama(48, 1, 2 + seed)
        before[seed] = _held_out_kl(student, teacher, held_out)
        print(f"seed {seed}: held-out KL(teacher || student) before {before[seed]:.4f}")
        for mode in args.modes:
            results.append(run_mode(mode, args, seed, student, teacher, records, held_out))
    print(f"\nheld-out KL before: median {np.median(list(before.values())):.4f}")
    print("\n| mode | held-out KL after (median) | min | max | seconds (median) |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        kl = [r["held_out_kl"] for r in results if r["mode"] == mode]
        sec = [r["seconds"] for r in results if r["mode"] == mode]
        print(
            f"| {mode} | {np.median(kl):.4f} | {min(kl):.4f} | {max(kl):.4f} "
            f"| {np.median(sec):.1f} |"
        )
    summary = {"settings": vars(args), "teacher_s": teacher_s, "before": before}
    print(json.dumps({**summary, "results": results}))


if __name__ == "__main__":
    main()
