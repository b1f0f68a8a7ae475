"""GPT-OSS's mixture-of-experts MLP: a biased router, experts with biases and the clamped
SwiGLU, weights kept in transformers' layout.

``GptOssMoE`` holds ``router`` (a ``Linear`` dim -> experts with a bias, HF's
``mlp.router``) and ``experts`` (HF's ``mlp.experts``) whose arrays are transformers' own
parameters, not ``Linear`` weights: ``gate_up_proj`` ``(experts, dim, 2 * intermediate)`` with
gate and up *interleaved* along the last axis (gate at even, up at odd columns),
``gate_up_proj_bias`` ``(experts, 2 * intermediate)``, ``down_proj`` ``(experts, intermediate,
dim)`` and ``down_proj_bias`` ``(experts, dim)``; a file's tensors load and save unchanged.

Routing: the ``top_k`` largest router logits, softmax over those (``edl.ops.moe.route`` with
renormalisation: the same weights). Each expert computes
``down(clamped_swiglu(x @ gate_up + b_gu)) + b_down`` (:func:`clamped_swiglu`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.nn.layers import Linear
from edl.ops.expert_parallel import EXPERT, expert_parallel
from edl.ops.moe import MOE_IMPLS, RouterStats, route, router_stats

__all__ = ["GptOssExperts", "GptOssMoE", "clamped_swiglu", "gpt_oss_expert_mlp"]


def clamped_swiglu(
    gate_up: Float[Array, "*rows two_inter"], *, alpha: float, limit: float
) -> Float[Array, "*rows inter"]:
    """GPT-OSS's gated activation of interleaved ``[g0, u0, g1, u1, ...]``:
    ``(clip(u, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(g, limit)``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class GptOssExperts(eqx.Module):
    """Every expert's weights and biases, stacked along a leading expert axis (HF layout)."""

    gate_up_proj: Float[Array, "experts dim two_inter"]
    gate_up_proj_bias: Float[Array, "experts two_inter"]
    down_proj: Float[Array, "experts inter dim"]
    down_proj_bias: Float[Array, "experts dim"]
    alpha: float = eqx.field(static=True, default=1.702)
    limit: float = eqx.field(static=True, default=7.0)

    @classmethod
    def init(
        cls,
        num_experts: int,
        dim: int,
        intermediate: int,
        *,
        alpha: float = 1.702,
        limit: float = 7.0,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GptOssExperts:
        """Weights normal(0, ``std``), biases zero, as transformers initialises them."""
        k_gu, k_down = jax.random.split(key)
        return cls(
            std * jax.random.normal(k_gu, (num_experts, dim, 2 * intermediate), dtype),
            jnp.zeros((num_experts, 2 * intermediate), dtype),
            std * jax.random.normal(k_down, (num_experts, intermediate, dim), dtype),
            jnp.zeros((num_experts, dim), dtype),
            alpha=alpha,
            limit=limit,
        )


def gpt_oss_expert_mlp(
    x: Float[Array, "tokens dim"],
    weights: Float[Array, "tokens k"],
    chosen: Int[Array, "tokens k"],
    experts: GptOssExperts,
    *,
    impl: str = "ragged",
) -> Float[Array, "tokens dim"]:
    """``sum_k weights[t, k] * expert_{chosen[t, k]}(x[t])``, computed in ``x``'s dtype and
    combined in float32.

    ``impl``: ``"dense"`` runs every expert on every token (the reference); the others sort
    the ``tokens * k`` assignments by expert and run ``jax.lax.ragged_dot`` (a grouped matmul
    on TPU / GPU; jax lowers it to a masked dense product on CPU)."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"gpt_oss_expert_mlp: impl must be one of {MOE_IMPLS}, got {impl!r}")
    e = experts
    num_experts, dim = e.gate_up_proj.shape[0], x.shape[-1]
    gu, gu_b, down, down_b = (
        w.astype(x.dtype)
        for w in (e.gate_up_proj, e.gate_up_proj_bias, e.down_proj, e.down_proj_bias)
    )
    act = lambda h: clamped_swiglu(h, alpha=e.alpha, limit=e.limit)
    acc = jnp.float64 if weights.dtype == jnp.float64 else jnp.float32
    tokens, k = chosen.shape
    if impl == "dense":
        dense = jnp.zeros((tokens, num_experts), acc)
        dense = dense.at[jnp.arange(tokens, dtype=jnp.int32)[:, None], chosen].add(weights)
        h = act(jnp.einsum("td,edi->eti", x, gu) + gu_b[:, None])
        y = jnp.einsum("eti,eid->etd", h, down) + down_b[:, None]
        return jnp.einsum("etd,te->td", y.astype(acc), dense).astype(x.dtype)
    flat = chosen.reshape(-1)  # assignment a = t * k + j
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // k]
    h = act(jax.lax.ragged_dot(rows, gu, sizes) + gu_b[sorted_experts])
    y_sorted = jax.lax.ragged_dot(h, down, sizes) + down_b[sorted_experts]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y = y.reshape(tokens, k, dim).astype(acc)
    return jnp.einsum("tkd,tk->td", y, weights.astype(acc)).astype(x.dtype)


class GptOssMoE(eqx.Module):
    """``sum_k w_k * expert_k(x)`` over each token's ``top_k`` experts (module docstring)."""

    router: Linear
    experts: GptOssExperts
    top_k: int = eqx.field(static=True)

    @classmethod
    def init(
        cls,
        dim: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        alpha: float = 1.702,
        limit: float = 7.0,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GptOssMoE:
        """Router weight and bias normal(0, ``std``), as transformers initialises them."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"GptOssMoE: top_k={top_k} for {num_experts} experts")
        k_w, k_b, k_experts = jax.random.split(key, 3)
        router = Linear.init(dim, num_experts, use_bias=True, std=std, dtype=dtype, key=k_w)
        router = eqx.tree_at(
            lambda r: r.bias, router, std * jax.random.normal(k_b, (num_experts,), dtype)
        )
        experts = GptOssExperts.init(
            num_experts,
            dim,
            intermediate,
            alpha=alpha,
            limit=limit,
            std=std,
            dtype=dtype,
            key=k_experts,
        )
        return cls(router, experts, top_k=top_k)

    @property
    def num_experts(self) -> int:
        return self.experts.gate_up_proj.shape[-3]

    def __call__(
        self,
        x: Float[Array, "*batch dim"],
        mask: Array | None = None,
        *,
        impl: str = "blocked",
        capacity_factor: float | None = None,
    ) -> tuple[Float[Array, "*batch dim"], RouterStats]:
        """The output and this layer's router statistics, as ``edl.nn.moe.SparseMoE``.
        ``impl="dense"``: every expert on every token; any other: the ragged grouped matmul.
        ``capacity_factor`` (dropping tokens) is not supported: ``ValueError``."""
        if capacity_factor is not None:
            raise ValueError(
                "GptOssMoE: capacity_factor is not supported (GPT-OSS experts run dropless)"
            )
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        logits = self.router(tokens)
        weights, chosen, probs = route(logits, self.top_k, normalize=True)
        flat_mask = None if mask is None else mask.reshape(-1)
        stats = router_stats(logits, probs, chosen, flat_mask)
        impl = "dense" if impl == "dense" else "ragged"
        experts = self.experts
        if not isinstance(experts, GptOssExperts):  # LoRA on them: edl.nn.lora_experts
            experts = experts.merge()
        out = _expert_parallel(x, weights, chosen, experts, impl)
        if out is None:  # no expert axis to split the experts over
            out = gpt_oss_expert_mlp(tokens, weights, chosen, experts, impl=impl)
        return out.reshape(x.shape), stats


def _expert_parallel(x, weights, chosen, experts: GptOssExperts, impl: str):
    """``gpt_oss_expert_mlp`` with the experts split over the mesh's ``expert`` axis
    (``edl.ops.expert_parallel``), or None where they are not. Each expert whole on its
    device (tp gathered): the down bias is added once."""

    def local_mlp(rows, ids, valid, local):
        return gpt_oss_expert_mlp(rows, valid[:, None], ids[:, None], local, impl=impl)

    batch, k = x.shape[:-1], chosen.shape[-1]
    return expert_parallel(
        x,
        weights.reshape(*batch, k),
        chosen.reshape(*batch, k),
        experts,
        jax.tree.map(lambda _: P(EXPERT), experts),
        local_mlp,
        num_experts=experts.gate_up_proj.shape[0],
    )
