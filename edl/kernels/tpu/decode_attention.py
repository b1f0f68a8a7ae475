"""Decode-time attention as a Mosaic TPU kernel: a few new query tokens per row against a
contiguous KV cache ``(batch, cache_len, kv_heads, head_dim)`` with per-row lengths.

Semantics are ``edl.kernels.decode_attention``'s (the Triton kernel) and
``edl.ops.cached_attention``'s: row ``b``'s queries are its newest ``new_tokens`` tokens, at
positions ``lengths[b] - new_tokens + i``, seeing keys in ``[kv_start[b], lengths[b])``
causally and within ``window``; rows that see nothing give zeros.

Design (``_decode_common`` has the shared layout and softmax): the cache is viewed, by a
free reshape, as ``(batch, cache_len * kv_heads, head_dim)`` and read in blocks of
``block_k`` tokens, all kv heads at once. The grid is ``(batch, cache blocks)``; lengths and
``kv_start`` are scalar-prefetched into SMEM, where the index map clamps each step's block
to those holding the row's visible keys (``[kv_start, length)``, narrowed by the window):
steps outside them repeat a needed block's index, so Pallas fetches nothing for them, and
the kernel skips them with ``pl.when``. One program's query tile is all ``new_tokens *
heads`` query rows of its batch row, so every cached byte is read once per call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from edl.kernels.tpu._decode_common import (
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
    sublanes,
)

__all__ = ["decode_attention"]


def _cache_block(cache_len: int, kv_heads: int, requested: int, dtype) -> int:
    """The largest block of tokens <= ``requested`` that divides ``cache_len`` and whose
    ``tokens * kv_heads`` rows fill whole sublane tiles; else the whole cache (a block
    equal to the array's dim is always legal)."""
    tile = sublanes(dtype)
    for block in range(min(requested, cache_len), 0, -1):
        if cache_len % block == 0 and (block * kv_heads) % tile == 0:
            return block
    return cache_len


def _decode_kernel(len_ref, start_ref, q_ref, k_ref, v_ref, *refs, plan: Plan):
    sink_ref, (o_ref, *scratch) = (refs[0], refs[1:]) if plan.has_sinks else (None, refs)
    b, step = pl.program_id(0), pl.program_id(1)
    # The block the index map fetched; positions of a clamped step fall outside the range.
    first_position = step * plan.block_tokens
    attend(
        q_ref,
        [(k_ref, v_ref, first_position)],
        o_ref,
        *scratch,
        length=len_ref[b],
        start=start_ref[b],
        plan=plan,
        sink_ref=sink_ref,
    )


def _decode_call(lengths, starts, q_rows, k_rows, v_rows, sinks, *, plan: Plan, interpret):
    batch, rows, head_dim = q_rows.shape

    def cache_index(b, step, len_ref, start_ref):
        first, end = key_range(len_ref[b], start_ref[b], plan)
        return b, clamp_block(step, first, end, plan.block_tokens), 0

    cache_spec = pl.BlockSpec((None, plan.block_tokens * plan.kv_heads, head_dim), cache_index)
    row_spec = pl.BlockSpec((None, rows, head_dim), lambda b, step, *_: (b, 0, 0))
    sink_specs, sink_args = ([sink_spec(rows)], [sinks]) if plan.has_sinks else ([], [])
    return pl.pallas_call(
        functools.partial(_decode_kernel, plan=plan),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, plan.steps),
            in_specs=[row_spec, cache_spec, cache_spec, *sink_specs],
            out_specs=row_spec,
            scratch_shapes=scratch_shapes(rows, head_dim),
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=compiler_params(),
        interpret=interpret,
        name="edl_tpu_decode_attention",
    )(lengths, starts, q_rows, k_rows, v_rows, *sink_args)


def decode_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_cache: Float[Array, "batch cache_len kv_heads head_dim"],
    v_cache: Float[Array, "batch cache_len kv_heads head_dim"],
    lengths: Int[Array, " _batch"],  # _: checked here, naming the problem
    *,
    kv_start: Int[Array, " _batch"] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    block_k: int | None = None,
    sinks: Float[Array, " heads"] | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """Attention of each row's newest ``new_tokens`` queries over its KV cache, on TPU.

    Row ``b`` holds valid keys at cache positions ``[kv_start[b], lengths[b])`` (``kv_start``
    masks left padding; default 0); its queries sit at ``lengths[b] - new_tokens + i`` and
    attend causally. Rows with no visible key give zeros. float32 logits, softmax and
    accumulation; output in ``q``'s dtype (float32 or bfloat16). Not differentiable.

    Args:
        q: ``(batch, new_tokens, heads, head_dim)``; head ``h`` reads kv head
            ``h // (heads // kv_heads)``.
        k_cache, v_cache: ``(batch, cache_len, kv_heads, head_dim)``, read in place.
        lengths, kv_start: ``(batch,)`` integers.
        window: left sliding window: a query at ``p`` sees keys ``p - window < j <= p``.
        softcap: logits become ``softcap * tanh(logits / softcap)``.
        scale: logit scale (default ``head_dim ** -0.5``).
        block_k: cached tokens per block (default: ~512 KiB of K, at most 2048 rows),
            lowered to the largest divisor of ``cache_len`` whose ``block_k * kv_heads``
            rows fill whole sublane tiles (8 rows for float32, 16 for bfloat16), else the
            whole cache.
        sinks: attention sinks ``(heads,)`` (GPT-OSS): one more logit per head in each
            softmax's sum, attending to nothing.
        interpret: False compiles for TPU; True or ``pltpu.InterpretParams()`` runs Pallas'
            interpreter (the latter simulating TPU memory spaces and DMAs).
    """
    _check_inputs(q, k_cache, v_cache, lengths, kv_start, window, block_k)
    check_sinks("tpu decode_attention", sinks, q.shape[2])
    batch, new_tokens, heads, head_dim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    requested = block_k or max(1, step_rows(head_dim, q.dtype) // kv_heads)
    block = _cache_block(cache_len, kv_heads, requested, q.dtype)
    plan = Plan(
        new_tokens=new_tokens,
        heads=heads,
        kv_heads=kv_heads,
        window=window,
        softcap=None if softcap is None else float(softcap),
        scale=head_dim**-0.5 if scale is None else float(scale),
        block_tokens=block,
        blocks_per_step=1,
        steps=cache_len // block,
        capacity=cache_len,
        has_sinks=sinks is not None,
    )
    starts = jnp.zeros((batch,), jnp.int32) if kv_start is None else kv_start.astype(jnp.int32)
    # Free row-major reshapes: a token's kv heads are consecutive rows.
    k_rows, v_rows = (x.reshape(batch, cache_len * kv_heads, head_dim) for x in (k_cache, v_cache))
    out = _decode_call(
        lengths.astype(jnp.int32),
        starts,
        query_rows(q),
        k_rows,
        v_rows,
        None if sinks is None else sink_rows(sinks, q),
        plan=plan,
        interpret=resolve_interpret(interpret),
    )
    return output_from_rows(out, q)


def _check_inputs(q, k_cache, v_cache, lengths, kv_start, window, block_k) -> None:
    """Shapes, dtypes and options ``decode_attention`` accepts, each problem named."""
    name = "tpu decode_attention"
    batch, _, heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"{name}: incompatible q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}"
        )
    if heads % k_cache.shape[2]:
        raise ValueError(f"{name}: {heads} heads not a multiple of {k_cache.shape[2]} kv heads")
    check_dtypes(name, q, k_cache, v_cache, "k_cache", "v_cache")
    for what, arr in (("lengths", lengths), ("kv_start", kv_start)):
        if arr is not None and (
            arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.integer)
        ):
            raise ValueError(
                f"{name}: {what} must be integers of shape ({batch},), got {arr.dtype}{arr.shape}"
            )
    if window is not None and window < 1:
        raise ValueError(f"{name}: window must be >= 1, got {window}")
    if block_k is not None and block_k < 1:
        raise ValueError(f"{name}: block_k must be >= 1, got {block_k}")
