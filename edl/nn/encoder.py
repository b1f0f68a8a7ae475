"""The transformer encoder layer of CLIP / SigLIP towers (HF layout): multi-head attention
with biased ``q/k/v/out_proj`` and a two-layer ``fc1`` / ``fc2`` MLP, each behind a
pre-norm ``LayerNorm`` and a residual add::

    h = h + self_attn(layer_norm1(h))
    h = h + mlp(layer_norm2(h))

Attention goes through ``edl.ops.attention`` (the Pallas kernel where it runs), without
RoPE: these towers add learned position embeddings to their inputs instead.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.nn.layers import LayerNorm, Linear
from edl.ops.activations import activation
from edl.ops.attention import SegmentIds, attention

__all__ = ["MLP", "EncoderAttention", "EncoderLayer"]


class EncoderAttention(eqx.Module):
    """Multi-head self-attention with biases: ``q/k/v_proj`` -> ``edl.ops.attention`` ->
    ``out_proj`` (``head_dim = dim // num_heads``, logits scaled by ``head_dim ** -0.5``)."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    out_proj: Linear
    num_heads: int = eqx.field(static=True)

    @classmethod
    def init(
        cls, dim: int, num_heads: int, *, std: float, dtype: DTypeLike, key: PRNGKeyArray
    ) -> EncoderAttention:
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        keys = jax.random.split(key, 4)
        q, k, v, o = (
            Linear.init(dim, dim, use_bias=True, std=std, dtype=dtype, key=k) for k in keys
        )
        return cls(q, k, v, o, num_heads=num_heads)

    def __call__(
        self,
        x: Float[Array, "batch seq dim"],
        segment_ids: SegmentIds | None = None,
        *,
        causal: bool = False,
        impl: str = "auto",
    ) -> Float[Array, "batch seq dim"]:
        """``segment_ids``: as in ``edl.ops.attention`` (padded keys get a query-less id);
        ``causal``: CLIP's text tower masks future tokens."""
        b, s, dim = x.shape
        heads = (b, s, self.num_heads, dim // self.num_heads)
        q, k, v = (p(x).reshape(heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = attention(q, k, v, causal=causal, segment_ids=segment_ids, impl=impl)
        return self.out_proj(out.reshape(b, s, dim))


class MLP(eqx.Module):
    """``fc2(act(fc1(x)))`` with biases (CLIP's and SigLIP's MLP)."""

    fc1: Linear
    fc2: Linear
    act: str = eqx.field(static=True, default="quick_gelu")

    @classmethod
    def init(
        cls,
        dim: int,
        intermediate: int,
        *,
        act: str,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> MLP:
        activation(act)  # fail at construction, not at the first call
        k1, k2 = jax.random.split(key)
        return cls(
            Linear.init(dim, intermediate, use_bias=True, std=std, dtype=dtype, key=k1),
            Linear.init(intermediate, dim, use_bias=True, std=std, dtype=dtype, key=k2),
            act=act,
        )

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        return self.fc2(activation(self.act)(self.fc1(x)))


class EncoderLayer(eqx.Module):
    """Pre-norm encoder block (HF's ``CLIPEncoderLayer`` / ``SiglipEncoderLayer``)."""

    self_attn: EncoderAttention
    layer_norm1: LayerNorm
    mlp: MLP
    layer_norm2: LayerNorm

    @classmethod
    def init(
        cls,
        dim: int,
        intermediate: int,
        num_heads: int,
        *,
        act: str,
        eps: float,
        std: float,
        dtype: DTypeLike,
        key: PRNGKeyArray,
    ) -> EncoderLayer:
        k_attn, k_mlp = jax.random.split(key)
        return cls(
            EncoderAttention.init(dim, num_heads, std=std, dtype=dtype, key=k_attn),
            LayerNorm.init(dim, eps=eps, dtype=dtype),
            MLP.init(dim, intermediate, act=act, std=std, dtype=dtype, key=k_mlp),
            LayerNorm.init(dim, eps=eps, dtype=dtype),
        )

    def __call__(
        self,
        h: Float[Array, "batch seq dim"],
        segment_ids: SegmentIds | None = None,
        *,
        causal: bool = False,
        impl: str = "auto",
    ) -> Float[Array, "batch seq dim"]:
        h = h + self.self_attn(self.layer_norm1(h), segment_ids, causal=causal, impl=impl)
        return h + self.mlp(self.layer_norm2(h))
