"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), experts stored stacked.

``SparseMoE`` holds a router ``gate`` (a ``Linear`` dim -> experts, HF's ``mlp.gate``) and
``experts`` whose arrays stack every expert's gated-MLP weight in torch layout
(``experts.gate_proj`` / ``up_proj`` ``(experts, intermediate, dim)``, ``down_proj``
``(experts, dim, intermediate)``, as transformers 5 keeps them). The forward routes each
token to its top-k experts and returns the router statistics for the auxiliary losses
(``edl.ops.moe``).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.nn.layers import Linear
from edl.ops.activations import activation
from edl.ops.expert_parallel import routed_expert_mlp
from edl.ops.moe import RouterStats, route, router_stats

__all__ = ["Experts", "SparseMoE"]


class Experts(eqx.Module):
    """Every expert's gated-MLP weights, stacked along a leading expert axis."""

    gate_proj: Float[Array, "experts intermediate dim"]
    up_proj: Float[Array, "experts intermediate dim"]
    down_proj: Float[Array, "experts dim intermediate"]

    @classmethod
    def init(
        cls,
        num_experts: int,
        dim: int,
        intermediate: int,
        *,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> Experts:
        kg, ku, kd = jax.random.split(key, 3)
        normal = lambda k, shape: std * jax.random.normal(k, shape, dtype)
        return cls(
            normal(kg, (num_experts, intermediate, dim)),
            normal(ku, (num_experts, intermediate, dim)),
            normal(kd, (num_experts, dim, intermediate)),
        )


class SparseMoE(eqx.Module):
    """``sum_k w_k * expert_k(x)`` over each token's ``top_k`` experts."""

    gate: Linear
    experts: Experts
    top_k: int = eqx.field(static=True)
    normalize: bool = eqx.field(static=True, default=True)
    act: str = eqx.field(static=True, default="silu")

    @classmethod
    def init(
        cls,
        dim: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        normalize: bool = True,
        act: str = "silu",
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> SparseMoE:
        """``normalize``: renormalise the top-k routing weights to sum to 1 (Mixtral;
        Qwen3-MoE's ``norm_topk_prob``)."""
        activation(act)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"SparseMoE: top_k={top_k} for {num_experts} experts")
        k_gate, k_experts = jax.random.split(key)
        return cls(
            Linear.init(dim, num_experts, std=std, dtype=dtype, key=k_gate),
            Experts.init(num_experts, dim, intermediate, std=std, dtype=dtype, key=k_experts),
            top_k=top_k,
            normalize=normalize,
            act=act,
        )

    @property
    def num_experts(self) -> int:
        return self.experts.gate_proj.shape[-3]

    def __call__(
        self,
        x: Float[Array, "*batch dim"],
        mask: Array | None = None,
        *,
        impl: str = "blocked",
        capacity_factor: float | None = None,
    ) -> tuple[Float[Array, "*batch dim"], RouterStats]:
        """The output and this layer's router statistics. ``mask`` (shaped like ``x``'s
        batch dims; 1 real, 0 padding) keeps padding out of the statistics; padded tokens
        are still routed. ``impl`` / ``capacity_factor``: see ``edl.ops.moe.expert_mlp``."""
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        logits = self.gate(tokens)
        weights, chosen, probs = route(logits, self.top_k, normalize=self.normalize)
        flat_mask = None if mask is None else mask.reshape(-1)
        stats = router_stats(logits, probs, chosen, flat_mask)
        e = self.experts
        out = routed_expert_mlp(
            x,
            weights,
            chosen,
            e.gate_proj,
            e.up_proj,
            e.down_proj,
            act=self.act,
            impl=impl,
            capacity_factor=capacity_factor,
        )
        return out.reshape(x.shape), stats
