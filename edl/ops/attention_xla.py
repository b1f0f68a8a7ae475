"""Plain-XLA attention with a hand-written backward pass (``jax.custom_vjp``).

The same maths as ``reference_attention`` arranged for speed where no Pallas kernel runs:
normalisation is applied to the ``(q, head_dim)`` output rather than the ``(q, kv)``
weights, and the backward pass recomputes the weights from the saved log-sum-exp instead of
storing them (memory ``O(q + kv)`` per head beyond the logits it recomputes), with the
standard softmax gradient ``dS = P * (dP - rowsum(dO * O))``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float

__all__ = []


def _logits(qg, k, scale: float, softcap: float | None):
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _forward(qg, k, v, mask, scale: float, softcap: float | None):
    s = jnp.where(mask, _logits(qg, k, scale, softcap), -jnp.inf)
    row_max = jnp.max(s, axis=-1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked rows
    p = jnp.exp(s - row_max[..., None])  # masked entries: exp(-inf) = 0
    row_sum = jnp.sum(p, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    inv = jnp.where(row_sum == 0, 0.0, 1.0 / jnp.where(row_sum == 0, 1.0, row_sum))
    out = out * jnp.moveaxis(inv, 3, 1)[..., None]  # (b, q, h, g, 1): rows with no key give 0
    lse = row_max + jnp.log(jnp.where(row_sum == 0, 1.0, row_sum))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(qg, k, v, mask, scale, softcap):
    out, _ = _forward(qg, k, v, mask, scale, softcap)
    return out.astype(qg.dtype)


def _attention_fwd(qg, k, v, mask, scale, softcap):
    out, lse = _forward(qg, k, v, mask, scale, softcap)
    out = out.astype(qg.dtype)
    return out, (qg, k, v, mask, out, lse)


def _attention_bwd(scale, softcap, residuals, d_out):
    qg, k, v, mask, out, lse = residuals
    s = _logits(qg, k, scale, softcap)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    d_out32 = d_out.astype(jnp.float32)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, d_out32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", d_out32, v, preferred_element_type=jnp.float32)
    delta = jnp.moveaxis(jnp.sum(d_out32 * out.astype(jnp.float32), axis=-1), 1, 3)
    ds = p * (dp - delta[..., None])
    if softcap is not None:
        ds = ds * (1.0 - jnp.square(s / softcap))  # d/dx c*tanh(x/c) = 1 - tanh^2
    ds = ds * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, preferred_element_type=jnp.float32)
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def xla_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "batch_or_1 q_len kv_len"],
    *,
    scale: float,
    softcap: float | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Attention of ``q`` over ``k``/``v`` where ``mask`` is True; GQA by grouping query heads
    (no repeated K/V). Float32 logits and accumulation; rows with no visible key give 0."""
    kv_heads = k.shape[2]
    qg = rearrange(q, "b q (kv g) d -> b q kv g d", kv=kv_heads)  # GQA: groups of heads
    out = _attention(qg, k, v, mask[:, None, None], scale, softcap)
    return rearrange(out, "b q kv g d -> b q (kv g) d")
