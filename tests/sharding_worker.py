"""One process of a multi-process (multi-controller) CPU training run of a small Llama.

Used by tests/test_sharding_multiprocess.py.

Every process runs this same script with its own ``--process-id``; they meet at the
coordinator (process 0 listens on ``--port``), see one global device list (every process's
forced host devices) and train the same small Llama for ``--steps`` steps on each mesh in
``--mesh``, each process feeding only its own rows of the global batch. Cross-process CPU
collectives are gloo over TCP (``jax_cpu_collectives_implementation``). Process 0 writes
``{"losses": {"dp,fsdp,tp,sp": [loss per step]}}`` as JSON to ``--output``. With
``--checkpoint DIR`` every process then saves the last mesh's state there together
(``edl.io.checkpoint.save_state``: each its own pieces, process 0 the metadata),
process 0 writes the same state all-gathered to ``DIR/gathered.safetensors``, and all
stream the model out as a Hugging Face directory ``DIR/hf`` (``save_pretrained``).

By hand, two processes of four devices each (eight global devices), in two shells or
backgrounded, from the repository root::

    export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu
    python tests/sharding_worker.py --process-id 0 --num-processes 2 --port 12355 \\
        --output losses.json &
    python tests/sharding_worker.py --process-id 1 --num-processes 2 --port 12355
    cat losses.json

With N processes of D devices each, ``--mesh`` dims must multiply to N * D and the global
batch (``--batch``) must divide by N.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np
import optax

BATCH, SEQ, VOCAB = 8, 16, 64
# The last: a hybrid mesh, FSDP within each process, data parallel across the two (the
# processes stand in for slices: edl.sharding.make_mesh(dcn=...)).
MESHES = ("2,2,2,1", "1,8,1,1", "1,2,2,1/2")
LEARNING_RATE = 1e-2  # AdamW


def config():
    from edl.models import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def global_batch(batch: int = BATCH, seq: int = SEQ) -> np.ndarray:
    """The deterministic global batch of token ids every process slices its rows from."""
    return np.random.default_rng(0).integers(0, VOCAB, size=(batch, seq), dtype=np.int32)


def setup():
    """``(state, step)``: the small Llama (init key 0) under AdamW, and its train step."""
    import edl
    from edl.models import LlamaForCausalLM
    from edl.train import make_train_step

    model = LlamaForCausalLM.init(config(), key=jax.random.key(0))
    tx = optax.adamw(LEARNING_RATE)

    def loss_fn(model, batch):
        return model.compute_loss(batch["ids"])

    return edl.create_state(model, tx), make_train_step(loss_fn, tx, donate=False)


def train_on_mesh(spec: str, ids: np.ndarray, steps: int):
    """``(losses, state)`` after ``steps`` train steps on the mesh of ``spec`` (as ``edl train
    --mesh``); ``ids`` are this process's rows."""
    from edl._mesh_spec import MeshSpec
    from edl.models.llama import PARTITION_RULES
    from edl.sharding import gather, make_mesh, shard_batch, shard_state

    parsed = MeshSpec.parse(spec)
    mesh = make_mesh(parsed.ici, dcn=parsed.dcn)
    if parsed.dcn is not None:  # each process one contiguous block: its own dp index
        owners = [{d.process_index for d in block.flat} for block in mesh.devices]
        assert owners == [{i} for i in range(jax.process_count())], owners
    state, step = setup()
    state = shard_state(state, PARTITION_RULES, mesh)
    batch = shard_batch({"ids": ids}, mesh)
    assert batch["ids"].shape == (ids.shape[0] * jax.process_count(), ids.shape[1])
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(gather(metrics["loss"])))
    return losses, state


def _die_in_save(state, args) -> None:
    """Save ``state`` as the next step; process 1 dies right after writing its pieces (before
    the barrier that lets process 0 complete the checkpoint)."""
    import edl.io.checkpoint.sharded
    from edl import state as edl_state
    from edl.io.checkpoint import save_state

    if args.process_id == 1:
        real = edl.io.checkpoint.sharded.save_tensors

        def write_then_die(*a, **kw):
            real(*a, **kw)
            print("process 1: pieces written, dying", flush=True)
            os._exit(9)

        edl.io.checkpoint.sharded.save_tensors = write_then_die
    save_state(edl_state.replace(state, step=state.step + 1), args.checkpoint)
    raise AssertionError("the save completed although process 1 died in it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="coordinator port on 127.0.0.1")
    parser.add_argument("--output", default=None, help="JSON losses (process 0 writes)")
    parser.add_argument("--mesh", nargs="+", default=list(MESHES), help="e.g. 2,2,2,1 or 1,2,2,1/2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch rows")
    parser.add_argument("--checkpoint", default=None, help="save the last mesh's state here")
    parser.add_argument(
        "--die-in-second-save",
        action="store_true",
        help="then save as the next step, process 1 exiting (9) once its pieces are written",
    )
    args = parser.parse_args()

    # Before the backend starts (in initialize): CPU, 4 host devices unless told otherwise.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        ).strip()
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # gloo is the default
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
    )
    assert jax.process_count() == args.num_processes, jax.process_count()
    rows = args.batch // args.num_processes
    local = global_batch(args.batch)[args.process_id * rows : (args.process_id + 1) * rows]
    losses = {}
    for spec in args.mesh:
        start = time.perf_counter()
        losses[spec], state = train_on_mesh(spec, local, args.steps)
        print(
            f"process {args.process_id}: mesh {spec} losses {losses[spec]} "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    if args.checkpoint:
        from edl import tree
        from edl.io.checkpoint import save_state
        from edl.io.formats.safetensors import save_file
        from edl.sharding import gather_state

        save_state(state, args.checkpoint, metadata={"steps": args.steps})
        gathered = tree.flatten(gather_state(state))  # what was saved, whole, to compare
        if args.process_id == 0:
            save_file(
                {k: v for k, v in gathered.items() if hasattr(v, "shape")},
                os.path.join(args.checkpoint, "gathered.safetensors"),
            )
        from edl import state as edl_state
        from edl.io.formats.hf import save_pretrained

        # Every process streams the sharded model out with process 0, tensor by tensor.
        save_pretrained(edl_state.model(state), os.path.join(args.checkpoint, "hf"))
        if args.die_in_second_save:
            _die_in_save(state, args)
    if args.process_id == 0 and args.output:
        payload = {
            "losses": losses,
            "process_count": jax.process_count(),
            "global_devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
        }
        with open(args.output, "w") as f:
            json.dump(payload, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
