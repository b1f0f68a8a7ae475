"""Meshes, and placing models, train states and batches on them (shard / gather).

Partition rules, specs and activation constraints live one layer down in
``edl.ops.sharding`` (model code uses them), and are re-exported here: with this module a
user has every sharding name in one place. Arrays carry ``NamedSharding``s on a 5-axis mesh
``("dp", "fsdp", "tp", "sp", "expert")`` (data, fully-sharded data, tensor, sequence and
expert parallel), and ``jax.jit`` inserts the collectives; MoE layers dispatch tokens over
``expert`` with an all-to-all (``edl.ops.expert_parallel``). Parameters get their specs
from **rules**: ``(regex, PartitionSpec)`` pairs matched (``re.search``, first match wins)
against ``edl.tree`` path strings such as ``"model.layers.self_attn.q_proj.weight"``;
unmatched arrays are replicated.
``rules=None`` means the rules the tree carries: an edl model's ``partition_rules`` (its
family's, ``edl.models.decoder.PARTITION_RULES``), a train state's model's.

    mesh = make_mesh((1, -1, 1, 1))                        # all devices on fsdp
    mesh = make_mesh((1, -1, 1, 1, 4))                     # 4-way expert parallel
    state = shard_state(state, None, mesh)                 # the model's own rules;
                                                           # optimizer state follows params
    with jax.set_mesh(mesh):                               # activation constraints apply
        state, metrics = step(state, shard_batch(batch, mesh))

A mesh axis that does not divide an array dimension is dropped from that dimension's spec
(replicated there) with a debug log, never an error: one rule set serves every mesh shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from edl.ops.sharding import (
    AXES,
    BATCH,
    Rules,
    batch_spec,
    constrain,
    fit_spec,
    partition_specs,
    rules_for,
)
from edl.tree import flatten, named_map

__all__ = [
    "AXES",
    "BATCH",
    "Rules",
    "batch_spec",
    "constrain",
    "fit_spec",
    "gather",
    "gather_state",
    "make_mesh",
    "mesh_slices",
    "partition_specs",
    "shard",
    "shard_batch",
    "shard_state",
    "shard_with_shape",
    "state_shardings",
]


def make_mesh(
    axis_dims: Sequence[int] = (1, -1, 1, 1),
    axis_names: Sequence[str] = AXES,
    *,
    dcn: Sequence[int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh over ``devices`` (default: all, every process's) with one ``-1`` dimension
    taking the remaining devices. Axes are ``Auto`` (GSPMD propagation, as jit expects).
    With the default names, four sizes ``(dp, fsdp, tp, sp)`` mean expert = 1.

    ``dcn``: a hybrid mesh over several slices (``edl._mesh_spec``): ``axis_dims`` then size
    each axis within a slice and ``dcn`` across slices, and the mesh's size on an axis is
    their product. A slice is a TPU slice (devices' ``slice_index``) or, on GPUs and CPUs,
    a process (:func:`mesh_slices`). ``jax.experimental.mesh_utils.
    create_hybrid_device_mesh`` lays each slice out as one contiguous block, so that only
    the axes ``dcn`` spans cross the slow links (``(N, 1, 1, 1)``: data parallelism across
    slices, one gradient all-reduce per step over them)."""
    devices = list(jax.devices() if devices is None else devices)
    if tuple(axis_names) == AXES:  # the 4-size form from before the expert axis
        axis_dims = _with_expert(axis_dims)
        dcn = None if dcn is None else _with_expert(dcn)
    if len(axis_dims) != len(axis_names) or (dcn is not None and len(dcn) != len(axis_names)):
        raise ValueError(
            f"make_mesh: axis_dims {tuple(axis_dims)} and dcn {dcn} need one size per axis "
            f"of {tuple(axis_names)}"
        )
    if dcn is None:
        dims = _resolved_dims(axis_dims, len(devices), "devices")
        return jax.make_mesh(
            tuple(dims), tuple(axis_names), axis_types=(AxisType.Auto,) * len(dims), devices=devices
        )
    grid = _hybrid_devices(axis_dims, tuple(dcn), devices)
    return Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * grid.ndim)


def _with_expert(dims: Sequence[int]) -> tuple[int, ...]:
    """``dims`` with expert = 1 appended to a four-size ``(dp, fsdp, tp, sp)``."""
    return (*dims, 1) if len(dims) == len(AXES) - 1 else tuple(dims)


def _resolved_dims(axis_dims: Sequence[int], count: int, what: str) -> list[int]:
    """``axis_dims`` with its ``-1`` taking what is left of ``count`` ``what``."""
    dims = list(axis_dims)
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise ValueError(f"make_mesh: axis_dims {tuple(dims)} need positive sizes and one -1")
    known = int(np.prod([d for d in dims if d != -1]))
    if count % known:
        raise ValueError(
            f"make_mesh: axis_dims {tuple(axis_dims)} (product {known}) do not divide the "
            f"{count} {what}"
        )
    dims = [count // known if d == -1 else d for d in dims]
    if int(np.prod(dims)) != count:
        raise ValueError(
            f"make_mesh: axis_dims {tuple(axis_dims)} cover {int(np.prod(dims))} {what}, "
            f"there are {count}; use -1 for one axis"
        )
    return dims


def _hybrid_devices(
    axis_dims: Sequence[int], dcn: tuple[int, ...], devices: Sequence[Any]
) -> np.ndarray:
    """The hybrid mesh's device grid, the slices of :func:`mesh_slices` as the granules of
    ``create_hybrid_device_mesh``."""
    from jax.experimental import mesh_utils

    if any(d < 1 for d in dcn):
        raise ValueError(f"make_mesh: dcn {dcn} needs sizes >= 1 (no -1 across slices)")
    granules, what = mesh_slices(devices)
    if granules != int(np.prod(dcn)):
        raise ValueError(
            f"make_mesh: dcn {dcn} spans {int(np.prod(dcn))} slices, but the {len(devices)} "
            f"devices are in {granules} {what}"
        )
    ici = _resolved_dims(axis_dims, len(devices) // granules, "devices of a slice")
    return mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=devices[0].platform != "tpu"
    )


def mesh_slices(devices: Sequence[Any]) -> tuple[int, str]:
    """How many slices ``devices`` are in for a hybrid mesh, and what a slice is: on TPUs a
    TPU slice (``slice_index``); elsewhere (GPU hosts, CPU processes, whose devices may
    carry a ``slice_index`` of 0 for all) a process. ``(count, "slice(s)" |
    "process(es)")``."""
    if devices[0].platform == "tpu":
        count, what = len({d.slice_index for d in devices}), "slice"
    else:
        count, what = len({d.process_index for d in devices}), "process"
    return count, what if count == 1 else f"{what}{'es' if what == 'process' else 's'}"


def _shardings(tree: PyTree, rules: Rules, mesh: Mesh) -> PyTree:
    specs = partition_specs(tree, rules, mesh=mesh)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def shard(tree: PyTree, rules: Rules | None, mesh: Mesh) -> PyTree:
    """Put every array of ``tree`` on ``mesh`` as ``rules`` say (non-arrays unchanged);
    ``rules=None``: the tree's own ``partition_rules`` (an edl model's family rules, as
    EasyDeL's ``shard_model(partition_rules=None)``)."""
    return jax.device_put(tree, _shardings(tree, rules_for(tree, rules, "shard"), mesh))


def gather(tree: PyTree) -> PyTree:
    """Every array as one host ``numpy`` array (from any mesh, any process: arrays other
    processes hold are all-gathered)."""

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def _param_spec_lookup(param_specs: dict[str, PartitionSpec], shapes: dict[str, tuple]):
    """Spec of the parameter whose path ends an optimizer-state path (same shape), else P()."""
    by_length = sorted(param_specs, key=len, reverse=True)

    def lookup(path: str, shape: tuple[int, ...]) -> PartitionSpec:
        for param in by_length:
            if (path == param or path.endswith("." + param)) and shapes[param] == shape:
                return param_specs[param]
        return PartitionSpec()

    return lookup


def state_shardings(state: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """``NamedSharding``s for an ``edl.TrainState`` (same structure): params and frozen
    arrays by ``rules`` (``None``: the model's ``partition_rules``); each optimizer-state
    array like the parameter it tracks (matched by path suffix and shape: Adam's
    ``mu``/``nu``), scalars (step, counts) replicated."""
    rules = rules_for(state, rules, "state_shardings")
    params = {**flatten(state.params), **flatten(state.other)}
    specs = {p: s for p, s in flatten(partition_specs(params, rules, mesh=mesh)).items()}
    lookup = _param_spec_lookup(specs, {p: tuple(x.shape) for p, x in params.items()})

    def one(path: str, x: Any) -> NamedSharding | None:
        if not hasattr(x, "shape"):
            return None
        for prefix in ("params.", "other."):
            if path.startswith(prefix):
                return NamedSharding(mesh, specs[path[len(prefix) :]])
        return NamedSharding(mesh, lookup(path, tuple(x.shape)))

    return named_map(one, state)


def shard_state(state: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """``state`` placed by ``state_shardings`` (``rules=None``: the model's own)."""
    return jax.device_put(state, state_shardings(state, rules, mesh))


def gather_state(state: Any) -> Any:
    """``gather`` for a train state: every array on the host."""
    return gather(state)


def shard_with_shape(
    fn: Callable[..., PyTree], rules: Rules | None, mesh: Mesh
) -> Callable[..., PyTree]:
    """``fn`` (e.g. ``lambda key: Model.init(config, key=key)``) jitted so that its outputs
    are created already sharded: no device ever holds the whole model (EasyDeL's
    ``shard_with_shape`` / lazy init). Shapes come from ``jax.eval_shape``; ``rules=None``:
    the ``partition_rules`` of what ``fn`` returns."""

    def sharded(*args: Any, **kwargs: Any) -> PyTree:
        shapes = jax.eval_shape(lambda: fn(*args, **kwargs))
        arrays, static = _split_arrays(shapes)
        out_shardings = _shardings(arrays, rules_for(shapes, rules, "shard_with_shape"), mesh)
        make = jax.jit(lambda: _split_arrays(fn(*args, **kwargs))[0], out_shardings=out_shardings)
        return _merge_arrays(make(), static)

    return sharded


def _split_arrays(tree: PyTree) -> tuple[PyTree, PyTree]:
    import equinox as eqx

    return eqx.partition(tree, lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def _merge_arrays(arrays: PyTree, static: PyTree) -> PyTree:
    import equinox as eqx

    return eqx.combine(arrays, static)


def _coordination_client() -> Any:
    """The ``jax.distributed`` client of this process (``None`` when not initialised).
    jax exposes it only privately; orbax reaches it the same way."""
    from jax._src import distributed

    return distributed.global_state.client


def sync_processes(name: str, *, timeout_s: float = 1800.0) -> None:
    """Wait until every process of a multi-process run (``jax.distributed``) gets here;
    ``name`` is the same in all of them and new for every crossing. A barrier of the
    coordination service, not a device computation, so a background thread may wait
    while the main one runs collectives; raises after ``timeout_s`` (a process died).
    Nothing to wait for in a single process."""
    if jax.process_count() == 1:
        return
    client = _coordination_client()
    if client is None:  # processes joined some other way: a device-level barrier
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    client.wait_at_barrier(name, int(timeout_s * 1000))


def broadcast_text(key: str, value: str, *, timeout_s: float = 1800.0) -> str:
    """Process 0's ``value`` in every process, through the coordination service's key-value
    store under ``key`` (new for every call); ``value`` in a single process."""
    if jax.process_count() == 1:
        return value
    client = _coordination_client()
    if client is None:
        raise RuntimeError("broadcast_text: jax.distributed is not initialised")
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    return client.blocking_key_value_get(key, int(timeout_s * 1000))


def shard_batch(batch: PyTree, mesh: Mesh, *, seq_axis: bool = False) -> PyTree:
    """Place every array of ``batch`` by ``batch_spec``. With several processes each passes
    its own rows (its share of the global batch, in process order) and the global array is
    assembled with ``jax.make_array_from_process_local_data``."""

    def one(x: Any) -> Any:
        if not hasattr(x, "shape"):
            return x
        global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:]) if x.ndim else ()
        sharding = NamedSharding(mesh, batch_spec(global_shape, mesh, seq_axis=seq_axis))
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape)

    return jax.tree.map(one, batch)
