"""Normalisation as pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["rms_norm"]


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
