"""Expert parallelism: each device of the mesh's ``expert`` axis holds ``experts / n`` of an
MoE layer's experts and its own tokens; tokens travel to the devices holding their experts,
are computed there with the local grouped matmul, and travel back (GShard / MaxText /
Megatron's layout).

Inside one ``jax.shard_map`` (the batch split over ``dp`` x ``fsdp`` x ``expert`` and the
sequence over ``sp``, expert weights ``(experts / n, ...)`` per device, split over ``tp``
inside each expert where the layer allows it), each device:

1. sorts its ``tokens * k`` assignments by expert, hence by the device that holds the expert;
2. sends each device its rows: **ragged** (``jax.lax.ragged_all_to_all``: exactly the rows,
   at offsets agreed through an ``all_gather`` of the per-expert counts) in programs lowered
   for GPUs and TPUs, or **padded** (``jax.lax.all_to_all`` of a ``(devices, capacity, dim)``
   buffer) where XLA has no ragged all-to-all (XLA:CPU: "HLO opcode ragged-all-to-all is not
   supported by XLA:CPU ThunkEmitter"); chosen by the platform the program is lowered for
   (``edl.platforms.platform_dependent``);
3. runs its experts on what it received (``local_mlp``: ``edl.ops.moe.expert_mlp`` for
   Mixtral-style experts), summing the partial products of a ``tp``-split expert
   (``psum``);
4. sends the outputs back the same way and combines each token's ``k`` outputs with its
   routing weights in float32, as ``expert_mlp`` does.

**Dropping.** By default nothing is dropped: the padded form's capacity per pair of devices
is ``tokens * min(k, experts / n)`` (all of a device's assignments that can go to one
device) and the ragged form's receive buffer ``n`` times that, so results equal the
single-device ones. With ``capacity_factor`` (``moe_capacity_factor``) every platform uses
the padded form with ``ceil(tokens * k / n * capacity_factor)`` rows per pair: a device's
assignments to one device beyond that, in token order, are dropped (contribute zero), as the
``"capacity"`` impl drops beyond an expert's capacity; the buffers then shrink with ``n``.

Routing and the router statistics (load-balancing and z-losses) are computed before, by
SPMD over the global batch, exactly as without expert parallelism. Without a mesh, with
``expert`` of size 1, or where ``expert`` does not divide the experts or the batch, the
layer runs as before (``jax.jit``'s SPMD over the weights' shardings).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PyTree

from edl.ops.moe import expert_mlp
from edl.ops.sharding import BATCH, fit_spec
from edl.platforms import carry_platforms, platform_dependent

__all__ = ["EXPERT", "expert_devices", "expert_parallel", "routed_expert_mlp"]

log = logging.getLogger("edl.sharding")

EXPERT = "expert"  # the mesh axis experts are split over

# jax's collective, looked up when called: the tests check the ragged form's offsets on CPU
# with an all_gather emulation of it put here.
_ragged_all_to_all = jax.lax.ragged_all_to_all

# local_mlp(rows, local_ids, valid, params) -> outputs: each row through its (local) expert,
# times ``valid`` (0 for the buffer's empty rows).
LocalMLP = Callable[[Array, Array, Array, Any], Array]


def expert_devices(num_experts: int) -> int:
    """The size of the current mesh's ``expert`` axis (``jax.set_mesh``) when it splits
    ``num_experts`` evenly, else 1 (no mesh, no such axis, or one that does not divide)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT not in mesh.shape:
        return 1
    n = mesh.shape[EXPERT]
    if n > 1 and num_experts % n:
        log.debug("expert axis (%d) does not divide %d experts; experts not split", n, num_experts)
        return 1
    return n


def token_spec(shape: tuple[int, ...]) -> P | None:
    """The spec of ``(batch, [seq,] dim)`` tokens inside the dispatch (batch over dp x fsdp x
    expert, sequence over sp), or None where ``expert`` does not divide the batch."""
    mesh = jax.sharding.get_abstract_mesh()
    entries = [*[BATCH, "sp"][: len(shape) - 1], None]
    spec = fit_spec(P(*entries), shape, mesh.shape, "moe tokens", unknown_axes="drop")
    rows = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return spec if EXPERT in rows else None


def expert_parallel(
    x: Float[Array, "*batch dim"],
    weights: Float[Array, "*batch k"],
    chosen: Int[Array, "*batch k"],
    params: PyTree,
    param_specs: PyTree,
    local_mlp: LocalMLP,
    *,
    num_experts: int,
    capacity_factor: float | None = None,
    tp_partial: bool = False,
) -> Float[Array, "*batch dim"] | None:
    """``sum_k weights[..., k] * expert_{chosen[..., k]}(x)`` with the experts split over the
    mesh's ``expert`` axis (module docstring), or None where they cannot be (the caller then
    runs its single-device form).

    Args:
        x: the MoE layer's input, ``(batch, seq, dim)`` as the decoder gives it.
        weights, chosen: each token's routing weights (float32 / float64) and global expert
            ids, shaped like ``x`` but for ``k`` in place of ``dim``.
        params: the experts' arrays, leading axis ``num_experts``; ``param_specs`` their
            ``PartitionSpec`` inside the dispatch (leading entry ``"expert"``).
        local_mlp: ``(rows (r, dim), local ids (r,), valid (r,), local params) -> (r, dim)``.
        capacity_factor: None (exact, the default) or the padded form's rows per pair of
            devices as a multiple of the even share (tokens beyond it dropped).
        tp_partial: ``local_mlp`` returns partial sums over ``tp`` (experts split over tp).
    """
    n = expert_devices(num_experts)
    spec = token_spec(x.shape) if n > 1 else None
    if spec is None:
        return None
    k_spec = P(*spec[:-1], None)
    body = functools.partial(
        _per_device,
        local_mlp=local_mlp,
        devices=n,
        per_device=num_experts // n,
        capacity_factor=capacity_factor,
        tp_partial=tp_partial,
    )
    return jax.shard_map(
        carry_platforms(body),
        in_specs=(spec, k_spec, k_spec, param_specs),
        out_specs=spec,
    )(x, weights, chosen.astype(jnp.int32), params)


def routed_expert_mlp(
    x: Float[Array, "*batch dim"],
    weights: Float[Array, "tokens k"],
    chosen: Int[Array, "tokens k"],
    gate: Float[Array, "experts intermediate dim"],
    up: Float[Array, "experts intermediate dim"],
    down: Float[Array, "experts dim intermediate"],
    *,
    act: str = "silu",
    impl: str = "blocked",
    capacity_factor: float | None = None,
) -> Float[Array, "tokens dim"]:
    """``edl.ops.moe.expert_mlp`` of the flattened tokens of ``x`` (``tokens = prod(batch)``),
    over the mesh's ``expert`` axis where it splits the experts and the batch (each expert's
    width split over ``tp`` where tp divides it), else on one device as before. ``impl``
    is the local grouped matmul (``"capacity"``: ``"blocked"`` there, since tokens drop at
    the dispatch; ``capacity_factor``: see the module docstring)."""
    dim, k = x.shape[-1], chosen.shape[-1]
    if capacity_factor is not None:
        impl = "capacity"
    mesh = jax.sharding.get_abstract_mesh()
    tp = None if mesh.empty else mesh.shape.get("tp", 1)
    tp_axis = "tp" if tp is not None and tp > 1 and gate.shape[1] % tp == 0 else None
    local_impl = "blocked" if impl == "capacity" else impl

    def local_mlp(rows, ids, valid, params):
        g, u, d = params
        return expert_mlp(rows, valid[:, None], ids[:, None], g, u, d, act=act, impl=local_impl)

    batch = x.shape[:-1]
    out = expert_parallel(
        x,
        weights.reshape(*batch, k),
        chosen.reshape(*batch, k),
        (gate, up, down),
        (P(EXPERT, tp_axis, None), P(EXPERT, tp_axis, None), P(EXPERT, None, tp_axis)),
        local_mlp,
        num_experts=gate.shape[0],
        capacity_factor=(capacity_factor or 1.0) if impl == "capacity" else None,
        tp_partial=tp_axis is not None,
    )
    if out is not None:
        return out.reshape(-1, dim)
    return expert_mlp(
        x.reshape(-1, dim),
        weights,
        chosen,
        gate,
        up,
        down,
        act=act,
        impl=impl,
        capacity_factor=capacity_factor,
    )


def _per_device(
    x, weights, chosen, params, *, local_mlp, devices, per_device, capacity_factor, tp_partial
):
    """One device's part: sort, send, compute, send back, combine."""
    dim, k = x.shape[-1], chosen.shape[-1]
    tokens = x.reshape(-1, dim)
    flat = chosen.reshape(-1)  # assignment a = t * k + j
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # by expert, so by destination device
    sorted_experts = flat[order]
    rows = tokens[order // k]
    route = _Route.of(sorted_experts, devices, per_device, num_experts=devices * per_device)

    def run(received, local_ids, valid):
        # The weights made as varying as the rows they meet, so that a custom_vjp inside
        # local_mlp (the blocked matmul) sees one type and its weight gradients' sum over
        # the token axes is the transpose of this cast (a psum), done by jax.
        leaves = [received, *jax.tree.leaves(params)]
        axes = frozenset().union(*(jax.typeof(a).mat.varying for a in leaves))
        local, received = jax.tree.map(lambda w: _varying(w, axes), (params, received))
        out = local_mlp(received, local_ids, valid.astype(weights.dtype), local)
        return jax.lax.psum(out, "tp") if tp_partial else out

    exact_pairs = tokens.shape[0] * min(k, per_device)
    if capacity_factor is None:
        padded = functools.partial(_padded, capacity=exact_pairs, run=run)
        ragged = functools.partial(_ragged, buffer=devices * exact_pairs, run=run)
        # XLA:CPU has no ragged all-to-all; every other platform gets the exact rows.
        y_sorted = platform_dependent(rows, route, cpu=padded, default=ragged)
    else:
        capacity = max(1, math.ceil(flat.shape[0] / devices * capacity_factor))
        y_sorted = _padded(rows, route, capacity=min(capacity, exact_pairs), run=run)
    acc = weights.dtype
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y = y.reshape(tokens.shape[0], k, dim).astype(acc)
    out = jnp.einsum("tkd,tk->td", y, weights.reshape(-1, k)).astype(x.dtype)
    return out.reshape(x.shape)


class _Route:
    """Where one device's sorted assignments go: destination device, rank among the rows
    for that device, local expert id there, and the per-expert counts."""

    def __init__(self, dest, rank, local_ids, counts, devices, per_device):
        self.dest, self.rank, self.local_ids, self.counts = dest, rank, local_ids, counts
        self.devices, self.per_device = devices, per_device

    @classmethod
    def of(cls, sorted_experts, devices, per_device, *, num_experts):
        counts = jnp.bincount(sorted_experts, length=num_experts).astype(jnp.int32)
        sizes = counts.reshape(devices, per_device).sum(-1, dtype=jnp.int32)
        dest = sorted_experts // per_device
        first = (jnp.cumsum(sizes, dtype=jnp.int32) - sizes)[dest]  # each destination's first row
        rank = jnp.arange(sorted_experts.shape[0], dtype=jnp.int32) - first
        return cls(dest, rank, sorted_experts % per_device, counts, devices, per_device)


jax.tree_util.register_pytree_node(
    _Route,
    lambda r: ((r.dest, r.rank, r.local_ids, r.counts), (r.devices, r.per_device)),
    lambda aux, ch: _Route(*ch, *aux),
)


def _padded(rows, route: _Route, *, capacity: int, run):
    """The all-to-all form: a ``(devices, capacity, dim)`` buffer each way; assignments of
    rank >= ``capacity`` for their destination are dropped (zero)."""
    n, dim = route.devices, rows.shape[-1]
    slot = jnp.where(route.rank < capacity, route.dest * capacity + route.rank, n * capacity)
    send = jnp.zeros((n * capacity + 1, dim), rows.dtype).at[slot].set(rows)[:-1]
    ids = jnp.full((n * capacity + 1,), -1, jnp.int32).at[slot].set(route.local_ids)[:-1]
    a2a = functools.partial(jax.lax.all_to_all, axis_name=EXPERT, split_axis=0, concat_axis=0)
    received = a2a(send.reshape(n, capacity, dim)).reshape(n * capacity, dim)
    got = a2a(ids.reshape(n, capacity)).reshape(-1)
    out = run(received, jnp.maximum(got, 0), got >= 0)
    back = a2a(out.reshape(n, capacity, dim)).reshape(n * capacity, dim)
    return jnp.concatenate([back, jnp.zeros((1, dim), back.dtype)])[slot]


def _ragged(rows, route: _Route, *, buffer: int, run):
    """The ragged all-to-all form: exactly each destination's rows, into a receive buffer of
    ``buffer`` rows (every source's rows for this device, sources in order)."""
    n, per, dim = route.devices, route.per_device, rows.shape[-1]
    me = jax.lax.axis_index(EXPERT)
    counts = jax.lax.all_gather(route.counts, EXPERT).reshape(n, n, per)  # [src, dst, expert]
    pair = counts.sum(-1, dtype=jnp.int32)  # rows from src to dst
    # [src, dst]: a destination's rows from earlier sources; a source's for earlier ones
    before_src = jnp.cumsum(pair, axis=0, dtype=jnp.int32) - pair
    before_dst = jnp.cumsum(pair, axis=1, dtype=jnp.int32) - pair
    sent, got = pair[me], pair[:, me]
    out_start = before_src[me]  # where my rows land on each destination
    in_start = before_src[:, me]  # where each source's rows land here
    ragged = functools.partial(_ragged_all_to_all, axis_name=EXPERT)
    received = ragged(
        rows,
        _varying(jnp.zeros((buffer, dim), rows.dtype), rows),
        before_dst[me],
        sent,
        out_start,
        got,
    )
    # Row p of the buffer: source-major, then local expert, as counts[:, me] lists them.
    ends = jnp.cumsum(counts[:, me].reshape(-1), dtype=jnp.int32)
    p = jnp.arange(buffer, dtype=jnp.int32)
    group = jnp.searchsorted(ends, p, side="right")
    out = run(received, (group % per).astype(jnp.int32), p < ends[-1])
    back_rows = _varying(jnp.zeros((rows.shape[0], dim), out.dtype), rows)
    return ragged(out, back_rows, in_start, got, before_dst[:, me], sent)


def _varying(buffer: Array, like: Array | frozenset[str]) -> Array:
    """``buffer`` marked as varying over the mesh axes ``like`` varies over (or the axes
    ``like``): e.g. a ragged all-to-all's result has its output buffer's type, and must
    match the padded form's."""
    want = like if isinstance(like, frozenset) else jax.typeof(like).mat.varying
    axes = tuple(sorted(want - jax.typeof(buffer).mat.varying))
    return jax.lax.pcast(buffer, axes, to="varying") if axes else buffer
