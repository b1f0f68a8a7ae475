"""Flash attention in Pallas: forward, and a backward pass of dq and dk/dv kernels.

Layout as ``jax.nn.dot_product_attention``: q ``(batch, q_len, heads, head_dim)``, k/v
``(batch, kv_len, kv_heads, head_dim)``. Each forward program owns one ``(batch, head,
q-block)`` and streams K/V blocks of its kv head through an online softmax (FlashAttention-2),
in base 2 (``exp2``) with float32 accumulation, writing the output and the per-row
log-sum-exp. Query heads index their shared K/V head through the BlockSpec, so GQA/MQA never
materialise repeated K/V; the dk/dv program of a kv head loops over its query heads.

Only the K/V (resp. Q) blocks that the causal diagonal and the sliding window leave visible
are visited. Queries are the last ``q_len`` of ``kv_len`` positions (HF's alignment when
``q_len < kv_len``). Sequences are zero-padded to whole blocks and padded keys masked; rows
that see no key produce zeros (and zero gradients), never NaN.

Attention sinks (GPT-OSS: one logit per query head in every row's denominator, no value)
change only each row's normalisation, so the kernels run unchanged and the sinks enter
around them (:func:`_with_sinks`): the forward's output is rescaled by ``2^(lse -
lse')`` with ``lse' = log2(2^lse + 2^(sink * log2 e))``, and the backward kernels get
``lse'`` and the rescaled output (their ``P = 2^(s - lse')`` and ``D = rowsum(dO * O)`` are
then those of the softmax with the sink). The sink's gradient is ``-sum_q P_sink,q * D_q``
per head, ``P_sink = 2^(sink * log2 e - lse')``: the sink is a key of value zero, so its
``dP`` is 0 and its ``dS = P_sink * (0 - D)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from edl.kernels._common import (
    KERNEL_DTYPES,
    LOG2E,
    by_interpret,
    cdiv,
    compiler_params,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_axis,
    padded_head_dim,
    scores,
    seq_block,
    visible,
)

__all__ = ["BlockSizes", "flash_attention"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch settings of the forward and backward kernels.

    ``block_q``/``block_k`` tile the forward pass; ``block_q_bwd``/``block_k_bwd`` both
    backward kernels. ``num_warps``/``num_stages`` only matter on GPU (None: Triton's own
    default).
    """

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None


def default_block_sizes(head_dim: int, dtype, *, interpret: bool) -> BlockSizes:
    """Block sizes for ``head_dim``/``dtype`` on the current kind of device.

    Interpret mode (CPU) wants few, large blocks: every grid step and K/V block is one
    iteration of an XLA loop, and the per-iteration cost dwarfs the arithmetic of a small
    tile. On GPU the tiles must fit shared memory: 128x64 forward tiles up to head_dim 128
    in 16-bit types, halved for head_dim 256 or float32.
    """
    if interpret:
        return BlockSizes(block_q=512, block_k=512, block_q_bwd=512, block_k_bwd=512)
    wide = head_dim > 128 or jnp.dtype(dtype).itemsize > 2
    if wide:
        return BlockSizes(
            64, 32, 32, 32, num_warps=4, num_stages=2, num_warps_bwd=4, num_stages_bwd=2
        )
    return BlockSizes(
        128,
        64,
        64,
        64,
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=3,
        num_warps_bwd=4,
        num_stages_bwd=2,
    )


@dataclasses.dataclass(frozen=True)
class _FlashPlan:
    """Everything static about one call: hashable, so it can key ``custom_vjp``."""

    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    q_len: int  # true (unpadded) lengths
    kv_len: int
    padded_q: int  # lengths padded to whole blocks of both passes
    padded_kv: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    blocks: BlockSizes
    interpret: bool

    @property
    def offset(self) -> int:
        """kv position of query 0: the causal diagonal is aligned to the end."""
        return self.kv_len - self.q_len

    @property
    def key_padding(self) -> int | None:
        """Keys at or beyond this position are padding (None: there are none)."""
        return self.kv_len if self.padded_kv > self.kv_len else None


def _div(a, b: int):
    """Integer division of a non-negative traced int32 scalar by a static ``b``."""
    return jax.lax.div(a, jnp.int32(b))


def _kv_block_range(first_q, last_q, plan: _FlashPlan, block_k: int, num_k_blocks: int):
    """K/V blocks ``[lo, hi)`` holding any key visible to queries at kv positions
    ``first_q..last_q`` (traced scalars)."""
    lo, hi = 0, num_k_blocks
    if plan.causal or plan.window is not None:
        hi = jnp.minimum(hi, _div(jnp.maximum(last_q + 1, 0) + block_k - 1, block_k))
    if plan.window is not None:
        lo = _div(jnp.maximum(first_q - plan.window + 1, 0), block_k)
    return lo, hi


def _q_block_range(first_k, last_k, plan: _FlashPlan, block_q: int, num_q_blocks: int):
    """Query blocks ``[lo, hi)`` holding any query that sees a key at kv positions
    ``first_k..last_k`` (traced scalars; query ``i`` sits at position ``i + offset``)."""
    lo, hi = 0, num_q_blocks
    if plan.causal or plan.window is not None:
        lo = _div(jnp.maximum(first_k - plan.offset, 0), block_q)
    if plan.window is not None:
        last_q = last_k + plan.window - 1 - plan.offset  # last query index that sees last_k
        hi = jnp.minimum(hi, _div(jnp.maximum(last_q + 1, 0) + block_q - 1, block_q))
    return lo, hi


def _unpack(refs, n_in: int, has_segments: bool):
    """Split kernel refs into (inputs, q_seg_ref, kv_seg_ref, outputs)."""
    inputs, rest = refs[:n_in], refs[n_in:]
    if has_segments:
        return inputs, rest[0], rest[1], rest[2:]
    return inputs, None, None, rest


def _query_block(plan: _FlashPlan, qs_ref, block_q: int, block_k: int):
    """This program's query block: kv positions, segment ids, and the K/V blocks to visit."""
    i = pl.program_id(2)
    first = i * block_q + plan.offset
    q_pos = first + jnp.arange(block_q)
    q_seg = None if qs_ref is None else qs_ref[...]
    lo, hi = _kv_block_range(first, first + block_q - 1, plan, block_k, plan.padded_kv // block_k)
    return q_pos, q_seg, lo, hi


def _key_block_mask(plan: _FlashPlan, q_pos, q_seg, ks_ref, j, block_k: int):
    """Visibility of K/V block ``j`` (keys) to the query block at ``q_pos``."""
    keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    mask = visible(
        q_pos,
        j * block_k + jnp.arange(block_k),
        causal=plan.causal,
        window=plan.window,
        kv_len=plan.key_padding,
        q_seg=q_seg,
        kv_seg=None if ks_ref is None else ks_ref[keys],
    )
    return keys, mask


def _forward_kernel(*refs, plan: _FlashPlan, has_segments: bool):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref) = _unpack(refs, 3, has_segments)
    block_q, block_k = plan.block_q, plan.block_k
    q = q_ref[...]
    q_pos, q_seg, lo, hi = _query_block(plan, qs_ref, block_q, block_k)

    def body(j, carry):
        keys, mask = _key_block_mask(plan, q_pos, q_seg, ks_ref, j, block_k)
        s, _ = scores(q, k_ref[keys, :], scale=plan.scale, softcap=plan.softcap)
        s = s * LOG2E if mask is None else jnp.where(mask, s * LOG2E, -jnp.inf)
        return online_softmax_step(carry, s, v_ref[keys, :])

    carry = jax.lax.fori_loop(lo, hi, body, online_softmax_init(block_q, q.shape[1]))
    # Rows that saw nothing get lse 0: the backward pass masks all their keys anyway.
    out, lse = online_softmax_finish(carry, empty_lse=0.0)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _probs_and_dscores(q, k, v, do, lse, delta, mask, plan: _FlashPlan):
    """Recompute ``P`` from the saved log-sum-exp and the gradient w.r.t. the pre-scale
    logits ``dS`` (through the soft-cap); the caller applies ``scale``."""
    s, tanh = scores(q, k, scale=plan.scale, softcap=plan.softcap)
    p = jnp.exp2(s * LOG2E - lse[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)  # d/dx c*tanh(x/c) = 1 - tanh^2
    return p, ds


def _dq_kernel(*refs, plan: _FlashPlan, has_segments: bool):
    inputs, qs_ref, ks_ref, (dq_ref,) = _unpack(refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    block_q, block_k = plan.block_q_bwd, plan.block_k_bwd
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos, q_seg, lo, hi = _query_block(plan, qs_ref, block_q, block_k)

    def body(j, dq):
        keys, mask = _key_block_mask(plan, q_pos, q_seg, ks_ref, j, block_k)
        k = k_ref[keys, :]
        _, ds = _probs_and_dscores(q, k, v_ref[keys, :], do, lse, delta, mask, plan)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, plan: _FlashPlan, has_segments: bool):
    inputs, qs_ref, ks_ref, (dk_ref, dv_ref) = _unpack(refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs  # q/do/lse/delta: whole group
    block_q, block_k = plan.block_q_bwd, plan.block_k_bwd
    group, padded_q = q_ref.shape[1], q_ref.shape[0]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * block_k + jnp.arange(block_k)
    kv_seg = None if ks_ref is None else ks_ref[...]
    lo, hi = _q_block_range(
        j * block_k, j * block_k + block_k - 1, plan, block_q, padded_q // block_q
    )
    contract_rows = (((0,), (0,)), ((), ()))

    # Padded query rows need no mask: their dO (hence dS and P^T dO) is zero.
    def q_block(i, carry, g):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]
        mask = visible(
            i * block_q + jnp.arange(block_q) + plan.offset,
            k_pos,
            causal=plan.causal,
            window=plan.window,
            kv_len=plan.key_padding,
            q_seg=None if qs_ref is None else qs_ref[rows],
            kv_seg=kv_seg,
        )
        p, ds = _probs_and_dscores(q, k, v, do, lse_ref[g, rows], delta_ref[g, rows], mask, plan)
        dv = dv + jax.lax.dot_general(
            p.astype(do.dtype), do, contract_rows, preferred_element_type=jnp.float32
        )
        dk = dk + jax.lax.dot_general(
            ds.astype(q.dtype), q, contract_rows, preferred_element_type=jnp.float32
        )
        return dk, dv

    def head(g, carry):
        return jax.lax.fori_loop(lo, hi, functools.partial(q_block, g=g), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _segment_spec(length: int, *, blocked: bool) -> pl.BlockSpec:
    """Segment ids ``(batch, len)``: one block per grid step, or the whole row."""
    if blocked:
        return pl.BlockSpec((None, length), lambda b, h, i: (b, i))
    return pl.BlockSpec((None, length), lambda b, h, i: (b, 0))


def _forward_call(q, k, v, q_seg, kv_seg, plan: _FlashPlan):
    batch, padded_q, heads, dim = q.shape
    padded_kv, kv_heads = k.shape[1], k.shape[2]
    group, bq = heads // kv_heads, plan.block_q
    seg_args, seg_specs = [], []
    if q_seg is not None:
        seg_args = [q_seg, kv_seg]
        seg_specs = [_segment_spec(bq, blocked=True), _segment_spec(padded_kv, blocked=False)]
    q_spec = pl.BlockSpec((None, bq, None, dim), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, padded_kv, None, dim), lambda b, h, i: (b, 0, h // group, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan, has_segments=q_seg is not None),
        grid=(batch, heads, padded_q // bq),
        in_specs=[q_spec, kv_spec, kv_spec, *seg_specs],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, padded_q), jnp.float32),
        ],
        compiler_params=compiler_params(plan.blocks.num_warps, plan.blocks.num_stages),
        interpret=plan.interpret,
        name="edl_flash_attention_fwd",
    )(q, k, v, *seg_args)


def _dq_call(q, k, v, d_out, lse, delta, q_seg, kv_seg, plan: _FlashPlan):
    batch, padded_q, heads, dim = q.shape
    padded_kv, kv_heads = k.shape[1], k.shape[2]
    group, bq = heads // kv_heads, plan.block_q_bwd
    q_spec = pl.BlockSpec((None, bq, None, dim), lambda b, h, i: (b, i, h, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    kv_full = pl.BlockSpec((None, padded_kv, None, dim), lambda b, h, i: (b, 0, h // group, 0))
    seg_args, seg_specs = [], []
    if q_seg is not None:
        seg_args = [q_seg, kv_seg]
        seg_specs = [_segment_spec(bq, blocked=True), _segment_spec(padded_kv, blocked=False)]
    return pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan, has_segments=q_seg is not None),
        grid=(batch, heads, padded_q // bq),
        in_specs=[q_spec, kv_full, kv_full, q_spec, row_spec, row_spec, *seg_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(plan.blocks.num_warps_bwd, plan.blocks.num_stages_bwd),
        interpret=plan.interpret,
        name="edl_flash_attention_dq",
    )(q, k, v, d_out, lse, delta, *seg_args)


def _dkdv_call(q, k, v, d_out, lse, delta, q_seg, kv_seg, plan: _FlashPlan):
    batch, padded_q, heads, dim = q.shape
    padded_kv, kv_heads = k.shape[1], k.shape[2]
    group, bk = heads // kv_heads, plan.block_k_bwd
    group_spec = pl.BlockSpec((None, padded_q, group, dim), lambda b, h, j: (b, 0, h, 0))
    group_rows = pl.BlockSpec((None, group, padded_q), lambda b, h, j: (b, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, dim), lambda b, h, j: (b, j, h, 0))
    seg_args, seg_specs = [], []
    if q_seg is not None:
        seg_args = [q_seg, kv_seg]
        seg_specs = [_segment_spec(padded_q, blocked=False), _segment_spec(bk, blocked=True)]
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, plan=plan, has_segments=q_seg is not None),
        grid=(batch, kv_heads, padded_kv // bk),
        in_specs=[group_spec, kv_block, kv_block, group_spec, group_rows, group_rows, *seg_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params(plan.blocks.num_warps_bwd, plan.blocks.num_stages_bwd),
        interpret=plan.interpret,
        name="edl_flash_attention_dkdv",
    )(q, k, v, d_out, lse, delta, *seg_args)


def _launch(call, plan: _FlashPlan, kv_heads: int, *args):
    """``call(*args, plan)``; in interpret mode once per (batch row, kv head) via ``lax.map``.

    Pallas' interpreter carries every input through its loop over the grid and copies each
    whole input array on every grid step, so one call over the full batch costs
    O(grid steps x array size). Per-kv-head calls keep both factors small; the arrays are
    regrouped to ``(batch * kv_heads, 1, ...)`` and back (one transpose each).
    """
    batch = args[0].shape[0]
    if not plan.interpret or batch * kv_heads == 1:
        return call(*args, plan)

    def split(x):
        if x is None:
            return None
        if x.ndim == 4:  # (b, s, heads, d), heads = kv_heads * g
            b, s, h, d = x.shape
            x = x.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 1, 3, 4)
            return x.reshape(b * kv_heads, 1, s, h // kv_heads, d)
        if x.ndim == 3:  # per-row statistics (b, heads, s)
            return x.reshape(batch * kv_heads, 1, x.shape[1] // kv_heads, x.shape[2])
        return jnp.repeat(x, kv_heads, axis=0)[:, None]  # segment ids (b, s)

    def merge(x):
        if x.ndim == 5:
            _, _, s, g, d = x.shape
            x = x.reshape(batch, kv_heads, s, g, d).transpose(0, 2, 1, 3, 4)
            return x.reshape(batch, s, kv_heads * g, d)
        return x.reshape(batch, kv_heads * x.shape[2], x.shape[3])

    outs = jax.lax.map(lambda xs: call(*xs, plan), tuple(split(a) for a in args))
    return jax.tree.map(merge, outs)


def _forward(q, k, v, q_seg, kv_seg, plan: _FlashPlan, sinks=None):
    out, lse = _launch(_forward_call, plan, k.shape[2], q, k, v, q_seg, kv_seg)
    if sinks is None:
        return out, lse
    return _with_sinks(out, lse, sinks)


def _sink_lse(sinks: Float[Array, " heads"]) -> Float[Array, "1 heads 1"]:
    """The sinks in the kernels' base-2 log units, shaped like their ``(b, h, q)`` rows."""
    return (sinks.astype(jnp.float32) * LOG2E)[None, :, None]


def _with_sinks(out, lse, sinks):
    """``(out, lse)`` of the softmax without sinks -> with them (module docstring). Rows that
    saw no key keep their zero output."""
    total = jnp.logaddexp2(lse, _sink_lse(sinks))
    rescale = jnp.exp2(lse - total).transpose(0, 2, 1)[..., None]  # (b, q, h, 1)
    return (out.astype(jnp.float32) * rescale).astype(out.dtype), total


def _backward(q, k, v, q_seg, kv_seg, out, lse, d_out, plan: _FlashPlan):
    # delta_i = rowsum(dO_i * O_i): one cheap elementwise pass, (batch, heads, q_len).
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    args = (q, k, v, d_out, lse, delta, q_seg, kv_seg)
    dq = _launch(_dq_call, plan, k.shape[2], *args)
    dk, dv = _launch(_dkdv_call, plan, k.shape[2], *args)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, sinks, plan):
    return _forward(q, k, v, q_seg, kv_seg, plan, sinks)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, sinks, plan):
    out, lse = _forward(q, k, v, q_seg, kv_seg, plan, sinks)
    return out, (q, k, v, q_seg, kv_seg, sinks, out, lse)


def _flash_bwd(plan, residuals, d_out):
    q, k, v, q_seg, kv_seg, sinks, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, out, lse, d_out, plan)
    d_sinks = None
    if sinks is not None:  # module docstring; padded query rows have dO = 0, hence D = 0
        delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
        p_sink = jnp.exp2(_sink_lse(sinks) - lse)
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, None, None, d_sinks


_flash.defvjp(_flash_fwd, _flash_bwd)


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
    interpret: bool | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Flash attention (Pallas) with a Pallas backward pass; see the module docstring.

    Args:
        q, k, v: float32/bfloat16/float16, all one dtype; ``heads % kv_heads == 0``.
        causal: mask future keys (diagonal aligned to the end when ``q_len != kv_len``).
        q_segment_ids, kv_segment_ids: packed sequences, a query sees only keys with its id.
        window: left sliding window (query at ``i`` sees keys ``i - window < j <= i``);
            implies causal.
        softcap: logits become ``softcap * tanh(logits / softcap)`` (after ``scale``).
        scale: logit scale, default ``1/sqrt(head_dim)``.
        sinks: attention sinks, one logit per query head in each row's denominator
            (differentiable; module docstring).
        block_sizes: tiles and Triton settings; default :func:`default_block_sizes`.
        interpret: run the kernels with ``interpret=True``; default: by the platform the
            program is lowered for, compiled through Triton on GPUs, interpreted elsewhere.
    """
    batch, _, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"flash_attention: incompatible q {q.shape}, k {k.shape}, v {v.shape}")
    if heads % kv_heads:
        raise ValueError(f"flash_attention: {heads} heads not a multiple of {kv_heads} kv heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"flash_attention: q/k/v must share one of float32/bfloat16/float16, got "
            f"{q.dtype}/{k.dtype}/{v.dtype}"
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: pass both q_segment_ids and kv_segment_ids or neither")
    if window is not None and window <= 0:
        raise ValueError(f"flash_attention: window must be positive, got {window}")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"flash_attention: sinks must be ({heads},), got {sinks.shape}")
    q_ids = kv_ids = None
    if q_segment_ids is not None:
        q_ids, kv_ids = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    kernel = functools.partial(
        _padded_call,
        causal=causal or window is not None,
        window=window,
        softcap=softcap,
        scale=head_dim**-0.5 if scale is None else float(scale),
        block_sizes=block_sizes,
    )
    return by_interpret(kernel, interpret, q, k, v, q_ids, kv_ids, sinks)


def _padded_call(
    q, k, v, q_ids, kv_ids, sinks, *, causal, window, softcap, scale, block_sizes, interpret: bool
):
    """The kernels on inputs padded to whole blocks (for ``interpret`` or Triton), sliced back."""
    q_len, head_dim = q.shape[1], q.shape[3]
    kv_len = k.shape[1]
    blocks = block_sizes or default_block_sizes(head_dim, q.dtype, interpret=interpret)
    bq, bk = (
        seq_block(blocks.block_q, q_len, interpret),
        seq_block(blocks.block_k, kv_len, interpret),
    )
    bq_bwd = seq_block(blocks.block_q_bwd, q_len, interpret)
    bk_bwd = seq_block(blocks.block_k_bwd, kv_len, interpret)
    padded_q = cdiv(q_len, math.lcm(bq, bq_bwd)) * math.lcm(bq, bq_bwd)
    padded_kv = cdiv(kv_len, math.lcm(bk, bk_bwd)) * math.lcm(bk, bk_bwd)
    plan = _FlashPlan(
        causal=causal,
        window=window,
        softcap=None if softcap is None else float(softcap),
        scale=scale,
        q_len=q_len,
        kv_len=kv_len,
        padded_q=padded_q,
        padded_kv=padded_kv,
        block_q=bq,
        block_k=bk,
        block_q_bwd=bq_bwd,
        block_k_bwd=bk_bwd,
        blocks=blocks,
        interpret=interpret,
    )
    dim = padded_head_dim(head_dim, interpret)
    q_p = pad_axis(pad_axis(q, 1, padded_q), 3, dim)
    k_p = pad_axis(pad_axis(k, 1, padded_kv), 3, dim)
    v_p = pad_axis(pad_axis(v, 1, padded_kv), 3, dim)
    q_seg = kv_seg = None
    if q_ids is not None:
        q_seg, kv_seg = pad_axis(q_ids, 1, padded_q), pad_axis(kv_ids, 1, padded_kv)
    out = _flash(q_p, k_p, v_p, q_seg, kv_seg, sinks, plan)
    return out[:, :q_len, :, :head_dim]
