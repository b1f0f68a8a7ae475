"""What the token-id check costs: the same Llama with ``check_inputs`` on and off.

``DecoderModel.embed`` checks that every id lies in ``[0, vocab_size)`` (and
``compute_loss`` checks given labels) with ``edl.ops.checks.check_ids``: a min/max over the
ids and a conditional whose error branch calls back to Python. ``configure(model,
check_inputs=False)`` leaves it out. Per model this times, as two executables compiled in
one process and alternating in every round: a jitted forward (logits), a jitted train step
(forward + backward + AdamW through ``make_train_step``, labels passed so both checks run)
and a jitted one-token decode step through a KV cache (batch 1, the smallest unit of work).
Each call is waited for before the next (as ``edl.train``'s loop does, reading the
metrics of every step), and the train step also runs queued: calls back to back with one
wait at the end, where jax's asynchronous dispatch lets the host run ahead. On CPU a
program that holds a host callback (the check's error branch) runs synchronously, so the
queued rows show what the lost overlap costs.

Reported: median times, and the median over rounds of the checked - unchecked difference
and of the checked / unchecked ratio (1.00 = free), each round's pair run back to back so
that drifting load on a shared machine cancels; also the ratio of the fastest times.

    python -m benchmarks.input_checks [--quick] [--rounds 31]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import edl
from benchmarks._common import interleaved_rounds, table, write_json
from edl.generate import init_cache
from edl.models import LlamaConfig, LlamaForCausalLM, configure
from edl.train import OptimizerConfig, make_optimizer, make_train_step

CONFIGS = {
    # tests/conftest.py's TINY_LLAMA: dispatch-bound, where a fixed cost shows most.
    "tiny": (
        dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        2,
        16,
    ),
    # edl train's default model and batch (benchmarks/train.py "default").
    "small": (
        dict(
            vocab_size=259,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        8,
        128,
    ),
}
VARIANTS = ("checked", "unchecked")


def _models(fields: dict) -> dict[str, LlamaForCausalLM]:
    config = LlamaConfig(**fields, tie_word_embeddings=True)
    # Two copies of the weights: the train step donates (deletes) its input state.
    model, copy = (LlamaForCausalLM.init(config, key=jax.random.key(0)) for _ in range(2))
    return {"checked": model, "unchecked": configure(copy, check_inputs=False)}


def _forward(models, ids):
    run = jax.jit(lambda m, ids: m(ids).logits)
    return {name: (lambda m=m: run(m, ids)) for name, m in models.items()}


def _train_step(models, ids):
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=1e-4, total_steps=1000))

    def loss_fn(model, batch):
        return model.compute_loss(batch["ids"], batch["ids"])

    step = make_train_step(loss_fn, tx, clip_norm=1.0)
    calls = {}
    for name, m in models.items():
        box = [edl.create_state(m, tx)]

        def call(box=box):
            box[0], metrics = step(box[0], {"ids": ids})
            return metrics["loss"]

        calls[name] = call
    return calls


def _decode_step(models, ids):
    token = ids[:1, :1]
    run = jax.jit(lambda m, cache: m(token, cache=cache).logits)
    caches = {n: init_cache(m.config, 1, ids.shape[1] + 1) for n, m in models.items()}
    caches = {n: models[n](ids[:1], cache=c).cache for n, c in caches.items()}
    return {name: (lambda m=m, c=caches[name]: run(m, c)) for name, m in models.items()}


WORKLOADS = {"forward": _forward, "train step": _train_step, "decode step": _decode_step}


def measure(
    config: str, workload: str, rounds: int, calls_per_sample: int, synced: bool = True
) -> dict:
    fields, batch, seq = CONFIGS[config]
    models = _models(fields)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, fields["vocab_size"], (batch, seq)), jnp.int32)
    calls = WORKLOADS[workload](models, ids)

    def repeated(call):
        def run():
            for _ in range(calls_per_sample):
                out = call()
                if synced:
                    jax.block_until_ready(out)
            return out

        return run

    calls = {name: repeated(call) for name, call in calls.items()}
    for call in calls.values():  # compile and warm up
        jax.block_until_ready(call())
    # Half the rounds in each order, so that neither variant always runs second.
    first = interleaved_rounds(calls, rounds // 2 + rounds % 2)
    second = interleaved_rounds(dict(reversed(calls.items())), rounds // 2)
    samples = {name: first[name] + second[name] for name in VARIANTS}
    checked, unchecked = ([t / calls_per_sample for t in samples[name]] for name in VARIANTS)
    # Paired by round (the two ran back to back), so drifting load cancels out.
    ratios = [c / u for c, u in zip(checked, unchecked, strict=True)]
    extra = [c - u for c, u in zip(checked, unchecked, strict=True)]
    return {
        "model": config,
        "workload": workload + ("" if synced else ", queued"),
        "batch x seq": f"{batch}x{seq}" if workload != "decode step" else "1x1",
        "unchecked_us": statistics.median(unchecked) * 1e6,
        "checked_us": statistics.median(checked) * 1e6,
        "extra_us": statistics.median(extra) * 1e6,
        "ratio": statistics.median(ratios),
        "ratio_min_times": min(checked) / min(unchecked),
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of few calls")
    parser.add_argument(
        "--rounds", type=int, default=31, help="interleaved timed rounds (quick: 3)"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rounds = 3 if args.quick else args.rounds
    rows = []
    for config in CONFIGS:
        for workload, synced in [*((w, True) for w in WORKLOADS), ("train step", False)]:
            # Enough calls per sample that one sample lasts well over a millisecond.
            number = {"tiny": 50, "small": 5}[config] * (1 if workload == "train step" else 4)
            number = 2 if args.quick else number
            rows.append(measure(config, workload, rounds, number, synced))
    keys = [
        "model",
        "workload",
        "batch x seq",
        "unchecked_us",
        "checked_us",
        "extra_us",
        "ratio",
        "ratio_min_times",
    ]
    header = [
        "model",
        "workload",
        "batch x seq",
        "unchecked us",
        "checked us",
        "extra us",
        "ratio",
        "ratio of mins",
    ]
    print(f"input checks, backend {jax.default_backend()}, {jax.device_count()} device(s)")
    print(table(header, [[r[k] for k in keys] for r in rows]))
    print("wrote", write_json("input_checks", rows, rounds=rounds))


if __name__ == "__main__":
    main()
