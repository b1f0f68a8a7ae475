"""Per-device memory of a Mixtral-style MoE under expert parallelism: the expert weights each
device holds and the compiled train step's temporaries (the dispatch's activations among
them), as the ``expert`` mesh axis grows, against FSDP over the same devices.

On ``n`` = 1, 2, 4, 8 of 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8,
set here unless the environment already forces a device count), a fixed global batch (8 x
128 tokens) and a model of hidden 128, 8 experts of width 256, top-2, 2 layers, float32:

* ``fsdp``: mesh ``(1, n, 1, 1, 1)``; experts split over fsdp by their hidden size and
  all-gathered where a layer uses them (each device computes every expert on its tokens);
* ``expert``: mesh ``(1, 1, 1, 1, n)``, the exact (dropless) dispatch of
  ``edl.ops.expert_parallel``: padded all-to-all on CPU, ``tokens * min(k, experts / n)``
  rows per pair of devices;
* ``expert cf=1.25``: the same with ``moe_capacity_factor=1.25`` (rows beyond
  ``1.25 * tokens * k / n`` per pair dropped).

"expert weights" is the bytes of ``experts.*`` device 0 holds; "temp" is XLA's
``memory_analysis().temp_size_in_bytes`` of the compiled SGD step (per device: an SPMD
program's analysis is one device's), deterministic for a given jax / XLA. Step times are
medians on a CPU host whose "devices" share its cores: they show overheads, not scaling.

    python -m benchmarks.expert_parallel [--quick]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse

import jax
import optax

import edl
from benchmarks._common import table, time_call, write_json
from edl.models import MixtralConfig, MixtralForCausalLM, configure
from edl.sharding import make_mesh, shard_batch, shard_state
from edl.train import make_train_step

LAYOUTS = (
    ("fsdp", lambda n: (1, n, 1, 1, 1), None),
    ("expert", lambda n: (1, 1, 1, 1, n), None),
    ("expert cf=1.25", lambda n: (1, 1, 1, 1, n), 1.25),
)


def _config(quick: bool) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=512,
        hidden_size=64 if quick else 128,
        intermediate_size=128 if quick else 256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
    )


def _expert_bytes(state, device: jax.Device) -> int:
    """Bytes of the expert weights' shards on ``device``."""
    total = 0
    for path, x in edl.tree.flatten(state.params).items():
        if ".experts." in path:
            total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total


def _measure(name, dims, factor, config, ids, reps) -> dict:
    n = max(dims)
    mesh = make_mesh(dims, devices=jax.devices()[:n])
    tx = optax.sgd(0.1)
    model = configure(MixtralForCausalLM.init(config, key=jax.random.key(0)))
    if factor is not None:
        model = configure(model, moe_capacity_factor=factor)
    state = shard_state(edl.create_state(model, tx), None, mesh)
    batch = shard_batch({"ids": ids}, mesh)
    step = make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx, donate=True)
    with jax.set_mesh(mesh):
        compiled = step.lower(state, batch).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        expert = _expert_bytes(state, jax.devices()[0])
        box = [state]

        def train():
            box[0], metrics = compiled(box[0], batch)
            return metrics["loss"]

        first_loss = float(train())
        step_s = time_call(train, **reps)
    return {
        "layout": name,
        "devices": n,
        "mesh": list(dims),
        "expert_bytes_per_device": expert,
        "temp_bytes_per_device": temp,
        "train_step_s": step_s,
        "first_loss": first_loss,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repeats")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if jax.device_count() != 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()} (check XLA_FLAGS)")
    config = _config(args.quick)
    ids = jax.random.randint(jax.random.key(1), (8, 128), 0, config.vocab_size)
    reps = {"warmup": 1, "repeats": 3 if args.quick else 5, "number": 1}
    rows = []
    for n in (1, 2, 4, 8):
        for name, dims, factor in LAYOUTS:
            if n == 1 and name != "fsdp":
                continue  # one device: the three layouts are the same program
            rows.append(_measure(name, dims(n), factor, config, ids, reps))
            print(f"{name} n={n} done", flush=True)
    kib = 1024
    print(
        table(
            ["layout", "devices", "expert weights KiB", "temp KiB", "step ms", "first loss"],
            [
                [
                    r["layout"],
                    r["devices"],
                    r["expert_bytes_per_device"] / kib,
                    r["temp_bytes_per_device"] / kib,
                    1e3 * r["train_step_s"],
                    r["first_loss"],
                ]
                for r in rows
            ],
        )
    )
    write_json("expert_parallel", rows, quick=args.quick)


if __name__ == "__main__":
    main()
