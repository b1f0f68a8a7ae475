"""The Mosaic kernels behind :mod:`edl.kernels.tpu.flash_attention`: forward, dq and dk/dv.

Every kernel sees head-major, block-padded arrays: q/dO/O ``(batch, heads, padded_q, d)``,
k/v ``(batch, kv_heads, padded_kv, d)``. Per-row statistics (log-sum-exp, delta) and query
segment ids are lane-broadcast ``(batch, [heads,] padded_q, 128)`` and key segment ids
sublane-broadcast ``(batch, 8, padded_kv)``: the layouts Mosaic tiles as (8, 128) vregs
(1-D blocks and (1, n) blocks are not). The innermost grid axis streams the blocks of the
other sequence (``"arbitrary"``) through float32 VMEM accumulators that are initialised at
its first step and written out at its last.

Blocks the causal diagonal / window hide are skipped twice over: ``pl.when`` runs no compute
for them, and the index maps clamp their block index into the visible range, so the pipeline
sees the block index of a neighbouring step and issues no DMA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call: hashable, so it can key ``custom_vjp``."""

    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    q_len: int  # true (unpadded) lengths
    kv_len: int
    padded_q: int  # padded to whole blocks of every kernel
    padded_kv: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    interpret: bool | pltpu.InterpretParams

    @property
    def offset(self) -> int:
        """kv position of query 0: the causal diagonal is aligned to the end."""
        return self.kv_len - self.q_len


def _div(a, b: int):
    """Truncating division of a traced int32 scalar (non-negative here) by a static ``b``."""
    return jax.lax.div(a, jnp.int32(b))


def _ceil_div(a, b: int):
    return _div(jnp.maximum(a, 0) + (b - 1), b)


def kv_range(plan: Plan, i, block_q: int, block_k: int):
    """K/V blocks ``[lo, hi)`` holding a key that query block ``i`` sees (traced scalars)."""
    first = i * block_q + plan.offset  # kv positions of the block's first and last query
    last = first + (block_q - 1)
    lo, hi = jnp.int32(0), jnp.int32(-(-plan.kv_len // block_k))  # all-padding blocks: never
    if plan.causal:
        hi = jnp.minimum(hi, _ceil_div(last + 1, block_k))
    if plan.window is not None:
        lo = _div(jnp.maximum(first - plan.window + 1, 0), block_k)
    return lo, hi


def q_range(plan: Plan, j, block_q: int, block_k: int):
    """Query blocks ``[lo, hi)`` holding a query that sees a key of K/V block ``j``."""
    first = j * block_k  # the block's first and last key
    last = first + (block_k - 1)
    lo, hi = jnp.int32(0), jnp.int32(-(-plan.q_len // block_q))  # all-padding blocks: never
    hi = jnp.where(first < plan.kv_len, hi, 0)  # an all-padding K/V block is seen by none
    if plan.causal:
        lo = _div(jnp.maximum(first - plan.offset, 0), block_q)
    if plan.window is not None:  # the last query index that sees key `last`
        hi = jnp.minimum(hi, _ceil_div(last + plan.window - plan.offset, block_q))
    return lo, hi


def clamp_block(idx, lo, hi, num_blocks: int):
    """``idx`` clamped into ``[lo, hi)`` (and the array): a hidden step repeats the block
    index of the nearest visible one, so the pipeline fetches nothing for it."""
    idx = jnp.minimum(jnp.maximum(idx, lo), jnp.maximum(hi - 1, lo))
    return jnp.minimum(idx, num_blocks - 1)


def lanes(x: jax.Array, n: int) -> jax.Array:
    """Lane-broadcast ``(rows, 128)`` statistics widened (or cut) to ``(rows, n)``."""
    if n == LANES:
        return x
    return jnp.tile(x, (1, -(-n // LANES)))[:, :n]


def logits(q: jax.Array, k: jax.Array, plan: Plan):
    """``(rows, keys)`` float32 logits ``q @ k.T * scale``, soft-capped when asked, and the
    ``tanh`` the soft-cap gradient needs (None without soft-capping)."""
    s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
    if plan.softcap is None:
        return s * jnp.float32(plan.scale), None
    t = jnp.tanh(s * jnp.float32(plan.scale / plan.softcap))
    return t * jnp.float32(plan.softcap), t


def visible(plan: Plan, i, j, block_q: int, block_k: int, seg_refs):
    """``(block_q, block_k)`` mask of the keys of K/V block ``j`` visible to the queries of
    query block ``i`` (None when all are), from 2-D iotas (Mosaic has no 1-D iota)."""
    shape = (block_q, block_k)
    rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + (i * block_q + plan.offset)
    cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + j * block_k
    terms = []
    if plan.padded_kv > plan.kv_len:
        terms.append(cols < plan.kv_len)
    if plan.causal:
        terms.append(cols <= rows)
    if plan.window is not None:
        terms.append(rows - cols < plan.window)
    if seg_refs is not None:
        q_ids_ref, kv_ids_ref = seg_refs
        q_ids = jnp.tile(q_ids_ref[...], (1, block_k // LANES))  # (block_q, block_k)
        terms.append(q_ids == kv_ids_ref[:1, :])  # against (1, block_k)
    return functools.reduce(jnp.logical_and, terms) if terms else None


def _split_refs(refs, n_in: int, has_segments: bool):
    """Kernel refs -> (inputs, segment-id refs or None, outputs and scratch)."""
    if has_segments:
        return refs[:n_in], refs[n_in : n_in + 2], refs[n_in + 2 :]
    return refs[:n_in], None, refs[n_in:]


def _forward_kernel(*refs, plan: Plan, has_segments: bool):
    (q_ref, k_ref, v_ref), seg_refs, rest = _split_refs(refs, 3, has_segments)
    o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    bq, bk = plan.block_q, plan.block_k
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    lo, hi = kv_range(plan, i, bq, bk)

    @pl.when((j >= lo) & (j < hi))
    def _step():
        v = v_ref[...]
        s, _ = logits(q_ref[...], k_ref[...], plan)
        mask = visible(plan, i, j, bq, bk, seg_refs)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        m_prev, l_prev = m_ref[...], l_ref[...]  # (bq, 128), lane-broadcast
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # Rows with no visible key so far keep m = -inf; exponents against 0 then give 0,
        # not the NaN of -inf - -inf.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - lanes(m_safe, bk))
        alpha = jnp.exp(m_prev - m_safe)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * lanes(alpha, v.shape[1]) + pv

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        total = l_ref[...]
        seen = total > 0.0  # rows that saw no key: zero output, lse +inf (P = 0 in backward)
        safe_total = jnp.where(seen, total, 1.0)
        inv = jnp.where(seen, 1.0 / safe_total, 0.0)
        o_ref[...] = (acc_ref[...] * lanes(inv, acc_ref.shape[1])).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(safe_total), jnp.inf)


def _probs_and_dscores(plan: Plan, q, k, v, do, lse, delta, mask):
    """Recompute ``P`` from the saved log-sum-exp, and the gradient ``dS`` w.r.t. the scaled
    logits before the soft-cap (the caller applies ``scale``); both ``(rows, keys)``."""
    block_k = k.shape[0]
    s, tanh = logits(q, k, plan)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p = jnp.exp(s - lanes(lse, block_k))  # masked keys, and rows with lse = +inf: 0
    dp = jax.lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    ds = p * (dp - lanes(delta, block_k))
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)  # d/dx c*tanh(x/c) = 1 - tanh^2
    return p, ds


def _dq_kernel(*refs, plan: Plan, has_segments: bool):
    inputs, seg_refs, (dq_ref, acc_ref) = _split_refs(refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.block_q_bwd, plan.block_k_bwd
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    lo, hi = kv_range(plan, i, bq, bk)

    @pl.when((j >= lo) & (j < hi))
    def _step():
        k, mask = k_ref[...], visible(plan, i, j, bq, bk, seg_refs)
        _, ds = _probs_and_dscores(
            plan, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask
        )
        acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * jnp.float32(plan.scale)).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, plan: Plan, has_segments: bool, num_q_blocks: int):
    inputs, seg_refs, (dk_ref, dv_ref, dk_acc, dv_acc) = _split_refs(refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.block_q_bwd, plan.block_k_bwd
    j, t = pl.program_id(2), pl.program_id(3)  # t: (query head in the group, query block)
    i = jax.lax.rem(t, jnp.int32(num_q_blocks))

    @pl.when(t == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    lo, hi = q_range(plan, j, bq, bk)

    @pl.when((i >= lo) & (i < hi))
    def _step():
        q, do, mask = q_ref[...], do_ref[...], visible(plan, i, j, bq, bk, seg_refs)
        p, ds = _probs_and_dscores(
            plan, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask
        )
        # Explicit 2-D transposes (as jax's TPU kernels do) rather than a transposed-LHS dot.
        dv_acc[...] += jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dk_acc[...] += jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * jnp.float32(plan.scale)).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _params(*semantics: str) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _segment_args(q_ids, kv_ids, block_q: int, block_k: int, q_index, kv_index):
    """Segment-id operands and specs (none without ids); ``q_index``/``kv_index`` map the
    grid to the (batch, head, block, 0) index of the q and K/V blocks."""
    if q_ids is None:
        return [], []
    specs = [
        pl.BlockSpec((None, block_q, LANES), lambda *g: (q_index(*g)[0], q_index(*g)[2], 0)),
        pl.BlockSpec((None, SUBLANES, block_k), lambda *g: (kv_index(*g)[0], 0, kv_index(*g)[2])),
    ]
    return [q_ids, kv_ids], specs


def _clamped_kv_index(plan: Plan, group: int, block_q: int, block_k: int):
    """Index map of the K/V blocks of a (batch, head, query block, K/V block) grid."""

    def index(b, h, i, j):
        lo, hi = kv_range(plan, i, block_q, block_k)
        return b, _div(h, group), clamp_block(j, lo, hi, plan.padded_kv // block_k), 0

    return index


def _by_query_block(kernel, name: str, plan: Plan, blocks, inputs, segments, outs, scratch):
    """A kernel over the grid (batch, head, query block, K/V block): the forward and dq.
    ``inputs``: q, k, v, then per-query-row operands (dO, lse, delta); ``blocks``: the
    (query, K/V) tiles; ``segments``: the id arrays or None; ``scratch``: float32 shapes."""
    (q, k, *_), (block_q, block_k) = inputs, blocks
    batch, heads, padded_q, _ = q.shape
    kv_index = _clamped_kv_index(plan, heads // k.shape[1], block_q, block_k)
    q_index = lambda b, h, i, j: (b, h, i, 0)
    row_specs = [pl.BlockSpec((None, None, block_q, x.shape[-1]), q_index) for x in inputs[3:]]
    kv_spec = pl.BlockSpec((None, None, block_k, k.shape[-1]), kv_index)
    seg_args, seg_specs = _segment_args(*(segments or (None, None)), *blocks, q_index, kv_index)
    return pl.pallas_call(
        functools.partial(kernel, plan=plan, has_segments=segments is not None),
        grid=(batch, heads, padded_q // block_q, plan.padded_kv // block_k),
        in_specs=[
            pl.BlockSpec((None, None, block_q, q.shape[-1]), q_index),
            kv_spec,
            kv_spec,
            *row_specs,
            *seg_specs,
        ],
        out_specs=[pl.BlockSpec((None, None, block_q, x.shape[-1]), q_index) for x in outs],
        out_shape=outs,
        scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=plan.interpret,
        name=name,
    )(*inputs, *seg_args)


def _segments(q_ids, kv_ids):
    return None if q_ids is None else (q_ids, kv_ids)


def forward(q, k, v, q_ids, kv_ids, plan: Plan):
    """``(out (batch, heads, padded_q, d), lse (batch, heads, padded_q, 128))``."""
    batch, heads, padded_q, dim = q.shape
    outs = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((batch, heads, padded_q, LANES), jnp.float32),
    ]
    blocks = (plan.block_q, plan.block_k)
    scratch = [(plan.block_q, LANES), (plan.block_q, LANES), (plan.block_q, dim)]  # m, l, acc
    return _by_query_block(
        _forward_kernel,
        "edl_tpu_flash_attention_fwd",
        plan,
        blocks,
        (q, k, v),
        _segments(q_ids, kv_ids),
        outs,
        scratch,
    )


def backward_dq(q, k, v, d_out, lse, delta, q_ids, kv_ids, plan: Plan):
    """dq ``(batch, heads, padded_q, d)``; ``lse``/``delta`` lane-broadcast."""
    blocks = (plan.block_q_bwd, plan.block_k_bwd)
    (dq,) = _by_query_block(
        _dq_kernel,
        "edl_tpu_flash_attention_dq",
        plan,
        blocks,
        (q, k, v, d_out, lse, delta),
        _segments(q_ids, kv_ids),
        [jax.ShapeDtypeStruct(q.shape, q.dtype)],
        [(plan.block_q_bwd, q.shape[-1])],
    )
    return dq


def backward_dkdv(q, k, v, d_out, lse, delta, q_ids, kv_ids, plan: Plan):
    """(dk, dv) ``(batch, kv_heads, padded_kv, d)``: grid (batch, kv head, K/V block, (query
    head of the group, query block)); the dk/dv block of a kv head stays put while the last
    axis walks its whole group of query heads, accumulating in VMEM."""
    batch, heads, padded_q, dim = q.shape
    kv_heads = k.shape[1]
    group, bq, bk = heads // kv_heads, plan.block_q_bwd, plan.block_k_bwd
    nq = padded_q // bq

    def q_index(b, h, j, t):
        lo, hi = q_range(plan, j, bq, bk)
        i = clamp_block(jax.lax.rem(t, jnp.int32(nq)), lo, hi, nq)
        return b, h * group + _div(t, nq), i, 0

    kv_index = lambda b, h, j, t: (b, h, j, 0)
    q_spec = pl.BlockSpec((None, None, bq, dim), q_index)
    row_spec = pl.BlockSpec((None, None, bq, LANES), q_index)
    kv_spec = pl.BlockSpec((None, None, bk, dim), kv_index)
    seg_args, seg_specs = _segment_args(q_ids, kv_ids, bq, bk, q_index, kv_index)
    kernel = functools.partial(
        _dkdv_kernel, plan=plan, has_segments=q_ids is not None, num_q_blocks=nq
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, plan.padded_kv // bk, group * nq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *seg_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, dim), jnp.float32), pltpu.VMEM((bk, dim), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=plan.interpret,
        name="edl_tpu_flash_attention_dkdv",
    )(q, k, v, d_out, lse, delta, *seg_args)
