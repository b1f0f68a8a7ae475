"""Step time while a checkpoint is written in the background (``train(save_async=True)``).

A byte-level Llama's train step (AdamW, donating) runs in rounds. In each round, for each
``--shares`` value in turn, a checkpoint save is started through
``edl.train.callbacks.Checkpoint(asynchronous=True, write_share=share)`` and the steps that
run until its writer thread finishes are timed ("during a save"); then as many steps with
no save in flight ("no save"). Also timed: what the loop itself waits to start a background
save (the on-device copy of the state), and a synchronous ``save_state`` of the same state,
which an ordinary save would stall the loop for.

    python -m benchmarks.async_save [--quick] [--rounds 5] [--shares 1.0 0.25] [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from benchmarks._common import table, write_json
from edl.io.checkpoint import save_state
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import make_train_step
from edl.train.callbacks import Checkpoint


def _setup(hidden: int, layers: int, batch: int, seq: int):
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    tx = optax.adamw(1e-4)
    step = make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx)
    ids = np.random.default_rng(0).integers(3, 259, (batch, seq), dtype=np.int32)
    return edl.create_state(model, tx), step, {"ids": jnp.asarray(ids)}


def _timed_step(step, state, batch):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds, each one save per --shares value (quick: 2)",
    )
    parser.add_argument(
        "--hidden", type=int, default=512, help="the byte-level Llama's hidden size (quick: 128)"
    )
    parser.add_argument("--layers", type=int, default=8, help="its decoder layers (quick: 2)")
    parser.add_argument("--batch", type=int, default=8, help="rows per train step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument(
        "--shares",
        type=float,
        nargs="+",
        default=[1.0, 0.25],
        help="Checkpoint write_share values, each timed in turn",
    )
    parser.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.hidden, args.layers, args.rounds = 128, 2, 2
    state, step, batch = _setup(args.hidden, args.layers, args.batch, args.seq)
    for _ in range(3):  # compile and warm up
        state, _ = _timed_step(step, state, batch)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
    during = {share: [] for share in args.shares}
    idle, starts, syncs = [], {share: [] for share in args.shares}, []
    with tempfile.TemporaryDirectory() as tmp:
        savers = {
            share: Checkpoint(
                f"{tmp}/async-{share}",
                keep=1,
                asynchronous=True,
                write_share=share,
                echo=lambda _: None,
            )
            for share in args.shares
        }
        for _ in range(args.rounds):
            for share, saver in savers.items():
                begin = time.perf_counter()
                saver._save(state, int(state.step), 0.0)  # what the loop waits for
                starts[share].append(time.perf_counter() - begin)
                steps = 0
                while saver._writer is not None and saver._writer.is_alive():
                    state, seconds = _timed_step(step, state, batch)
                    during[share].append(seconds)
                    steps += 1
                saver.wait()
                for _ in range(max(steps, 3)):
                    state, seconds = _timed_step(step, state, batch)
                    idle.append(seconds)
            begin = time.perf_counter()
            save_state(state, f"{tmp}/sync", keep=1)
            syncs.append(time.perf_counter() - begin)

    def ms(xs: list[float]) -> float:
        return 1e3 * statistics.median(xs)

    rows = [
        {
            "write_share": share,
            "state_mb": state_bytes / 2**20,
            "step_ms_no_save": ms(idle),
            "step_ms_during_save": ms(during[share]),
            "ratio": ms(during[share]) / ms(idle),
            "steps_during_saves": len(during[share]),
            "async_start_ms": ms(starts[share]),
            "sync_save_ms": ms(syncs),
        }
        for share in args.shares
    ]
    print(table(list(rows[0]), [list(r.values()) for r in rows]))
    path = write_json(
        "async_save",
        rows,
        hidden=args.hidden,
        layers=args.layers,
        batch=args.batch,
        seq=args.seq,
        rounds=args.rounds,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
