"""Mixture of experts as pure functions: top-k routing, the router's auxiliary losses, and
the experts' gated MLPs applied to routed tokens.

Routing (``route``) follows transformers: softmax over the router logits in float32, the
``top_k`` largest probabilities, optionally renormalised to sum to 1 (Mixtral always,
Qwen3-MoE with ``norm_topk_prob``). ``expert_mlp`` then sends each token through its chosen
experts without ever forming a ``(tokens, experts, dim)`` array:

- ``"blocked"`` (default, dropless): the ``tokens * top_k`` assignments are sorted by expert
  into blocks of ``block_size`` rows, each block padded and owned by one expert (at most
  ``tokens * top_k / block_size + experts`` blocks), and one ``lax.scan`` over the blocks
  runs the owning expert's MLP on each (MegaBlocks' layout). Its backward pass is written
  by hand and accumulates each expert's weight gradient in place.
- ``"capacity"``: each expert takes at most ``ceil(tokens * top_k / experts *
  capacity_factor)`` assignments, in token order; the rest are dropped (contribute zero), as
  in Switch / GShard. Dense ``(experts, capacity, dim)`` batched matmuls.
- ``"ragged"``: ``jax.lax.ragged_dot_general`` on the sorted assignments (a native grouped
  matmul on TPU; on CPU, jax lowers it to a dense masked product).
- ``"dense"``: every expert on every token, then the routed ones are kept: the reference the
  others are tested against (``experts`` times the FLOPs).

Expert weights use the torch layout of transformers' stacked experts: ``gate``/``up``
``(experts, intermediate, dim)``, ``down`` ``(experts, dim, intermediate)``.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, Shaped

from edl.ops.activations import activation

__all__ = [
    "MOE_IMPLS",
    "RouterStats",
    "expert_mlp",
    "load_balancing_loss",
    "route",
    "router_stats",
    "router_z_loss",
]

MOE_IMPLS = ("blocked", "capacity", "ragged", "dense")
# checkpoint names of the dispatched rows and the experts' outputs: remat policies that save
# matmul outputs ("dots" in edl.nn.stack) keep these too, so that the backward pass does not
# run the sorted dispatch and every expert's forward a second time.
MOE_ROWS = "edl_moe_rows"
MOE_OUT = "edl_moe_out"

Tokens = Float[Array, "tokens dim"]
Gate = Float[Array, "experts intermediate dim"]
Down = Float[Array, "experts dim intermediate"]


def route(
    logits: Float[Array, "tokens experts"], top_k: int, *, normalize: bool
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"], Float[Array, "tokens experts"]]:
    """``(weights, experts, probs)``: each token's ``top_k`` experts and their float32
    routing weights (renormalised to sum to 1 with ``normalize``), and the full softmax."""
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"route: top_k={top_k} for {logits.shape[-1]} experts")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


class RouterStats(eqx.Module):
    """Sums over the routed tokens of one or more MoE layers (add layers' stats with ``+``):
    ``counts[e]`` assignments to expert ``e``, ``probs[e]`` its routing probability,
    ``z`` the squared log-partition, ``tokens`` the number of tokens. Padding is excluded."""

    counts: Float[Array, " experts"]
    probs: Float[Array, " experts"]
    z: Float[Array, ""]
    tokens: Float[Array, ""]

    def __add__(self, other: RouterStats) -> RouterStats:
        return jax.tree.map(jnp.add, self, other)

    @classmethod
    def zeros(cls, num_experts: int) -> RouterStats:
        zero, per_expert = jnp.zeros((), jnp.float32), jnp.zeros((num_experts,), jnp.float32)
        return cls(per_expert, per_expert, zero, zero)


def router_stats(
    logits: Float[Array, "tokens experts"],
    probs: Float[Array, "tokens experts"],
    experts: Int[Array, "tokens k"],
    mask: Shaped[Array, " tokens"] | None = None,
) -> RouterStats:
    """One layer's ``RouterStats``; ``mask`` (1 real, 0 padding) weights every token."""
    num_experts = logits.shape[-1]
    mask = jnp.ones(logits.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # (tokens, k, experts)
    counts = jnp.einsum("tke,t->e", onehot, mask)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return RouterStats(
        counts, jnp.einsum("te,t->e", probs, mask), jnp.sum(lse * lse * mask), jnp.sum(mask)
    )


def load_balancing_loss(stats: RouterStats) -> Float[Array, ""]:
    """Switch Transformer's auxiliary loss as transformers computes it over all MoE layers:
    ``experts * sum_e (counts_e / tokens) * (probs_e / tokens)`` (1.0 top_k-fold when the
    load is perfectly balanced; 0.0 when no token was counted)."""
    tokens = jnp.maximum(stats.tokens, 1.0)
    return stats.counts.shape[0] * jnp.sum((stats.counts / tokens) * (stats.probs / tokens))


def router_z_loss(stats: RouterStats) -> Float[Array, ""]:
    """ST-MoE's router z-loss: mean over tokens (and layers) of ``logsumexp(logits) ** 2``."""
    return stats.z / jnp.maximum(stats.tokens, 1.0)


def expert_mlp(
    x: Tokens,
    weights: Float[Array, "tokens k"],
    experts: Int[Array, "tokens k"],
    gate: Gate,
    up: Gate,
    down: Down,
    *,
    act: str = "silu",
    impl: str = "blocked",
    capacity_factor: float | None = None,
    block_size: int | None = None,
) -> Tokens:
    """``sum_k weights[t, k] * mlp_{experts[t, k]}(x[t])`` with ``mlp_e(x) = down_e(act(gate_e
    x) * up_e x)``; see the module docstring for ``impl``. ``capacity_factor`` selects
    ``"capacity"``. Computes in ``x``'s dtype (weights are cast), combines in float32."""
    num_experts, intermediate, dim = gate.shape
    fits = down.shape == (num_experts, dim, intermediate) and up.shape == gate.shape
    if x.shape[-1] != dim or not fits:
        raise ValueError(
            f"expert_mlp: x {x.shape}, gate {gate.shape}, up {up.shape}, down {down.shape} do "
            f"not fit (experts, intermediate, dim) / (experts, dim, intermediate)"
        )
    if capacity_factor is not None:
        impl = "capacity"
    if impl not in MOE_IMPLS:
        raise ValueError(f"expert_mlp: impl must be one of {MOE_IMPLS}, got {impl!r}")
    activation(act)
    tokens, k = experts.shape
    gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
    acc = jnp.float64 if weights.dtype == jnp.float64 else jnp.float32  # the combine's dtype
    if impl == "dense":
        dense = jnp.zeros((tokens, num_experts), acc)
        dense = dense.at[jnp.arange(tokens, dtype=jnp.int32)[:, None], experts].add(weights)
        g = jnp.einsum("th,eih->eti", x, gate)
        h = activation(act)(g) * jnp.einsum("th,eih->eti", x, up)
        y = jnp.einsum("eti,ehi->eth", h, down)
        return jnp.einsum("eth,te->th", y.astype(acc), dense).astype(x.dtype)

    flat = experts.reshape(-1)  # assignment a = t * k + j
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, in token order
    sorted_experts = flat[order]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[sorted_experts]
    rows = checkpoint_name(x[order // k], MOE_ROWS)  # (assignments, dim)
    if impl == "capacity":
        capacity = max(1, math.ceil(flat.shape[0] / num_experts * (capacity_factor or 1.0)))
        y_sorted = _capacity_mlp(rows, sorted_experts, rank, capacity, gate, up, down, act)
    elif impl == "ragged":
        y_sorted = _ragged_mlp(rows, sizes, gate, up, down, act)
    else:
        y_sorted = _blocked_mlp(rows, sorted_experts, sizes, rank, gate, up, down, act, block_size)
    y_sorted = checkpoint_name(y_sorted, MOE_OUT)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y = y.reshape(tokens, k, dim).astype(acc)
    return jnp.einsum("tkh,tk->th", y, weights.astype(acc)).astype(x.dtype)


def _mlp(x, gate, up, down, act):
    """One expert's gated MLP on rows ``x`` (weights in torch layout)."""
    g = jnp.einsum("rh,ih->ri", x, gate)
    return jnp.einsum("ri,hi->rh", activation(act)(g) * jnp.einsum("rh,ih->ri", x, up), down)


def _capacity_mlp(rows, sorted_experts, rank, capacity, gate, up, down, act):
    num_experts, dim = gate.shape[0], rows.shape[-1]
    # Dropped assignments (rank >= capacity) go to a spare slot that is never computed.
    slot = jnp.where(rank < capacity, sorted_experts * capacity + rank, num_experts * capacity)
    buf = jnp.zeros((num_experts * capacity + 1, dim), rows.dtype).at[slot].set(rows)
    buf = buf[:-1].reshape(num_experts, capacity, dim)
    g = jnp.einsum("ech,eih->eci", buf, gate)
    h = activation(act)(g) * jnp.einsum("ech,eih->eci", buf, up)
    y = jnp.einsum("eci,ehi->ech", h, down).reshape(num_experts * capacity, dim)
    return jnp.concatenate([y, jnp.zeros((1, dim), y.dtype)])[slot]


def _ragged_mlp(rows, sizes, gate, up, down, act):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    dot = functools.partial(
        jax.lax.ragged_dot_general,
        group_sizes=sizes.astype(jnp.int32),
        ragged_dot_dimension_numbers=dims,
    )
    h = activation(act)(dot(rows, gate)) * dot(rows, up)
    return dot(h, down)


def default_block_size(assignments: int, num_experts: int) -> int:
    """Rows per block: the power of two near the mean assignments per expert, in [8, 128]."""
    mean = max(1, assignments // num_experts)
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def _blocked_mlp(rows, sorted_experts, sizes, rank, gate, up, down, act, block_size):
    num_experts, dim = gate.shape[0], rows.shape[-1]
    b = block_size or default_block_size(rows.shape[0], num_experts)
    num_blocks = (rows.shape[0] + num_experts * (b - 1)) // b  # sum_e ceil(size_e / b) at most
    blocks_per = (sizes + b - 1) // b
    block_end = jnp.cumsum(blocks_per)
    pos = (block_end - blocks_per)[sorted_experts] * b + rank  # padded row of each assignment
    owner = jnp.searchsorted(block_end, jnp.arange(num_blocks, dtype=jnp.int32), side="right")
    owner = jnp.minimum(owner, num_experts - 1).astype(jnp.int32)  # spare blocks stay zero
    padded = jnp.zeros((num_blocks * b, dim), rows.dtype).at[pos].set(rows, unique_indices=True)
    y = _block_mlp(padded.reshape(num_blocks, b, dim), owner, gate, up, down, act)
    return y.reshape(num_blocks * b, dim)[pos]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _block_mlp(x, owner, gate, up, down, act):
    """``x[n]`` ``(blocks, rows, dim)`` through expert ``owner[n]``'s MLP, block by block."""

    def body(_, xs):
        xb, e = xs
        return None, _mlp(xb, gate[e], up[e], down[e], act)

    return jax.lax.scan(body, None, (x, owner))[1]


def _block_mlp_fwd(x, owner, gate, up, down, act):
    return _block_mlp(x, owner, gate, up, down, act), (x, owner, gate, up, down)


def _block_mlp_bwd(act, res, dy):
    x, owner, gate, up, down = res
    fn = activation(act)

    def body(grads, xs):
        xb, dyb, e = xs
        g_w, u_w, d_w = gate[e], up[e], down[e]
        g = jnp.einsum("rh,ih->ri", xb, g_w)
        u = jnp.einsum("rh,ih->ri", xb, u_w)
        a, act_vjp = jax.vjp(fn, g)
        dh = jnp.einsum("rh,hi->ri", dyb, d_w)
        (dg,) = act_vjp(dh * u)
        du = dh * a
        dx = jnp.einsum("ri,ih->rh", dg, g_w) + jnp.einsum("ri,ih->rh", du, u_w)
        d_gate, d_up, d_down = grads
        d_gate = d_gate.at[e].add(jnp.einsum("ri,rh->ih", dg, xb).astype(d_gate.dtype))
        d_up = d_up.at[e].add(jnp.einsum("ri,rh->ih", du, xb).astype(d_up.dtype))
        d_down = d_down.at[e].add(jnp.einsum("rh,ri->hi", dyb, a * u).astype(d_down.dtype))
        return (d_gate, d_up, d_down), dx

    zeros = tuple(jnp.zeros_like(w) for w in (gate, up, down))
    (d_gate, d_up, d_down), dx = jax.lax.scan(body, zeros, (x, dy, owner))
    return dx, None, d_gate, d_up, d_down


_block_mlp.defvjp(_block_mlp_fwd, _block_mlp_bwd)
