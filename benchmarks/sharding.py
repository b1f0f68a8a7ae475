"""Per-device memory and train-step time of a Llama train state under three mesh layouts.

On 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here unless the
environment already forces a device count): hidden 256, intermediate 688, 8 heads / 4 kv
heads, vocab 1024, 4 layers, float32, AdamW, batch 8 x seq 128, in three layouts:

* replicated: mesh (dp=8), every array replicated (rules ``[(".*", P())]``), batch over dp;
* fsdp: mesh (fsdp=8) with ``edl.models.llama.PARTITION_RULES``;
* fsdp+tp: mesh (fsdp=4, tp=2) with the same rules.

Memory is the bytes device 0 holds of the whole train state (params + AdamW's mu / nu +
counters), from each array's shard on that device; "vs replicated" should be ~1/8 for
FSDP (small replicated leftovers: norms, step counts). Step time is the median of a few
donated steps after compilation, inside ``jax.set_mesh(mesh)``. On a CPU host the "devices"
share the host's cores and memory, so the times show overheads, not scaling.

    python -m benchmarks.sharding [--quick]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import edl
from benchmarks._common import table, time_call, write_json
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.models.llama import PARTITION_RULES
from edl.sharding import make_mesh, shard_batch, shard_state
from edl.train import make_train_step

LAYOUTS = (
    ("replicated", (8, 1, 1, 1), ((".*", P()),)),
    ("fsdp", (1, 8, 1, 1), PARTITION_RULES),
    ("fsdp+tp", (1, 4, 2, 1), PARTITION_RULES),
)


def _config(quick: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=64 if quick else 256,
        intermediate_size=176 if quick else 688,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )


def _device_bytes(tree, device: jax.Device) -> int:
    """Bytes of ``tree``'s arrays held on ``device`` (its shard of each)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total


def _global_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _measure(name, dims, rules, config, tx, ids, reps) -> dict:
    mesh = make_mesh(dims)
    device = jax.devices()[0]
    # A fresh model each time: the donated steps may consume buffers it shares.
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    state = shard_state(edl.create_state(model, tx), rules, mesh)
    del model
    params_bytes = _device_bytes(state.params, device)
    state_bytes = _device_bytes(state, device)
    batch = shard_batch({"ids": ids}, mesh)

    def loss_fn(model, batch):
        return model.compute_loss(batch["ids"])

    step = make_train_step(loss_fn, tx, donate=True)
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - start
        box = [state]

        def train():
            box[0], metrics = compiled(box[0], batch)
            return metrics["loss"]

        first_loss = float(train())
        step_s = time_call(train, **reps)
    return {
        "layout": name,
        "mesh": list(dims),
        "params_bytes_per_device": params_bytes,
        "state_bytes_per_device": state_bytes,
        "state_bytes_total": _global_bytes(box[0]),
        "train_step_s": step_s,
        "compile_s": compile_s,
        "first_loss": first_loss,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short sequences")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if jax.device_count() != 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()} (check XLA_FLAGS)")
    batch, seq = (8, 32) if args.quick else (8, 128)
    reps = {"warmup": 1, "repeats": 3 if args.quick else 5, "number": 1}
    config = _config(args.quick)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab_size)
    tx = optax.adamw(1e-4)

    rows = []
    for name, dims, rules in LAYOUTS:
        rows.append(_measure(name, dims, rules, config, tx, ids, reps))
        print(f"{name} done", flush=True)
    base = rows[0]
    for row in rows:
        row["state_vs_replicated"] = row["state_bytes_per_device"] / base["state_bytes_per_device"]
        row["step_vs_replicated"] = row["train_step_s"] / base["train_step_s"]
    mib = 2**20
    header = [
        "layout",
        "mesh",
        "params MiB/dev",
        "state MiB/dev",
        "vs repl.",
        "step ms",
        "step vs repl.",
        "compile s",
    ]
    print(
        table(
            header,
            [
                [
                    r["layout"],
                    "x".join(map(str, r["mesh"])),
                    r["params_bytes_per_device"] / mib,
                    r["state_bytes_per_device"] / mib,
                    r["state_vs_replicated"],
                    r["train_step_s"] * 1e3,
                    r["step_vs_replicated"],
                    r["compile_s"],
                ]
                for r in rows
            ],
        )
    )
    path = write_json(
        "sharding",
        rows,
        batch=batch,
        seq=seq,
        quick=args.quick,
        params=edl.count_params(
            jax.eval_shape(lambda: LlamaForCausalLM.init(config, key=jax.random.key(0)))
        ),
        device_count=jax.device_count(),
        cpu_count=os.cpu_count(),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
