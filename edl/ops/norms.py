"""Normalisation as pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["layer_norm", "rms_norm"]


def rms_norm(
    x: Float[Array, "*batch dim"], weight: Float[Array, " wdim"], eps: float, *, offset: float = 0.0
) -> Float[Array, "*batch dim"]:
    """``(offset + weight) * x / sqrt(mean(x**2) + eps)``, normalised in float32.

    Follows transformers' rounding order: the normalised ``x`` is cast back to its dtype
    before the weight is applied (Llama); with ``offset=1.0`` the weight is applied in float32
    first (Gemma's ``(1 + weight)``).
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight shape {weight.shape} does not match x's last dim {x.shape[-1]}"
        )
    weight = weight.reshape((1,) * (x.ndim - 1) + weight.shape)  # explicit rank for broadcasting
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    out_dtype = jnp.promote_types(weight.dtype, x.dtype)  # as torch promotes weight * x
    return weight.astype(out_dtype) * normed.astype(x.dtype).astype(out_dtype)


def layer_norm(
    x: Float[Array, "*batch dim"],
    weight: Float[Array, " dim"] | None,
    bias: Float[Array, " dim"] | None,
    eps: float,
) -> Float[Array, "*batch dim"]:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (torch's
    ``LayerNorm``: biased variance, statistics and affine in float32, result in ``x``'s
    dtype). ``weight`` / ``bias`` ``None``: no affine part."""
    for name, w in (("weight", weight), ("bias", bias)):
        if w is not None and w.shape != x.shape[-1:]:
            raise ValueError(
                f"layer_norm: {name} shape {w.shape} does not match x's last dim {x.shape[-1]}"
            )
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    out = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    lead = (1,) * (x.ndim - 1)
    if weight is not None:
        out = out * weight.astype(jnp.float32).reshape(lead + weight.shape)
    if bias is not None:
        out = out + bias.astype(jnp.float32).reshape(lead + bias.shape)
    return out.astype(x.dtype)
