"""Leaf layers with Hugging Face weight layouts: Linear, Embedding, RMSNorm, LayerNorm.

Each is an ``eqx.Module`` holding arrays and static config, built by ``Module.init(...,
key=...)``; they compute in the input's dtype (weights are cast), so float32 master weights
serve bfloat16 activations.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.ops.matmul import linear
from edl.ops.norms import layer_norm, rms_norm

__all__ = [
    "Embedding",
    "LayerNorm",
    "Linear",
    "RMSNorm",
]


class Linear(eqx.Module):
    """``y = x @ weight.T + bias`` with ``weight`` shaped ``(out, in)`` as in torch."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None

    @classmethod
    def init(
        cls,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = False,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> Linear:
        """Weights ~ N(0, std) (HF's ``initializer_range``), bias zero."""
        weight = std * jax.random.normal(key, (out_features, in_features), dtype)
        return cls(weight, jnp.zeros((out_features,), dtype) if use_bias else None)

    def __call__(
        self, x: Float[Array, "*batch in"], *, addend: Float[Array, "*batch out"] | None = None
    ) -> Float[Array, "*batch out"]:
        """``x @ weight.T (+ addend) + bias``; ``addend`` (a LoRA update) joins the product as
        in ``edl.ops.linear``, so an all-zero one changes no bit of the output."""
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"Linear: input features {x.shape[-1]} != weight's {self.weight.shape[1]}"
            )
        return add_bias(linear(x, self.weight, addend=addend), self.bias)


def add_bias(y: Float[Array, "*batch out"], bias: Float[Array, " out"] | None) -> jax.Array:
    """``y + bias`` in ``y``'s dtype (``y`` unchanged when ``bias`` is None)."""
    if bias is None:
        return y
    return y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + bias.shape)


class Embedding(eqx.Module):
    """Token embedding table ``(vocab, dim)``; ``attend`` gives tied-head logits."""

    weight: Float[Array, "vocab dim"]

    @classmethod
    def init(
        cls,
        vocab_size: int,
        dim: int,
        *,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> Embedding:
        return cls(std * jax.random.normal(key, (vocab_size, dim), dtype))

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab"]:
        """``x @ weight.T``: logits of a head tied to this embedding."""
        return linear(x, self.weight)


class RMSNorm(eqx.Module):
    """RMS normalisation with a learned scale; ``offset=1.0`` gives Gemma's ``(1 + weight)``."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True, default=1e-6)
    offset: float = eqx.field(static=True, default=0.0)

    @classmethod
    def init(
        cls, dim: int, *, eps: float = 1e-6, offset: float = 0.0, dtype: DTypeLike = jnp.float32
    ) -> RMSNorm:
        """Scale initialised so the layer starts as a plain normalisation."""
        return cls(jnp.full((dim,), 1.0 - offset, dtype), eps=eps, offset=offset)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        return rms_norm(x, self.weight, self.eps, offset=self.offset)


class LayerNorm(eqx.Module):
    """torch's ``LayerNorm`` over the last axis: ``weight`` (ones) and ``bias`` (zeros)."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    eps: float = eqx.field(static=True, default=1e-5)

    @classmethod
    def init(cls, dim: int, *, eps: float = 1e-5, dtype: DTypeLike = jnp.float32) -> LayerNorm:
        return cls(jnp.ones((dim,), dtype), jnp.zeros((dim,), dtype), eps=eps)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        return layer_norm(x, self.weight, self.bias, self.eps)
