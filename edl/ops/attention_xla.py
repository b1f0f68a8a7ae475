"""Plain-XLA attention with a hand-written backward pass (``jax.custom_vjp``).

The same maths as ``reference_attention`` arranged for speed where no Pallas kernel runs:
normalisation is applied to the ``(q, head_dim)`` output rather than the ``(q, kv)``
weights, and the backward pass recomputes the weights from the saved log-sum-exp instead of
storing them (memory ``O(q + kv)`` per head beyond the logits it recomputes), with the
standard softmax gradient ``dS = P * (dP - rowsum(dO * O))``.

Attention sinks (GPT-OSS: one learned logit per head in every row's denominator) raise the
running max and the row sum; their gradient is ``-sum_q exp(sink - lse_q) * D_q`` per head
(``D = rowsum(dO * O)``): the sink is a key whose value is zero, so ``dP_sink = 0`` and
``dS_sink = P_sink * (0 - D)``, summed over the batch and the queries sharing the head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float

__all__ = []


def _acc(dtype) -> jnp.dtype:
    """The accumulation dtype: float32, float64 for float64 inputs (gradient checks)."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _logits(qg, k, scale: float, softcap: float | None):
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=_acc(qg.dtype)) * scale
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _sink(sinks, s):
    """``(kv, g)`` sinks as ``(1, kv, g, 1)``, in the logits' dtype (row statistics' shape)."""
    return sinks.astype(s.dtype)[None, :, :, None]


def _forward(qg, k, v, mask, sinks, scale: float, softcap: float | None):
    s = jnp.where(mask, _logits(qg, k, scale, softcap), -jnp.inf)
    row_max = jnp.max(s, axis=-1)
    if sinks is not None:
        row_max = jnp.maximum(row_max, _sink(sinks, s))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked rows
    p = jnp.exp(s - row_max[..., None])  # masked entries: exp(-inf) = 0
    row_sum = jnp.sum(p, axis=-1)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(_sink(sinks, s) - row_max)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=s.dtype)
    inv = jnp.where(row_sum == 0, 0.0, 1.0 / jnp.where(row_sum == 0, 1.0, row_sum))
    out = out * jnp.moveaxis(inv, 3, 1)[..., None]  # (b, q, h, g, 1): rows with no key give 0
    lse = row_max + jnp.log(jnp.where(row_sum == 0, 1.0, row_sum))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(qg, k, v, mask, sinks, scale, softcap):
    out, _ = _forward(qg, k, v, mask, sinks, scale, softcap)
    return out.astype(qg.dtype)


def _attention_fwd(qg, k, v, mask, sinks, scale, softcap):
    out, lse = _forward(qg, k, v, mask, sinks, scale, softcap)
    out = out.astype(qg.dtype)
    return out, (qg, k, v, mask, sinks, out, lse)


def _attention_bwd(scale, softcap, residuals, d_out):
    qg, k, v, mask, sinks, out, lse = residuals
    s = _logits(qg, k, scale, softcap)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    acc = _acc(qg.dtype)
    d_out32 = d_out.astype(acc)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, d_out32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", d_out32, v, preferred_element_type=acc)
    delta = jnp.moveaxis(jnp.sum(d_out32 * out.astype(acc), axis=-1), 1, 3)
    ds = p * (dp - delta[..., None])
    if softcap is not None:
        ds = ds * (1.0 - jnp.square(s / softcap))  # d/dx c*tanh(x/c) = 1 - tanh^2
    ds = ds * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=acc)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, preferred_element_type=acc)
    d_sinks = None
    if sinks is not None:  # see the module docstring
        p_sink = jnp.exp(_sink(sinks, lse) - lse)  # (b, kv, g, q)
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 3)).astype(sinks.dtype)
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def xla_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "batch_or_1 q_len kv_len"],
    *,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Attention of ``q`` over ``k``/``v`` where ``mask`` is True; GQA by grouping query heads
    (no repeated K/V). Float32 logits and accumulation; rows with no visible key give 0.
    ``sinks``: per-head logits in each row's denominator (module docstring)."""
    kv_heads = k.shape[2]
    qg = rearrange(q, "b q (kv g) d -> b q kv g d", kv=kv_heads)  # GQA: groups of heads
    grouped = None if sinks is None else sinks.reshape(kv_heads, -1)
    out = _attention(qg, k, v, mask[:, None, None], grouped, scale, softcap)
    return rearrange(out, "b q kv g d -> b q (kv g) d")
