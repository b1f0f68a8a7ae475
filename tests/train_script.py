"""A small deterministic training run, used by tests/test_train_loop.py in subprocesses.

    python tests/train_script.py OUTPUT_DIR STEPS [KILL_AT_STEP]

Trains a tiny Llama on synthetic token documents with checkpoints every 3 steps. With
KILL_AT_STEP the process SIGKILLs itself at the end of that step (no clean-up runs).
"""

import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np

import edl
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import Hooks, OptimizerConfig, TokenBatches, make_optimizer, make_train_step, train


def main(output_dir: str, steps: int, kill_at: int | None) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, size=int(rng.integers(5, 40))).tolist() for _ in range(50)]
    data = TokenBatches(docs, batch_size=4, max_length=16, seed=1, pad_id=0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    tx, schedule = make_optimizer(OptimizerConfig(learning_rate=1e-2, total_steps=steps))

    def loss_fn(model, batch):
        return model.compute_loss(
            jnp.asarray(batch["input_ids"]), labels=jnp.asarray(batch["labels"]),
            segment_ids=jnp.asarray(batch["segment_ids"]),
        )  # fmt: skip

    def end(state, metrics):
        if kill_at is not None and metrics["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return state, metrics

    step = make_train_step(loss_fn, tx, clip_norm=1.0, schedule=schedule)
    train(edl.create_state(model, tx), step, data, steps=steps, save_every=3,
          output_dir=output_dir, hooks=Hooks(on_step_end=end), progress=False)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
