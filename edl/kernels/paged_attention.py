"""Decode attention over a paged KV cache (vLLM-style page pool + per-row page table).

Layout: ``k_pages``/``v_pages`` are one pool ``(num_pages, page_size, kv_heads, head_dim)``
shared by all rows; row ``b``'s logical cache position ``p`` lives at
``pool[page_table[b, p // page_size], p % page_size]``. Only the first
``ceil(lengths[b] / page_size)`` entries of a row's table are used; the rest may hold
anything (-1, out of range) and are never read. Pools stacked over layers ``(layers,
num_pages, ...)``, as serving keeps them, are read at ``layer`` in place: the kernel takes the
whole stack and indexes the layer itself, since slicing a layer's pool out first would copy
it on every call.

Program mapping is that of ``decode_attention``: one program per ``(batch row, kv head,
split)`` owns the ``new_tokens * group`` query rows of the query heads sharing that kv head,
and walks its split of the row's logical key blocks between the sliding-window start and the
row's length, looking each page up in the table inside the kernel (Triton has no scalar
prefetch) and reading it by dynamic index from the whole pool, which every program sees in
full. Splits are merged by log-sum-exp in plain jnp.

Key blocks: on GPU one page is one block (``page_size`` must be a power of two >= 16, a
valid ``tl.dot`` tile; Triton cannot gather several scattered pages into one tile). In
interpret mode the cost is per loop iteration, not per flop, so a block is
``512 // page_size`` pages, gathered by one dynamic slice each. Table entries past the used
ones are clamped to the last used one (and page ids to the pool) before any read; the keys
they would add lie at or past the length and are masked, and their values are zeroed, so
stale or NaN data in a page's unused tail cannot leak into the output.

Quantized pools (``edl.ops.kv_quant``, an int8 / fp8 KV cache): the pools hold int8 or
float8_e4m3fn codes and ``k_scales`` / ``v_scales`` ``(*layers, num_pages, page_size,
kv_heads, 1)`` one float32 scale per token and kv head. The kernel loads a page's codes and
its scales (SRAM on GPU) and dequantizes the block there, ``codes * scale`` in float32 then
rounded to ``q``'s dtype, before the dot (keys) and the value sum (values): the same values
``edl.ops.paged_attention``'s ``"xla"`` form gathers, with only the 1-byte codes (plus 4 bytes
per ``head_dim``) moved from memory. A scale cannot be folded into the logits for values, so
keys and values are dequantized alike.

Interpret mode: Pallas' interpreter slices every input's block out of the full array on
every grid step; giving the pool as one full-size block makes that slice the identity, so
the grid runs with no per-step copy of the pool (the kernel indexes the kv head itself).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Shaped

from edl.kernels._common import (
    KERNEL_DTYPES,
    LOG2E,
    by_interpret,
    cdiv,
    compiler_params,
    decode_splits,
    merge_query_rows,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_axis,
    query_rows,
    scores,
    visible,
)

__all__ = ["paged_decode_attention"]

_CPU_BLOCK_KEYS = 512  # keys per block in interpret mode


@dataclasses.dataclass(frozen=True)
class _PagedPlan:
    new_tokens: int
    group: int
    window: int | None
    softcap: float | None
    scale: float
    num_pages: int
    page_size: int
    pages_per_seq: int
    pages_per_block: int
    blocks_per_split: int
    quantized: bool = False  # scale pools follow the K / V pools


def _paged_kernel(len_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *refs, plan: _PagedPlan):
    ks_ref, vs_ref, o_ref, lse_ref = refs if plan.quantized else (None, None, *refs)
    length, layer = len_ref[()], layer_ref[()]
    head, split = pl.program_id(1), pl.program_id(2)
    page_size, per_block = plan.page_size, plan.pages_per_block
    block_k = page_size * per_block
    q = q_ref[...]
    rows = q.shape[0]
    # Row r holds new token r // group; the new tokens are the last ones before `length`.
    q_pos = length - plan.new_tokens + jax.lax.div(jnp.arange(rows), jnp.int32(plan.group))
    first_key = jnp.int32(0)
    if plan.window is not None:
        first_key = jnp.maximum(first_key, length - plan.new_tokens - plan.window + 1)
    used_pages = jnp.minimum(
        jax.lax.div(jnp.maximum(length, 0) + page_size - 1, jnp.int32(page_size)),
        plan.pages_per_seq,
    )
    lo = jnp.maximum(split * plan.blocks_per_split, jax.lax.div(first_key, jnp.int32(block_k)))
    hi = jnp.minimum(
        (split + 1) * plan.blocks_per_split,
        jax.lax.div(used_pages + per_block - 1, jnp.int32(per_block)),
    )

    def load(ref, scale_ref, j):
        tiles = []
        for i in range(per_block):
            entry = jnp.minimum(j * per_block + i, used_pages - 1)  # never an unused entry
            page = jnp.clip(table_ref[entry], 0, plan.num_pages - 1)
            tile = ref[layer, page, :, head, :]
            if scale_ref is not None:  # codes dequantized on chip (module docstring)
                scales = scale_ref[layer, page, :, head]
                tile = (tile.astype(jnp.float32) * scales[:, None]).astype(q.dtype)
            tiles.append(tile)
        return tiles[0] if per_block == 1 else jnp.concatenate(tiles)

    def body(j, carry):
        k_pos = j * block_k + jnp.arange(block_k)
        s, _ = scores(q, load(k_ref, ks_ref, j), scale=plan.scale, softcap=plan.softcap)
        mask = visible(q_pos, k_pos, causal=True, window=plan.window, kv_len=length)
        v = jnp.where((k_pos < length)[:, None], load(v_ref, vs_ref, j), 0)  # unused tail
        return online_softmax_step(carry, jnp.where(mask, s * LOG2E, -jnp.inf), v)

    carry = jax.lax.fori_loop(lo, hi, body, online_softmax_init(rows, q.shape[1]))
    # An empty split has lse -inf, so it weighs nothing when the splits are merged.
    o_ref[...], lse_ref[...] = online_softmax_finish(carry, empty_lse=-jnp.inf)


def _paged_call(
    lengths, table, layer, q_rows, k_pages, v_pages, scales, *, plan, num_splits, params, interpret
):
    batch, kv_heads, rows, dim = q_rows.shape
    pool = pl.BlockSpec(k_pages.shape, lambda b, h, s: (0,) * 5)  # every layer's pool, whole
    scale_specs = [pl.BlockSpec(x.shape, lambda b, h, s: (0,) * 4) for x in scales]
    return pl.pallas_call(
        functools.partial(_paged_kernel, plan=plan),
        grid=(batch, kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, plan.pages_per_seq), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None,), lambda b, h, s: (0,)),
            pl.BlockSpec((None, None, rows, dim), lambda b, h, s: (b, h, 0, 0)),
            pool,
            pool,
            *scale_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="edl_paged_decode_attention",
    )(lengths, table, layer, q_rows, k_pages, v_pages, *scales)


def _check(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales) -> None:
    """The shapes and dtypes ``paged_decode_attention`` takes (pools stacked over layers;
    quantized pools with their scales), each problem named."""

    def fail(what, expected, actual, error=ValueError):
        raise error(f"paged_decode_attention: {what} must be {expected}, got {actual}")

    batch, _, heads, head_dim = q.shape
    if k_pages.ndim != 5 or k_pages.shape[4] != head_dim:
        fail("k_pages", f"([layers,] num_pages, page_size, kv_heads, {head_dim})", k_pages.shape)
    if v_pages.shape != k_pages.shape:
        fail("v_pages", f"the shape of k_pages {k_pages.shape}", v_pages.shape)
    if heads % k_pages.shape[3]:
        fail("q's heads", f"a multiple of the {k_pages.shape[3]} kv heads", heads)
    if (k_scales is None) != (v_scales is None):
        fail("k_scales/v_scales", "both given or neither", "one")
    if k_scales is not None:
        _check_quantized(q, k_pages, v_pages, k_scales, v_scales, fail)
    elif not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in KERNEL_DTYPES:
        dtypes = f"{q.dtype}/{k_pages.dtype}/{v_pages.dtype}"
        fail("q/k_pages/v_pages", "one shared float32/bfloat16/float16", dtypes, TypeError)
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        fail("page_table", f"of shape ({batch}, pages_per_seq)", page_table.shape)
    if lengths.shape != (batch,):
        fail("lengths", f"of shape ({batch},)", lengths.shape)
    for name, arr in (("page_table", page_table), ("lengths", lengths)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            fail(name, "integers", arr.dtype, TypeError)


CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # quantized pools' codes


def _check_quantized(q, k_pages, v_pages, k_scales, v_scales, fail) -> None:
    """Quantized pools: codes of one of :data:`CODE_DTYPES`, float32 scales of the pools'
    shape with a last dim of 1, ``q`` in one of the kernel's float dtypes."""
    if q.dtype not in KERNEL_DTYPES:
        fail("q", "float32/bfloat16/float16", q.dtype, TypeError)
    if k_pages.dtype not in CODE_DTYPES or v_pages.dtype != k_pages.dtype:
        codes = f"{k_pages.dtype}/{v_pages.dtype}"
        fail("quantized k_pages/v_pages", "int8 or float8_e4m3fn codes, alike", codes, TypeError)
    want = (*k_pages.shape[:-1], 1)
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if x.shape != want or x.dtype != jnp.float32:
            fail(name, f"float32{want}", f"{x.dtype}{x.shape}")


def paged_decode_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Shaped[Array, "*layers num_pages page_size kv_heads head_dim"],
    v_pages: Shaped[Array, "*layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "_batch pages_per_seq"],  # _: edl checks it and names the problem
    lengths: Int[Array, " _batch"],
    *,
    layer: Int[Array, ""] | int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    num_splits: int | None = None,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
    interpret: bool | None = None,
    k_scales: Float[Array, "*_layers _num_pages _page_size _kv_heads _one"] | None = None,
    v_scales: Float[Array, "*_layers _num_pages _page_size _kv_heads _one"] | None = None,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``decode_attention(q, gather_pages(k_pages, page_table), gather_pages(v_pages,
    page_table), lengths)`` without gathering: row ``b``'s queries are the last
    ``new_tokens`` of its ``lengths[b]`` keys, attending causally (and within ``window``).
    Rows with no visible key give zeros; float32 accumulation; output in ``q``'s dtype.

    Args:
        page_table: ``(batch, pages_per_seq)`` pool indices; entries at or past
            ``ceil(lengths[b] / page_size)`` are never read.
        layer: with pools stacked over layers ``(layers, num_pages, ...)``, the layer to read;
            its pool is read where it lies (never copied out of the stack). None: one layer's
            pools.
        window, softcap, scale, sinks, num_splits, num_warps, num_stages, interpret: as in
            ``decode_attention``.
        k_scales, v_scales: quantized pools' float32 scales (module docstring), with
            ``k_pages`` / ``v_pages`` then int8 or float8_e4m3fn codes; None: float pools.
    """
    if layer is None:  # one layer's pools: a leading axis of one (a free reshape)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        if k_scales is not None and v_scales is not None:
            k_scales, v_scales = k_scales[None], v_scales[None]
    _check(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales)
    # The kernel reads (layers, num_pages, page_size, kv_heads) scales: one value per row.
    scales = () if k_scales is None else tuple(x[..., 0] for x in (k_scales, v_scales))
    kernel = functools.partial(
        _paged,
        window=window,
        softcap=softcap,
        scale=scale,
        num_splits=num_splits,
        params=compiler_params(num_warps, num_stages),
    )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    args = (q, k_pages, v_pages, page_table, lengths, layer, sinks, scales)
    return by_interpret(kernel, interpret, *args)


def _paged(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    layer,
    sinks,
    scales,
    *,
    window,
    softcap,
    scale,
    num_splits,
    params,
    interpret: bool,
):
    """``paged_decode_attention`` for ``interpret`` or Triton (blocks and splits differ)."""
    batch, new_tokens, heads, head_dim = q.shape
    _, num_pages, page_size, kv_heads, _ = k_pages.shape
    if not interpret and (page_size < 16 or page_size & (page_size - 1)):
        raise ValueError(
            f"paged_decode_attention: on GPU the page size must be a power of two >= 16, "
            f"got {page_size}"
        )
    pages_per_seq = page_table.shape[1]
    per_block = max(1, min(pages_per_seq, _CPU_BLOCK_KEYS // page_size)) if interpret else 1
    num_blocks = cdiv(pages_per_seq, per_block)
    num_splits = decode_splits(num_splits, batch * kv_heads, num_blocks, interpret)
    plan = _PagedPlan(
        new_tokens=new_tokens,
        group=heads // kv_heads,
        window=window,
        softcap=None if softcap is None else float(softcap),
        scale=head_dim**-0.5 if scale is None else float(scale),
        num_pages=num_pages,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        pages_per_block=per_block,
        blocks_per_split=cdiv(num_blocks, num_splits),
        quantized=bool(scales),
    )
    q_rows = query_rows(q, kv_heads, interpret)  # (batch, kv_heads, new * group, d)
    dim = q_rows.shape[3]  # GPU: head_dim padded to a power of two (copies the pool if so)
    out, lse = _paged_call(
        lengths.astype(jnp.int32),
        page_table.astype(jnp.int32),
        layer,
        q_rows,
        pad_axis(k_pages, 4, dim),
        pad_axis(v_pages, 4, dim),
        scales,
        plan=plan,
        num_splits=num_splits,
        params=params,
        interpret=interpret,
    )
    return merge_query_rows(out, lse, q, sinks)


def gather_pages(
    pages: Shaped[Array, "*layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    *,
    layer: Int[Array, ""] | int | None = None,
) -> Shaped[Array, "batch cache_len kv_heads head_dim"]:
    """The logical contiguous cache ``(batch, pages_per_seq * page_size, kv_heads, d)`` of a
    page pool, or of pool ``layer`` of pools stacked over layers (one gather, without copying
    that layer's pool first; any dtype: a quantized pool's codes and scales too). Plain
    jnp; out-of-range table entries are clamped into the pool."""
    batch, pages_per_seq = page_table.shape
    page_size, kv_heads, head_dim = pages.shape[-3:]
    if layer is None:
        gathered = jnp.take(pages, page_table, axis=0, mode="clip")
    else:
        gathered = pages.at[layer, page_table].get(mode="clip")
    return gathered.reshape(batch, pages_per_seq * page_size, kv_heads, head_dim)
