"""``edl train`` past one device: ``--mesh`` and the ``jax.distributed`` flags.

``start`` joins the processes of a multi-process run (``--coordinator HOST:PORT
--num-processes N --process-id I``; on CPU with gloo collectives) before anything touches
a device. ``mesh_of`` builds the ``(dp, fsdp, tp, sp)`` mesh of ``--mesh`` (a hybrid
mesh across slices or processes with its ``/DCN`` part, ``edl._mesh_spec``). A run on a mesh
feeds the step with :class:`GlobalBatches`: each process reads only its own rows of every
global batch (``TokenBatches(process_index=..., process_count=...)``) and they are joined
into global arrays (``edl.sharding.shard_batch``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax

from edl.cli.config import TrainConfig
from edl.sharding import make_mesh, shard_batch

__all__ = ["start"]

INIT_TIMEOUT_S = 300


def start(config: TrainConfig) -> None:
    """Join the run's processes (a no-op for one process). Must run before any jax work."""
    if config.num_processes == 1:
        return
    # Cross-process collectives of the CPU backend; the GPU backend does not read it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=INIT_TIMEOUT_S,
    )


def is_lead() -> bool:
    """Whether this process prints the run's results (process 0)."""
    return jax.process_index() == 0


def mesh_of(config: TrainConfig) -> jax.sharding.Mesh | None:
    """The mesh of ``--mesh`` (several processes without one: data parallel over every
    device); ``None`` for a single-process run without ``--mesh``."""
    spec = config.mesh_spec
    if spec is None:
        return make_mesh((-1, 1, 1, 1)) if jax.process_count() > 1 else None
    return make_mesh(spec.ici, dcn=spec.dcn)


def process_split() -> dict[str, int]:
    """``TokenBatches``' arguments giving this process its rows of each global batch."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


class GlobalBatches:
    """``data``'s batches (this process's rows) as global arrays on ``mesh``; ``position`` /
    ``restore`` are ``data``'s, so checkpoints keep the data position."""

    def __init__(self, data: Iterator[Any], mesh: jax.sharding.Mesh) -> None:
        self.data, self.mesh = data, mesh

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> Any:
        return shard_batch(next(self.data), self.mesh)

    def __getattr__(self, name: str) -> Any:
        if name in ("position", "restore", "documents"):
            return getattr(self.data, name)
        raise AttributeError(name)
