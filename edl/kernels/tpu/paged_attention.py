"""Decode attention over a paged KV cache as a Mosaic TPU kernel, pools read in place.

Layout is edl's (``edl.kernels.paged_attention``, ``edl.serve``): separate K and V pools
``(num_pages, page_size, kv_heads, head_dim)``, or stacked over layers ``(layers,
num_pages, ...)`` and read at ``layer``; row ``b``'s position ``p`` lives at
``pool[page_table[b, p // page_size], p % page_size]``. Only the first
``ceil(lengths[b] / page_size)`` table entries are used; the rest may hold anything.

Why not jax's TPU kernels: ``jax.experimental.pallas.ops.tpu.paged_attention`` wants
head-major pools ``(kv_heads, num_pages, page_size, head_dim)`` and one query token per row,
and ``ragged_paged_attention`` wants K and V interleaved in one pool ``(num_pages,
page_size, 2 * kv_heads, head_dim)``; either would mean re-laying out (copying) edl's pools,
and neither reads one layer of pools stacked over layers in place.

Design (``_decode_common`` has the shared layout and softmax): each pool is viewed, by free
reshapes, as ``(layers, num_pages, page_size * kv_heads, head_dim)`` (an unstacked pool
gets a leading axis of one) and a page is one block of full ``(page_size * kv_heads,
head_dim)`` dims. The grid is ``(batch, steps)``; a step folds in ``pages_per_block``
pages, passed as that many K and V operands (each with its own pipelined DMA) whose index
maps look the page up in the scalar-prefetched table. Lengths, the flattened table and the
layer sit in SMEM; the layer is an index-map coordinate, so only the pages read move and
no layer's pool is ever sliced out. Every table entry is clamped to the row's used entries
(and to those holding keys the window lets through) and every page id into the pool before
any read, so garbage past the used entries is never dereferenced and a step with nothing to
see repeats a needed page's index (no DMA) and is skipped with ``pl.when``. A clamped
operand's keys get positions outside the row's visible range, so they are masked, and
values there are zeroed, which also keeps stale or NaN data in a page's unused tail out.
With several pages per step, operands of a row's first or last needed step that fall
outside its needed pages re-read a needed page: at most ``pages_per_block - 1`` extra page
reads at each end of a row.

Quantized pools (``edl.ops.kv_quant``, an int8 / fp8 KV cache): the pools hold int8 or
float8_e4m3fn codes, and ``k_scales`` / ``v_scales`` ``(*layers, num_pages, page_size,
kv_heads, 1)`` one float32 scale per token and kv head, viewed as ``(layers, num_pages,
page_size * kv_heads, 1)`` (the page's key rows, one scale each). Each page's scales are one
more operand per K / V operand, fetched by the same index map; after the DMA the kernel
dequantizes the block in VMEM, ``codes * scale`` in float32 rounded to ``q``'s dtype, before
the ``q @ k`` and ``p @ v`` matmuls (:class:`_Dequantized`). Keys and values alike: a value
scale cannot be folded into the logits. HBM moves the 1-byte codes and 4 bytes per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int, Shaped

from edl.kernels._common import cdiv
from edl.kernels.tpu._decode_common import (
    DTYPES,
    Plan,
    attend,
    check_dtypes,
    check_sinks,
    clamp_block,
    compiler_params,
    key_range,
    output_from_rows,
    query_rows,
    resolve_interpret,
    scratch_shapes,
    sink_rows,
    sink_spec,
    step_rows,
)

__all__ = ["paged_decode_attention"]

_MAX_PAGES_PER_STEP = 8  # each page is one operand with its own DMA


class _Dequantized:
    """A K / V block read as its codes ``(rows, head_dim)`` times their scales ``(rows, 1)``
    in ``dtype`` (what ``_decode_common`` reads as ``ref[...]``)."""

    def __init__(self, codes_ref, scale_ref, dtype):
        self.codes_ref, self.scale_ref, self.dtype = codes_ref, scale_ref, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes_ref.shape

    def __getitem__(self, index):
        codes = self.codes_ref[index].astype(jnp.float32)
        return (codes * self.scale_ref[index]).astype(self.dtype)


def _paged_kernel(len_ref, table_ref, layer_ref, q_ref, *refs, plan: Plan, quantized: bool):
    del table_ref, layer_ref  # used by the index maps only
    n = plan.blocks_per_step
    k_refs, v_refs, rest = refs[:n], refs[n : 2 * n], refs[2 * n :]
    if quantized:  # each page's scales follow the codes' operands
        k_refs = [_Dequantized(k, s, q_ref.dtype) for k, s in zip(k_refs, rest[:n], strict=True)]
        v_refs = [
            _Dequantized(v, s, q_ref.dtype) for v, s in zip(v_refs, rest[n : 2 * n], strict=True)
        ]
        rest = rest[2 * n :]
    sink_ref, (o_ref, *scratch) = (rest[0], rest[1:]) if plan.has_sinks else (None, rest)
    b, step = pl.program_id(0), pl.program_id(1)
    page_tokens = plan.block_tokens
    blocks = [
        (k_refs[i], v_refs[i], (step * n + i) * page_tokens) for i in range(n)
    ]  # positions as if unclamped: a clamped page's keys fall outside the visible range
    attend(
        q_ref,
        blocks,
        o_ref,
        *scratch,
        length=len_ref[b],
        start=jnp.int32(0),
        plan=plan,
        sink_ref=sink_ref,
    )


def _page_spec(
    i: int, num_pages: int, layers: int, pages_per_seq: int, rows: int, dim: int, plan: Plan
):
    """BlockSpec of operand ``i``: the ``i``-th page of each step, looked up in the table."""
    n, page_size = plan.blocks_per_step, plan.block_tokens

    def index(b, step, len_ref, table_ref, layer_ref):
        first, end = key_range(len_ref[b], 0, plan)
        entry = clamp_block(step * n + i, first, end, page_size)  # never an unused entry
        page = jnp.clip(table_ref[b * pages_per_seq + entry], 0, num_pages - 1)
        return jnp.clip(layer_ref[0], 0, layers - 1), page, 0, 0

    return pl.BlockSpec((None, None, rows, dim), index)


def _paged_call(
    lengths, table, layer, q_rows, k_pool, v_pool, scales, sinks, *, plan: Plan, interpret
):
    batch, rows, head_dim = q_rows.shape
    layers, num_pages, page_rows, _ = k_pool.shape
    pages_per_seq = table.shape[0] // batch
    specs = [
        _page_spec(i, num_pages, layers, pages_per_seq, page_rows, head_dim, plan)
        for i in range(plan.blocks_per_step)
    ]
    # A page's scales: its key rows' one value each, fetched as its codes are.
    scale_specs = [
        _page_spec(i, num_pages, layers, pages_per_seq, page_rows, 1, plan)
        for i in range(plan.blocks_per_step)
    ] * (2 if scales else 0)
    scale_args = [x for x in scales for _ in range(plan.blocks_per_step)]
    row_spec = pl.BlockSpec((None, rows, head_dim), lambda b, step, *_: (b, 0, 0))
    n = plan.blocks_per_step
    sink_specs, sink_args = ([sink_spec(rows)], [sinks]) if plan.has_sinks else ([], [])
    return pl.pallas_call(
        functools.partial(_paged_kernel, plan=plan, quantized=bool(scales)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, plan.steps),
            in_specs=[row_spec, *specs, *specs, *scale_specs, *sink_specs],
            out_specs=row_spec,
            scratch_shapes=scratch_shapes(rows, head_dim),
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=compiler_params(),
        interpret=interpret,
        name="edl_tpu_paged_decode_attention",
    )(lengths, table, layer, q_rows, *[k_pool] * n, *[v_pool] * n, *scale_args, *sink_args)


def paged_decode_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Shaped[Array, "*layers num_pages page_size kv_heads head_dim"],
    v_pages: Shaped[Array, "*layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "_batch pages_per_seq"],  # _: checked here, naming the problem
    lengths: Int[Array, " _batch"],
    *,
    layer: Int[Array, ""] | int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    pages_per_block: int | None = None,
    sinks: Float[Array, " heads"] | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    k_scales: Float[Array, "*_layers _num_pages _page_size _kv_heads _one"] | None = None,
    v_scales: Float[Array, "*_layers _num_pages _page_size _kv_heads _one"] | None = None,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``decode_attention`` over a paged cache, on TPU, pages read in place.

    Row ``b``'s queries are the last ``new_tokens`` of its ``lengths[b]`` keys, attending
    causally (and within ``window``); rows with no visible key give zeros. float32 logits,
    softmax and accumulation; output in ``q``'s dtype (float32 or bfloat16). Not
    differentiable.

    Args:
        q: ``(batch, new_tokens, heads, head_dim)``.
        k_pages, v_pages: ``(num_pages, page_size, kv_heads, head_dim)`` pools, or pools
            stacked over layers ``(layers, num_pages, ...)`` with ``layer`` given.
        page_table: ``(batch, pages_per_seq)`` pool indices; entries at or past
            ``ceil(lengths[b] / page_size)`` are never read.
        lengths: ``(batch,)`` valid keys per row, the new tokens included.
        layer: the layer of stacked pools to read (a traced scalar is fine); None for
            unstacked pools.
        window, softcap, scale, sinks: as in ``decode_attention``.
        pages_per_block: pages folded in per grid step (default: ~512 KiB of K, at most
            8 pages).
        interpret: as in ``decode_attention``.
        k_scales, v_scales: quantized pools' float32 scales (module docstring), with
            ``k_pages`` / ``v_pages`` then int8 or float8_e4m3fn codes; None: float pools.
    """
    quantized = k_scales is not None
    _check(q, k_pages, v_pages, page_table, lengths, layer, window, pages_per_block, quantized)
    _check_scales(q, k_pages, v_pages, k_scales, v_scales)
    check_sinks("tpu paged_decode_attention", sinks, q.shape[2])
    _, new_tokens, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape[-4:]
    pages_per_seq = page_table.shape[1]
    per_step = pages_per_block or max(
        1, min(_MAX_PAGES_PER_STEP, step_rows(head_dim, q.dtype) // (page_size * kv_heads))
    )
    per_step = min(per_step, pages_per_seq)
    plan = Plan(
        new_tokens=new_tokens,
        heads=heads,
        kv_heads=kv_heads,
        window=window,
        softcap=None if softcap is None else float(softcap),
        scale=head_dim**-0.5 if scale is None else float(scale),
        block_tokens=page_size,
        blocks_per_step=per_step,
        steps=cdiv(pages_per_seq, per_step),
        capacity=pages_per_seq * page_size,
        has_sinks=sinks is not None,
    )
    scales = () if k_scales is None else (k_scales, v_scales)
    if layer is None:  # one layer's pools: a leading axis of one (free)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        scales = tuple(x[None] for x in scales)
    # Free row-major reshapes: a page's rows are its tokens' kv heads, consecutive.
    shape = (k_pages.shape[0], num_pages, page_size * kv_heads, head_dim)
    scales = tuple(x.reshape(*shape[:3], 1) for x in scales)
    out = _paged_call(
        lengths.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        jnp.asarray(layer, jnp.int32).reshape(1),
        query_rows(q),
        k_pages.reshape(shape),
        v_pages.reshape(shape),
        scales,
        None if sinks is None else sink_rows(sinks, q),
        plan=plan,
        interpret=resolve_interpret(interpret),
    )
    return output_from_rows(out, q)


CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # quantized pools' codes


def _check_scales(q, k_pages, v_pages, k_scales, v_scales) -> None:
    """Quantized pools: both scales or neither, codes of one of :data:`CODE_DTYPES`, float32
    scales of the pools' shape with a last dim of 1, ``q`` float32 or bfloat16."""
    name = "tpu paged_decode_attention"
    if (k_scales is None) != (v_scales is None):
        raise ValueError(f"{name}: pass both k_scales and v_scales or neither")
    if k_scales is None:
        return
    if q.dtype not in DTYPES:
        raise TypeError(f"{name}: q must be float32 or bfloat16, got {q.dtype}")
    if k_pages.dtype not in CODE_DTYPES or v_pages.dtype != k_pages.dtype:
        raise TypeError(
            f"{name}: quantized k_pages/v_pages must share int8 or float8_e4m3fn codes, "
            f"got {k_pages.dtype}/{v_pages.dtype}"
        )
    want = (*k_pages.shape[:-1], 1)
    for what, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if x.shape != want or x.dtype != jnp.float32:
            raise ValueError(f"{name}: {what} must be float32{want}, got {x.dtype}{x.shape}")


def _check(
    q, k_pages, v_pages, page_table, lengths, layer, window, pages_per_block, quantized
) -> None:
    """Shapes, dtypes and options ``paged_decode_attention`` accepts, each problem named."""

    def fail(what, expected, actual, error=ValueError):
        raise error(f"tpu paged_decode_attention: {what} must be {expected}, got {actual}")

    batch, _, heads, head_dim = q.shape
    pool_rank = 4 if layer is None else 5
    if k_pages.ndim != pool_rank:
        what = (
            "(num_pages, page_size, kv_heads, head_dim)"
            if layer is None
            else ("(layers, num_pages, page_size, kv_heads, head_dim) with layer=")
        )
        fail("k_pages", f"{pool_rank}-d {what}", k_pages.shape)
    if k_pages.shape[-1] != head_dim:
        fail("k_pages' head_dim", f"q's {head_dim}", k_pages.shape[-1])
    if v_pages.shape != k_pages.shape:
        fail("v_pages", f"the shape of k_pages {k_pages.shape}", v_pages.shape)
    if heads % k_pages.shape[-2]:
        fail("q's heads", f"a multiple of the {k_pages.shape[-2]} kv heads", heads)
    if not quantized:  # quantized pools: _check_scales
        check_dtypes("tpu paged_decode_attention", q, k_pages, v_pages, "k_pages", "v_pages")
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        fail("page_table", f"of shape ({batch}, pages_per_seq)", page_table.shape)
    if lengths.shape != (batch,):
        fail("lengths", f"of shape ({batch},)", lengths.shape)
    for name, arr in (("page_table", page_table), ("lengths", lengths)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            fail(name, "integers", arr.dtype, TypeError)
    if (
        layer is not None
        and not isinstance(layer, int)
        and (jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer))
    ):
        fail("layer", "an integer scalar", f"{jnp.result_type(layer)}{jnp.shape(layer)}")
    if window is not None and window < 1:
        fail("window", ">= 1", window)
    if pages_per_block is not None and pages_per_block < 1:
        fail("pages_per_block", ">= 1", pages_per_block)
