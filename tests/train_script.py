"""A small deterministic training run, used by tests/test_train_resume.py in subprocesses.

    python tests/train_script.py OUTPUT_DIR STEPS [--kill-at N] [--poison N ...]

Trains a tiny Llama on synthetic token documents with checkpoints every 3 steps and
``nan_policy="skip"``. ``--poison N`` makes the batch of step N non-finite (its loss is
multiplied by NaN); ``--kill-at N`` SIGKILLs the process right after step N is logged (no
clean-up runs). Prints the run's summary as one JSON line.
"""

import argparse
import json
import logging
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np

import edl
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import (
    CheckpointConfig,
    LogConfig,
    NonFiniteConfig,
    OptimizerConfig,
    RunConfig,
    TokenBatches,
    callback,
    make_optimizer,
    make_train_step,
    train,
)


class Poisoned:
    """``TokenBatches`` whose batches carry ``scale`` 1, or NaN at the ``poison`` steps;
    resumable (the batch count is part of the position)."""

    def __init__(self, inner: TokenBatches, poison: set[int]) -> None:
        self.inner, self.poison, self.count = inner, poison, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        self.count += 1
        return {**batch, "scale": np.float32("nan" if self.count in self.poison else 1.0)}

    @property
    def position(self):
        return {"inner": self.inner.position, "count": self.count}

    def restore(self, position):
        self.inner.restore(position["inner"])
        self.count = position["count"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--poison", type=int, nargs="*", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, size=int(rng.integers(5, 40))).tolist() for _ in range(50)]
    data = Poisoned(
        TokenBatches(docs, batch_size=4, max_length=16, seed=1, pad_id=0), set(args.poison)
    )
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    tx, schedule = make_optimizer(OptimizerConfig(learning_rate=1e-2, total_steps=args.steps))

    def loss_fn(model, batch):
        loss, metrics = model.compute_loss(
            jnp.asarray(batch["input_ids"]),
            labels=jnp.asarray(batch["labels"]),
            segment_ids=jnp.asarray(batch["segment_ids"]),
        )
        loss = loss * batch["scale"]
        return loss, {**metrics, "loss": loss}

    def kill(info):
        if info.step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    step = make_train_step(loss_fn, tx, clip_norm=1.0, schedule=schedule, skip_nonfinite=True)
    _, summary = train(
        edl.create_state(model, tx),
        step,
        data,
        RunConfig(
            steps=args.steps,
            output_dir=args.output_dir,
            checkpoint=CheckpointConfig(every=3),
            nonfinite=NonFiniteConfig(policy="skip"),
            log=LogConfig(progress=False),
        ),
        callbacks=[callback(kill)],
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
