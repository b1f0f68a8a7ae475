"""What model code needs of sharding: mesh axis names, partition rules and specs, and
activation constraints. Placing whole models and train states on a mesh is ``edl.sharding``.

edl shards with JAX's own SPMD on a 5-axis mesh ``AXES = ("dp", "fsdp", "tp", "sp", "expert")``
(data, fully-sharded data, tensor, sequence and expert parallel; ``edl.ops.expert_parallel``
dispatches tokens over ``expert``). A mesh without ``expert`` (built with the four older names)
means expert = 1: specs drop the axis there. Parameters get their specs from **rules**:
``(regex, PartitionSpec)`` pairs matched (``re.search``, first match wins) against
``edl.tree`` path strings such as ``"model.layers.self_attn.q_proj.weight"``; unmatched
arrays are replicated. ``rules=None`` means the rules the tree carries (``partition_rules``:
an edl model's family rules, a train state's model's). A mesh axis that does not divide an
array dimension is dropped from that dimension's spec (replicated there) with a debug log,
never an error: one rule set serves every mesh shape.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from edl.tree import compile_pattern, named_map

__all__ = [
    "AXES",
    "BATCH",
    "Rules",
    "batch_spec",
    "constrain",
    "fit_spec",
    "partition_specs",
    "rules_for",
]

log = logging.getLogger("edl.sharding")  # the name users know: the public facade's

AXES = ("dp", "fsdp", "tp", "sp", "expert")
# The batch dimension is split over both data axes and the expert axis: expert devices hold
# different tokens (as MaxText and Megatron lay out expert parallelism).
BATCH = ("dp", "fsdp", "expert")
# Axes a mesh may lack (size 1 then): dropped from specs without an error.
OPTIONAL_AXES = frozenset({"expert"})
Rules = Sequence[tuple[str, PartitionSpec]]


def fit_spec(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    axis_sizes: Any,
    path: str = "array",
    *,
    unknown_axes: str = "raise",
) -> PartitionSpec:
    """``spec`` padded to ``len(shape)``, keeping per dimension only the mesh axes whose
    (cumulative) size divides it; ``axis_sizes`` is ``mesh.shape`` (``None``: keep all).
    Axes the mesh lacks raise (but ``expert``, which is dropped: a 4-axis mesh has expert
    = 1), or are dropped with ``unknown_axes="drop"``."""
    entries = list(spec)
    if len(entries) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than {path!r} {shape}")
    entries += [None] * (len(shape) - len(entries))
    if axis_sizes is None:
        return PartitionSpec(*entries)
    fitted = []
    for dim, entry in zip(shape, entries, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept, size = [], 1
        for axis in axes:
            if axis not in axis_sizes:
                if unknown_axes == "raise" and axis not in OPTIONAL_AXES:
                    raise ValueError(
                        f"partition spec for {path!r} names axis {axis!r}, not in mesh"
                    )
                continue
            if dim % (size * axis_sizes[axis]):
                log.debug(
                    "%s: mesh axis %r (%d) does not divide dim %d; replicated there",
                    path,
                    axis,
                    axis_sizes[axis],
                    dim,
                )
                continue
            kept.append(axis)
            size *= axis_sizes[axis]
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*fitted)


def rules_for(tree: Any, rules: Rules | None, what: str) -> Rules:
    """``rules``, or where None the rules ``tree`` carries (``tree.partition_rules``);
    ``what`` names the caller in the error."""
    if rules is not None:
        return rules
    own = getattr(tree, "partition_rules", None)
    if own is None:
        raise ValueError(
            f"{what}: rules=None means the tree's own partition_rules, and a "
            f"{type(tree).__name__} has none (edl models and their train states do); pass "
            f"rules as [(path regex, PartitionSpec), ...]"
        )
    return own


def partition_specs(tree: PyTree, rules: Rules | None, *, mesh: Mesh | None = None) -> PyTree:
    """A ``PartitionSpec`` per array of ``tree`` from the first rule whose regex matches its
    path (``P()`` when none does); ``rules=None``: the tree's ``partition_rules``. With
    ``mesh``, axes that do not divide a dimension are dropped there. Works on arrays and
    ``jax.ShapeDtypeStruct``s alike."""
    rules = rules_for(tree, rules, "partition_specs")
    compiled = [(compile_pattern(p), spec) for p, spec in rules]

    def one(path: str, x: Any) -> PartitionSpec | None:
        if not hasattr(x, "shape"):
            return None
        spec = next((s for pattern, s in compiled if pattern.search(path)), PartitionSpec())
        return fit_spec(spec, tuple(x.shape), None if mesh is None else mesh.shape, path)

    return named_map(one, tree)


def batch_spec(shape: tuple[int, ...], mesh: Mesh, *, seq_axis: bool = False) -> PartitionSpec:
    """The spec of a batch array: leading axis over ``dp``, ``fsdp`` and ``expert`` (and the
    second over ``sp`` with ``seq_axis``), each axis only where it divides the dimension."""
    if not shape:
        return PartitionSpec()
    spec = PartitionSpec(BATCH, "sp" if seq_axis and len(shape) > 1 else None)
    return fit_spec(PartitionSpec(*list(spec)[: len(shape)]), shape, mesh.shape, "batch")


def constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """``with_sharding_constraint(x, spec)`` when a mesh is set (``jax.set_mesh``), with
    axes the mesh lacks or that do not divide ``x`` dropped; a no-op without a mesh, so
    models call it unconditionally (activation sharding: batch over dp+fsdp+expert, heads over tp,
    sequence over sp)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = fit_spec(spec, x.shape, mesh.shape, "activation", unknown_axes="drop")
    return jax.lax.with_sharding_constraint(x, spec)
