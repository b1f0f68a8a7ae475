"""Pieces shared by the Mosaic TPU decode kernels (``decode_attention``, ``paged_attention``).

Layout. A cache ``(..., tokens, kv_heads, head_dim)`` is viewed, by a free row-major
reshape in XLA, as ``(..., tokens * kv_heads, head_dim)``: key row ``c`` of a block is token
``c // kv_heads``, kv head ``c % kv_heads``. A block selecting one kv head would put a
squeezed dim second-minor, which Mosaic rejects; these 2-d blocks have the full ``head_dim``
as lanes and ``tokens * kv_heads`` (a multiple of the sublane tile, or the full dim) as
sublanes. The queries ``(new_tokens, heads, head_dim)`` of a batch row are likewise one tile
of ``new_tokens * heads`` rows (row ``r``: token ``r // heads``, head ``r % heads``), padded
to the sublane tile. Every query row meets every key row of a block in one matmul and pairs
whose kv heads differ are masked: decode reads memory, not flops, so the ``kv_heads``-fold
extra MXU work costs nothing and each cached byte is read once, whatever the GQA group.
(On TPU the reshape is a bitcast when XLA's tiled HBM layout of the ``(kv_heads,
head_dim)`` minor dims has no padding rows, i.e. ``kv_heads`` fills whole sublane tiles (8
rows; bfloat16 tiles may hold 16); otherwise XLA may relayout (copy) the cache, which a CPU
host cannot check.)

State. The grid is ``(batch, key steps)`` with the key axis innermost and sequential; an
online softmax keeps its running max and sum (lane-replicated ``(rows, 128)``, the layout
jax's own TPU kernels use) and the float32 accumulator in VMEM scratch, initialised at the
first step of a row and normalised into the output at its last.

Masking. Logits of invisible pairs get a large finite negative value and their
probabilities are set to exactly 0 (no ``inf - inf``, no reliance on ``exp(-inf)``); a row
that sees no key keeps a zero sum and writes zeros. Values outside the row's visible key
range are zeroed before ``P @ V``: stale or NaN data there (a page's unused tail, a clamped
block re-read) would otherwise turn ``0 * NaN`` into NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from edl.kernels._common import pad_axis

DTYPES = (jnp.float32, jnp.bfloat16)
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: MASK - MASK is 0, not NaN
LANES = 128
_BLOCK_BYTES = 512 * 1024  # default K (and V) bytes per grid step


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the kernel body needs to know statically."""

    new_tokens: int
    heads: int
    kv_heads: int
    window: int | None
    softcap: float | None
    scale: float
    block_tokens: int  # tokens per K/V block (one operand)
    blocks_per_step: int  # K/V blocks (operand pairs) folded in per grid step
    steps: int  # grid steps along the keys
    capacity: int  # cache positions a row can hold (cache_len, or pages_per_seq * page_size)
    has_sinks: bool = False  # a sink row operand follows the K/V operands


def check_dtypes(name: str, q: jax.Array, k: jax.Array, v: jax.Array, k_name: str, v_name: str):
    """q, K and V share float32 or bfloat16 (TypeError naming the dtypes otherwise)."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise TypeError(
            f"{name}: q/{k_name}/{v_name} must share one of float32/bfloat16, "
            f"got {q.dtype}/{k.dtype}/{v.dtype}"
        )


def check_sinks(name: str, sinks: jax.Array | None, heads: int) -> None:
    """Attention sinks are ``None`` or a float ``(heads,)`` vector (ValueError naming it)."""
    if sinks is None:
        return
    if sinks.shape != (heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(
            f"{name}: sinks must be a float ({heads},) vector (one per query head), "
            f"got {sinks.dtype}{tuple(sinks.shape)}"
        )


def sublanes(dtype) -> int:
    """Rows of a native VMEM tile: 8 for 32-bit, 16 for bfloat16 (two rows per sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def step_rows(head_dim: int, dtype) -> int:
    """Default key rows (tokens x kv heads) per grid step: ~512 KiB of K and as much of V,
    enough to hide a step's fixed cost behind its DMA, small enough that the double-buffered
    blocks and the float32 logits fit the default scoped VMEM of every TPU generation."""
    return max(128, min(2048, _BLOCK_BYTES // (head_dim * jnp.dtype(dtype).itemsize)))


def resolve_interpret(interpret: bool | pltpu.InterpretParams):
    """Pallas' ``interpret`` argument: False compiles for TPU."""
    return interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)


def query_rows(q: jax.Array) -> jax.Array:
    """``(batch, new, heads, d) -> (batch, rows, d)``, a free reshape (row ``r`` is token
    ``r // heads``, head ``r % heads``) padded with zero rows to the sublane tile."""
    batch, new_tokens, heads, head_dim = q.shape
    rows = new_tokens * heads
    tile = sublanes(q.dtype)
    return pad_axis(q.reshape(batch, rows, head_dim), 1, -(-rows // tile) * tile)


def sink_rows(sinks: jax.Array, q: jax.Array) -> jax.Array:
    """Attention sinks ``(heads,)`` as a lane-replicated float32 ``(rows, 128)`` operand in
    :func:`query_rows`' row order (row ``r``: head ``r % heads``; padding rows 0)."""
    new_tokens = q.shape[1]
    rows = jnp.tile(sinks.astype(jnp.float32), new_tokens)[:, None]
    tile = sublanes(q.dtype)
    padded = pad_axis(rows, 0, -(-rows.shape[0] // tile) * tile)
    return jnp.broadcast_to(padded, (padded.shape[0], LANES))


def sink_spec(rows: int) -> pl.BlockSpec:
    """The sink operand: the same ``(rows, 128)`` block at every grid step."""
    return pl.BlockSpec((rows, LANES), lambda b, step, *_: (0, 0))


def output_from_rows(out: jax.Array, q: jax.Array) -> jax.Array:
    """Inverse of :func:`query_rows` on the kernel's output."""
    _, new_tokens, heads, _ = q.shape
    return out[:, : new_tokens * heads].reshape(q.shape)


def key_range(length, start, plan: Plan):
    """``[first, end)``: the cache positions some query of the row may see (scalars).

    Queries sit at ``length - new + i``; the earliest of them sees nothing before
    ``length - new - window + 1``. ``end`` is clamped to the cache's capacity, so every
    position in the range exists.
    """
    first = jnp.maximum(start, 0)
    if plan.window is not None:
        first = jnp.maximum(first, length - plan.new_tokens - plan.window + 1)
    return first, jnp.clip(length, 0, plan.capacity)


def clamp_block(index, first, end, block_tokens: int):
    """``index`` clamped to the blocks of ``block_tokens`` holding ``[first, end)``: a grid
    step outside them re-uses a needed block's index, so Pallas issues no DMA for it, and
    an index past the row's last block never reaches memory. An empty range gives the
    block holding ``end - 1`` (or block 0)."""
    last = jax.lax.div(jnp.maximum(end - 1, 0), jnp.int32(block_tokens))
    lo = jnp.minimum(jax.lax.div(first, jnp.int32(block_tokens)), last)
    return jnp.minimum(jnp.maximum(index, lo), last)


def scratch_shapes(rows: int, head_dim: int):
    """Running max, running sum (lane-replicated) and the float32 accumulator."""
    return [
        pltpu.VMEM((rows, LANES), jnp.float32),
        pltpu.VMEM((rows, LANES), jnp.float32),
        pltpu.VMEM((rows, head_dim), jnp.float32),
    ]


def compiler_params():
    # Rows are independent (split across a megacore's two cores); the key axis carries
    # the online-softmax state.
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def attend(q_ref, blocks, o_ref, m_ref, l_ref, acc_ref, *, length, start, plan, sink_ref=None):
    """One grid step ``(row, step)``: initialise at step 0, fold in ``blocks`` when the step
    holds a key the row may see, write the output at the last step.

    ``sink_ref`` (attention sinks, :func:`sink_rows`): one more logit per query row in the
    softmax's sum, with no value; it only rescales the output at the last step.

    ``blocks`` is a list of ``(k_ref, v_ref, first_position)``, one per K/V operand pair,
    each ``(block_tokens * kv_heads, head_dim)``; ``first_position`` is where the block
    would start if no index had been clamped (positions of a clamped block fall outside
    ``key_range`` and are masked).
    """
    step = pl.program_id(1)
    first, end = key_range(length, start, plan)
    step_tokens = plan.block_tokens * plan.blocks_per_step

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    needed = (first < end) & (step * step_tokens < end) & ((step + 1) * step_tokens > first)

    @pl.when(needed)
    def _fold():
        _fold_blocks(
            q_ref[...],
            blocks,
            m_ref,
            l_ref,
            acc_ref,
            length=length,
            start=start,
            first=first,
            end=end,
            plan=plan,
        )

    @pl.when(step == plan.steps - 1)
    def _finish():
        total, acc = _lane_value(l_ref), acc_ref[...]
        if sink_ref is not None:
            # max(m, sink) keeps exp finite; a row that saw no key (m = MASK_VALUE) gets
            # weight 0 on its (zero) accumulator and 1 on the sink: zeros, as the reference.
            m, sink = _lane_value(m_ref), _lane_value(sink_ref)
            top = jnp.maximum(m, sink)
            alpha = jnp.exp(m - top)
            total, acc = alpha * total + jnp.exp(sink - top), alpha * acc
        # A row that saw no key has sum 0 and accumulator 0: write zeros.
        o_ref[...] = (acc / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)


def _lane_value(ref):
    """``(rows, 1)`` from a lane-replicated ``(rows, 128)`` scratch (a lane reduction)."""
    return jnp.max(ref[...], axis=1, keepdims=True)


def _query_positions(rows: int, length, start, plan: Plan):
    """``(rows, 1)`` per query row: its kv head, position and first visible position."""
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    group = plan.heads // plan.kv_heads
    kv_head = jax.lax.div(jax.lax.rem(row, jnp.int32(plan.heads)), jnp.int32(group))
    q_pos = length - plan.new_tokens + jax.lax.div(row, jnp.int32(plan.heads))
    lo = jnp.broadcast_to(jnp.maximum(start, 0), (rows, 1))
    if plan.window is not None:
        lo = jnp.maximum(lo, q_pos - plan.window + 1)
    return kv_head, q_pos, lo


def _key_positions(shape: tuple[int, int], dim: int, first_position, kv_heads: int):
    """Key row ``c``'s kv head (None for one kv head) and position, as an iota of ``shape``
    along ``dim``."""
    c = jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    if kv_heads == 1:
        return None, first_position + c
    kv = jnp.int32(kv_heads)
    return jax.lax.rem(c, kv), first_position + jax.lax.div(c, kv)


def _fold_blocks(q, blocks, m_ref, l_ref, acc_ref, *, length, start, first, end, plan):
    """The online-softmax update with every block of this step."""
    rows = q.shape[0]
    q_head, q_pos, q_lo = _query_positions(rows, length, start, plan)
    logits, masks = [], []
    for k_ref, _, first_position in blocks:
        keys = k_ref.shape[0]
        k_head, k_pos = _key_positions((1, keys), 1, first_position, plan.kv_heads)
        mask = (k_pos <= q_pos) & (k_pos >= q_lo)
        if k_head is not None:  # pairs of different kv heads (module docstring)
            mask = mask & (q_head == k_head)
        s = jax.lax.dot_general(
            q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * jnp.float32(plan.scale)
        if plan.softcap is not None:
            s = jnp.tanh(s * jnp.float32(1 / plan.softcap)) * jnp.float32(plan.softcap)
        logits.append(jnp.where(mask, s, MASK_VALUE))  # NaN keys (stale data) drop out here
        masks.append(mask)

    m_prev = _lane_value(m_ref)
    m_next = m_prev
    for s in logits:
        m_next = jnp.maximum(m_next, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    total = alpha * _lane_value(l_ref)
    acc = alpha * acc_ref[...]
    for (_, v_ref, first_position), s, mask in zip(blocks, logits, masks, strict=True):
        p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
        total = total + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        _, v_pos = _key_positions((v.shape[0], 1), 0, first_position, plan.kv_heads)
        live = (v_pos >= first) & (v_pos < end)
        # float32 select then back: bf16 VPU selects are not native on every TPU generation.
        v = jnp.where(live, v.astype(jnp.float32), 0.0).astype(v.dtype)
        acc = acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(total, l_ref.shape)
    acc_ref[...] = acc
