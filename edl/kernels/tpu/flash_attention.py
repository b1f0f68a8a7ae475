"""Flash attention for TPU (Pallas/Mosaic): a forward kernel and dq, dk/dv backward kernels.

Same contract as the GPU kernel :func:`edl.kernels.flash_attention` and
:func:`edl.ops.attention.reference_attention`: layout of ``jax.nn.dot_product_attention``, GQA/MQA
without materialising repeated K/V (query head ``h`` reads kv head ``h // group`` through the
BlockSpec index maps; the dk/dv kernel accumulates a kv head's gradient over its query heads),
queries as the last ``q_len`` of ``kv_len`` positions (the causal diagonal aligned to the end),
left sliding windows, soft-capping, segment ids, float32 logits/softmax/accumulation with P
rounded to the input dtype before ``P @ V``. Rows that see no key give zero output and zero
gradients, never NaN.

Why not jax's splash attention: edl's contract differs from it (rows that see nothing give 0
with zero gradients; an end-aligned diagonal for ``q_len < kv_len``, windows included), and
one semantics is shared by the CPU, GPU and TPU kernels and checked against one float64
oracle.

Design (details in ``_flash_kernels``): arrays are transposed to head-major
``(batch, heads, seq, head_dim)`` and padded to whole blocks in XLA around the kernels;
each kernel's grid is (batch, head, block, streamed block) with the streamed axis innermost
and ``"arbitrary"``, its online-softmax or gradient state in VMEM scratch. Blocks hidden by
the causal diagonal or the window cost neither compute nor DMA. Per-row statistics are
lane-broadcast to 128 inside the kernels and kept as ``(batch, heads, q)`` residuals.

Block sizes are multiples of 128 (the lane width; the dk/dv kernel transposes its
``(block_q, block_k)`` tiles). The defaults are untuned on hardware: they are merely sized
to fit VMEM comfortably for head dims up to 256.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from edl.kernels._common import cdiv, pad_axis
from edl.kernels.tpu import _flash_kernels as kernels

__all__ = ["BlockSizes", "flash_attention"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Sequence tiles, each a positive multiple of 128.

    ``block_q``/``block_k``: query and K/V tiles of the forward kernel; ``block_q_bwd``/
    ``block_k_bwd``: of both backward kernels (dq, dk/dv). A tile longer than its (padded)
    sequence (rounded up to 128) is shortened. Untuned on hardware.
    """

    block_q: int = 256
    block_k: int = 512
    block_q_bwd: int = 256
    block_k_bwd: int = 256

    def __post_init__(self):
        for field in dataclasses.fields(self):
            size = getattr(self, field.name)
            if size <= 0 or size % kernels.LANES:
                msg = f"BlockSizes.{field.name} must be a positive multiple of 128, got {size}"
                raise ValueError(msg)


def _tiles(a: int, b: int, length: int) -> tuple[int, int, int]:
    """The forward and backward tiles used along a sequence of ``length``, and the length it
    is padded to (whole tiles of both). Short sequences pad little: the smaller tile is cut
    to the length rounded up to 128, the larger to the least multiple of it covering that."""
    rounded = cdiv(length, kernels.LANES) * kernels.LANES
    small = min(a, b, rounded)
    cap = cdiv(rounded, small) * small
    a, b = min(a, cap), min(b, cap)
    unit = math.lcm(a, b)
    return a, b, cdiv(length, unit) * unit


def _lane_rows(x: jax.Array) -> jax.Array:
    """``(..., rows) -> (..., rows, 128)``: the lane-broadcast layout of per-row values."""
    return jnp.broadcast_to(x[..., None], (*x.shape, kernels.LANES))


def _forward(q, k, v, q_ids, kv_ids, sinks, plan):
    """``(out, lse)`` (one lane of the log-sum-exp); with attention sinks, both rescaled
    around the unchanged kernel as in ``edl.kernels.flash_attention`` (natural log here;
    rows that saw no key keep lse +inf and zero output)."""
    out, lse = kernels.forward(q, k, v, q_ids, kv_ids, plan)
    lse = lse[..., 0]
    if sinks is None:
        return out, lse
    seen = jnp.isfinite(lse)
    total = jnp.where(seen, jnp.logaddexp(lse, _sink(sinks)), jnp.inf)
    rescale = jnp.where(seen, jnp.exp(jnp.where(seen, lse - total, 0.0)), 0.0)
    return (out.astype(jnp.float32) * rescale[..., None]).astype(out.dtype), total


def _sink(sinks):
    """``(heads,)`` sink logits shaped like the ``(batch, heads, q)`` rows, in float32."""
    return sinks.astype(jnp.float32)[None, :, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_ids, kv_ids, sinks, plan):
    return _forward(q, k, v, q_ids, kv_ids, sinks, plan)[0]


def _flash_fwd(q, k, v, q_ids, kv_ids, sinks, plan):
    out, lse = _forward(q, k, v, q_ids, kv_ids, sinks, plan)
    # Keep one lane of the log-sum-exp as the residual, not 128 copies of it.
    return out, (q, k, v, q_ids, kv_ids, sinks, out, lse)


def _flash_bwd(plan, residuals, d_out):
    q, k, v, q_ids, kv_ids, sinks, out, lse = residuals
    # delta_i = rowsum(dO_i * O_i): one cheap elementwise pass in XLA.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    args = (q, k, v, d_out, _lane_rows(lse), _lane_rows(delta), q_ids, kv_ids, plan)
    dq = kernels.backward_dq(*args)
    dk, dv = kernels.backward_dkdv(*args)
    d_sinks = None
    if sinks is not None:  # -sum_q P_sink * D (edl.kernels.flash_attention); empty rows: D = 0
        d_sinks = -jnp.sum(jnp.exp(_sink(sinks) - lse) * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, None, None, d_sinks


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check(q, k, v, q_segment_ids, kv_segment_ids, window) -> None:
    """Raise early, naming the problem."""
    same_batch_and_dim = k.ndim == 4 and (k.shape[0], k.shape[3]) == (q.shape[0], q.shape[3])
    if q.ndim != 4 or k.shape != v.shape or not same_batch_and_dim:
        raise ValueError(
            f"flash_attention: incompatible q {q.shape}, k {k.shape}, v {v.shape}; want "
            "(batch, len, heads, head_dim) with k and v alike"
        )
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(
            f"flash_attention: empty sequence (q_len {q.shape[1]}, kv_len {k.shape[1]})"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"flash_attention: {q.shape[2]} heads not a multiple of {k.shape[2]} kv heads"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(
            f"flash_attention: q/k/v must share one of float32/bfloat16, got "
            f"{q.dtype}/{k.dtype}/{v.dtype}"
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: pass both q_segment_ids and kv_segment_ids or neither")
    if q_segment_ids is not None and (
        q_segment_ids.shape != q.shape[:2] or kv_segment_ids.shape != k.shape[:2]
    ):
        raise ValueError(
            f"flash_attention: segment ids {q_segment_ids.shape}/"
            f"{kv_segment_ids.shape} must be (batch, q_len)/(batch, kv_len) = "
            f"{q.shape[:2]}/{k.shape[:2]}"
        )
    if window is not None and window <= 0:
        raise ValueError(f"flash_attention: window must be positive, got {window}")


def _plan(q, k, *, causal, window, softcap, scale, block_sizes, interpret) -> kernels.Plan:
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    blocks = block_sizes or BlockSizes()
    bq, bq_bwd, padded_q = _tiles(blocks.block_q, blocks.block_q_bwd, q_len)
    bk, bk_bwd, padded_kv = _tiles(blocks.block_k, blocks.block_k_bwd, kv_len)
    return kernels.Plan(
        causal=causal or window is not None,
        window=window,
        softcap=None if softcap is None else float(softcap),
        scale=head_dim**-0.5 if scale is None else float(scale),
        q_len=q_len,
        kv_len=kv_len,
        padded_q=padded_q,
        padded_kv=padded_kv,
        block_q=bq,
        block_k=bk,
        block_q_bwd=bq_bwd,
        block_k_bwd=bk_bwd,
        interpret=interpret,
    )


def _head_major(x: jax.Array, length: int) -> jax.Array:
    """``(batch, len, heads, d) -> (batch, heads, length, d)``, zero-padded along len."""
    return pad_axis(jnp.swapaxes(x, 1, 2), 2, length)


def flash_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    *,
    causal: bool = False,
    q_segment_ids: Int[Array, "batch q_len"] | None = None,
    kv_segment_ids: Int[Array, "batch kv_len"] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Flash attention on TPU (Mosaic), differentiable in q, k, v by Pallas backward kernels.

    Args:
        q: ``(batch, q_len, heads, head_dim)``, float32 or bfloat16.
        k, v: ``(batch, kv_len, kv_heads, head_dim)``, q's dtype; ``heads % kv_heads == 0``.
        causal: mask future keys; query ``i`` sits at kv position ``i + kv_len - q_len``.
        q_segment_ids, kv_segment_ids: ``(batch, q_len)``/``(batch, kv_len)`` int ids (both
            or neither): a query sees only keys with its id.
        window: left sliding window (position ``p`` sees keys ``p - window < j <= p``);
            implies causal.
        softcap: logits become ``softcap * tanh(logits / softcap)`` (after ``scale``).
        scale: logit scale, default ``head_dim ** -0.5``.
        sinks: attention sinks ``(heads,)`` (GPT-OSS): one logit per query head in each row's
            denominator, applied around the kernels (``_forward``); differentiable.
        block_sizes: tiles (multiples of 128); default :class:`BlockSizes`.
        interpret: False compiles for TPU; True or a ``pltpu.InterpretParams`` runs Pallas'
            interpreter (the latter simulating TPU memory spaces and DMAs).

    Returns:
        ``(batch, q_len, heads, head_dim)`` in q's dtype; rows that see no key are zero.
    """
    _check(q, k, v, q_segment_ids, kv_segment_ids, window)
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(f"flash_attention: sinks must be ({q.shape[2]},), got {sinks.shape}")
    plan = _plan(
        q,
        k,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    q_ids = kv_ids = None
    if q_segment_ids is not None:
        batch = q.shape[0]
        q_ids = pad_axis(q_segment_ids.astype(jnp.int32), 1, plan.padded_q)
        kv_ids = pad_axis(kv_segment_ids.astype(jnp.int32), 1, plan.padded_kv)
        q_ids = _lane_rows(q_ids)  # (batch, padded_q, 128)
        kv_ids = jnp.broadcast_to(kv_ids[:, None, :], (batch, kernels.SUBLANES, plan.padded_kv))
    out = _flash(
        _head_major(q, plan.padded_q),
        _head_major(k, plan.padded_kv),
        _head_major(v, plan.padded_kv),
        q_ids,
        kv_ids,
        sinks,
        plan,
    )
    return jnp.swapaxes(out[:, :, : plan.q_len], 1, 2)
