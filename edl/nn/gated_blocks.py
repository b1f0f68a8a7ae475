"""Qwen3-Next's gated full attention and its MoE with a gated shared expert (HF layout).

``GatedAttention`` (transformers' ``Qwen3NextAttention``): ``q_proj`` emits, per head, the
query and an output gate (``2 * head_dim`` features: query first); q/k RMSNorm per head,
(partial) RoPE, attention, then the output times ``sigmoid(gate)`` before ``o_proj``.

``SharedExpertMoE`` (``Qwen3NextSparseMoeBlock``): the routed experts of ``SparseMoE`` plus
one dense ``shared_expert`` every token runs through, scaled by
``sigmoid(shared_expert_gate(x))`` (a ``dim -> 1`` projection).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.nn.attention import Attention, KVCacheLike
from edl.nn.layers import Linear
from edl.nn.mlp import GatedMLP
from edl.nn.moe import SparseMoE
from edl.ops.attention import SegmentIds, attention
from edl.ops.moe import RouterStats
from edl.ops.rope import apply_rope

__all__ = ["GatedAttention", "SharedExpertMoE"]

Rope = Float[Array, "batch seq rope_dim"]


class GatedAttention(Attention):
    """Causal GQA attention with a per-feature sigmoid output gate from ``q_proj``."""

    @classmethod
    def init_gated(
        cls,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        qk_norm_eps: float,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GatedAttention:
        """Zero-centred (``1 + w``) q/k norms, as every Qwen3-Next RMSNorm."""
        k_base, k_q = jax.random.split(key)
        base = Attention.init(
            dim,
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm_eps=qk_norm_eps,
            qk_norm_offset=1.0,
            std=std,
            dtype=dtype,
            key=k_base,
        )
        q_proj = Linear.init(
            dim, 2 * num_heads * head_dim, use_bias=bias, std=std, dtype=dtype, key=k_q
        )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return cls(**{**fields, "q_proj": q_proj})

    def __call__(
        self,
        x: Float[Array, "batch seq dim"],
        cos: Rope | None,
        sin: Rope | None,
        segment_ids: SegmentIds | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        impl: str = "auto",
    ) -> Float[Array, "batch seq dim"]:
        q, k, v, gate = self._gated_project(x, cos, sin)
        out = attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=segment_ids,
            window=window,
            softcap=softcap,
            scale=scale,
            impl=impl,
        )
        return self._output(out, gate)

    def decode(
        self,
        x: Float[Array, "batch seq dim"],
        cos: Rope | None,
        sin: Rope | None,
        cache: KVCacheLike,
        layer: Int[Array, ""] | int,
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        impl: str = "auto",
    ) -> tuple[Float[Array, "batch seq dim"], KVCacheLike]:
        q, k, v, gate = self._gated_project(x, cos, sin)
        cache = cache.update(layer, k, v)
        out = cache.attend(layer, q, k, v, window=window, softcap=softcap, scale=scale, impl=impl)
        return self._output(out, gate), cache

    def _output(self, out: jax.Array, gate: jax.Array) -> jax.Array:
        b, s = out.shape[:2]
        out = out.reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out * jax.nn.sigmoid(gate).astype(out.dtype))

    def _gated_project(self, x, cos, sin):
        """q ``(b, s, heads, d)``, k / v ``(b, s, kv_heads, d)`` normed and rotated, and the
        gate ``(b, s, heads * d)`` (transformers' ``torch.chunk`` of each head's features)."""
        b, s, _ = x.shape
        qg = self.q_proj(x).reshape(b, s, self.num_heads, 2 * self.head_dim)
        q, gate = jnp.split(qg, 2, axis=-1)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None and sin is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v, gate.reshape(b, s, self.num_heads * self.head_dim)


class SharedExpertMoE(SparseMoE):
    """``SparseMoE`` plus a gated shared expert (see the module docstring)."""

    shared_expert: GatedMLP | None = None
    shared_expert_gate: Linear | None = None

    @classmethod
    def init_shared(
        cls,
        dim: int,
        intermediate: int,
        shared_intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        normalize: bool,
        act: str = "silu",
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> SharedExpertMoE:
        k_moe, k_shared, k_gate = jax.random.split(key, 3)
        base = SparseMoE.init(
            dim,
            intermediate,
            num_experts,
            top_k,
            normalize=normalize,
            act=act,
            std=std,
            dtype=dtype,
            key=k_moe,
        )
        shared = GatedMLP.init(
            dim, shared_intermediate, act=act, std=std, dtype=dtype, key=k_shared
        )
        gate = Linear.init(dim, 1, std=std, dtype=dtype, key=k_gate)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return cls(**fields, shared_expert=shared, shared_expert_gate=gate)

    def __call__(
        self,
        x: Float[Array, "*batch dim"],
        mask: Array | None = None,
        *,
        impl: str = "blocked",
        capacity_factor: float | None = None,
    ) -> tuple[Float[Array, "*batch dim"], RouterStats]:
        out, stats = super().__call__(x, mask, impl=impl, capacity_factor=capacity_factor)
        shared = self.shared_expert(x) * jax.nn.sigmoid(self.shared_expert_gate(x))
        return out + shared.astype(out.dtype), stats
