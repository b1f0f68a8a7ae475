"""DeepSeek-V3's MoE MLP: routed experts chosen by ``edl.ops.group_routing`` plus shared
experts every token goes through (HF's ``DeepseekV3MoE``).

``gate`` is HF's ``mlp.gate`` (``weight`` ``(experts, dim)`` and the choice-only
``e_score_correction_bias`` ``(experts,)``), ``experts`` the stacked routed experts as in
``edl.nn.moe``, ``shared_experts`` one gated MLP of ``n_shared_experts *
moe_intermediate_size`` (HF's ``mlp.shared_experts``). A ``SparseMoE`` subclass, so the
decoder calls it as any MoE MLP and sums its router statistics.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.nn.mlp import GatedMLP
from edl.nn.moe import Experts, SparseMoE
from edl.ops.activations import activation
from edl.ops.expert_parallel import routed_expert_mlp
from edl.ops.group_routing import grouped_sigmoid_route
from edl.ops.moe import RouterStats, router_stats

__all__ = ["GroupedMoE", "Router"]


class Router(eqx.Module):
    """The router's ``weight`` ``(experts, dim)`` and ``e_score_correction_bias``
    ``(experts,)`` (a buffer in HF: no gradient reaches it, since it only picks experts)."""

    weight: Float[Array, "experts dim"]
    e_score_correction_bias: Float[Array, " experts"]

    def __call__(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens experts"]:
        """Router logits in float32 (HF keeps the router in float32)."""
        return x.astype(jnp.float32) @ self.weight.astype(jnp.float32).T


class GroupedMoE(SparseMoE):
    """Routed experts (grouped sigmoid routing) plus shared experts."""

    gate: Router
    experts: Experts
    top_k: int = eqx.field(static=True)
    normalize: bool = eqx.field(static=True, default=True)
    act: str = eqx.field(static=True, default="silu")
    shared_experts: GatedMLP | None = None
    n_group: int = eqx.field(static=True, default=1)
    topk_group: int = eqx.field(static=True, default=1)
    routed_scaling_factor: float = eqx.field(static=True, default=1.0)

    @classmethod
    def init(  # type: ignore[override]
        cls,
        dim: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        n_shared: int = 1,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        normalize: bool = True,
        act: str = "silu",
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GroupedMoE:
        """``intermediate``: each expert's width; the shared MLP is ``n_shared`` times it
        (``n_shared=0``: none)."""
        activation(act)
        k_gate, k_experts, k_shared = jax.random.split(key, 3)
        gate = Router(
            std * jax.random.normal(k_gate, (num_experts, dim), dtype),
            jnp.zeros((num_experts,), dtype),
        )
        experts = Experts.init(num_experts, dim, intermediate, std=std, dtype=dtype, key=k_experts)
        shared = None
        if n_shared:
            shared = GatedMLP.init(
                dim, n_shared * intermediate, act=act, std=std, dtype=dtype, key=k_shared
            )
        return cls(
            gate,
            experts,
            top_k=top_k,
            shared_experts=shared,
            normalize=normalize,
            act=act,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
        )

    def __call__(
        self,
        x: Float[Array, "*batch dim"],
        mask: Array | None = None,
        *,
        impl: str = "blocked",
        capacity_factor: float | None = None,
    ) -> tuple[Float[Array, "*batch dim"], RouterStats]:
        """The output and this layer's router statistics (``probs``: each token's sigmoid
        scores normalised over experts, for the load-balancing statistic)."""
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        logits = self.gate(tokens)
        weights, chosen, scores = grouped_sigmoid_route(
            logits,
            self.gate.e_score_correction_bias,
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            normalize=self.normalize,
            scaling=self.routed_scaling_factor,
        )
        flat_mask = None if mask is None else mask.reshape(-1)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
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
        ).reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).astype(out.dtype)
        return out, stats
