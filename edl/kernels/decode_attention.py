"""Decode-time attention in Pallas: a few new query tokens against a long KV cache.

Each program owns one ``(batch row, kv head, split)``: the query rows of every query head
sharing that kv head (``new_tokens * group`` rows, so GQA reads each cached K/V block once)
against one contiguous split of the cache, visiting only blocks below the row's valid length.
Splitting the cache (flash-decoding) keeps the GPU busy at batch 1; the per-split results are
merged by their log-sum-exp in plain jnp, which is cheap because they are tiny.

The cache is never copied or padded: its length must be a multiple of the key block, which
the block choice guarantees on CPU and which on GPU needs a cache length that is a multiple
of 16 (``edl.generate`` allocates caches that way).
"""

from __future__ import annotations

import dataclasses
import functools

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
    decode_splits,
    merge_query_rows,
    next_pow2,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_axis,
    query_rows,
    scores,
    visible,
)

__all__ = ["decode_attention"]


@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    new_tokens: int
    group: int
    window: int | None
    softcap: float | None
    scale: float
    block_k: int
    blocks_per_split: int
    has_start: bool


def _cache_block(cache_len: int, requested: int, interpret: bool) -> int:
    """The largest key block <= ``requested`` that divides ``cache_len`` (a power of two
    >= 16 on GPU, where Triton needs one)."""
    if interpret:
        return max(b for b in range(1, min(requested, cache_len) + 1) if cache_len % b == 0)
    # Triton's smallest block is 16 keys, so a smaller request is raised to it.
    block = max(16, min(next_pow2(requested), next_pow2(cache_len)))
    while block >= 16 and cache_len % block:
        block //= 2
    if block < 16:
        raise ValueError(
            f"decode_attention: on GPU the cache length ({cache_len}) must be a multiple of 16"
        )
    return block


def _decode_kernel(*refs, plan: _DecodePlan):
    if plan.has_start:
        len_ref, start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        start = start_ref[()]
    else:
        len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        start = jnp.int32(0)
    length = len_ref[()]
    split = pl.program_id(2)
    block_k, rows = plan.block_k, q_ref.shape[0]
    q = q_ref[...]
    # Row r holds new token r // group; the new tokens are the last ones before `length`.
    q_pos = length - plan.new_tokens + jax.lax.div(jnp.arange(rows), jnp.int32(plan.group))
    first_key = start
    if plan.window is not None:
        first_key = jnp.maximum(first_key, length - plan.new_tokens - plan.window + 1)
    lo = jnp.maximum(split * plan.blocks_per_split, jax.lax.div(first_key, jnp.int32(block_k)))
    hi = jnp.minimum(
        (split + 1) * plan.blocks_per_split,
        jax.lax.div(length + block_k - 1, jnp.int32(block_k)),
    )

    def body(j, carry):
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        s, _ = scores(q, k_ref[keys, :], scale=plan.scale, softcap=plan.softcap)
        mask = visible(
            q_pos,
            j * block_k + jnp.arange(block_k),
            causal=True,
            window=plan.window,
            kv_len=length,
            kv_start=start if plan.has_start else None,
        )
        return online_softmax_step(carry, jnp.where(mask, s * LOG2E, -jnp.inf), v_ref[keys, :])

    carry = jax.lax.fori_loop(lo, hi, body, online_softmax_init(rows, q.shape[1]))
    # An empty split has lse -inf, so it weighs nothing when the splits are merged.
    o_ref[...], lse_ref[...] = online_softmax_finish(carry, empty_lse=-jnp.inf)


def _decode_call(
    scalars, q_rows, k_cache, v_cache, *, plan: _DecodePlan, num_splits, params, interpret
):
    batch, kv_heads, padded_rows, dim = q_rows.shape
    cache_len = k_cache.shape[1]
    scalar = pl.BlockSpec((None,), lambda b, h, s: (b,))
    cache_spec = pl.BlockSpec((None, cache_len, None, dim), lambda b, h, s: (b, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_decode_kernel, plan=plan),
        grid=(batch, kv_heads, num_splits),
        in_specs=[
            *[scalar] * len(scalars),
            pl.BlockSpec((None, None, padded_rows, dim), lambda b, h, s: (b, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, padded_rows, dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, padded_rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, padded_rows, dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, padded_rows), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="edl_decode_attention",
    )(*scalars, q_rows, k_cache, v_cache)


def decode_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_cache: Float[Array, "batch cache_len kv_heads head_dim"],
    v_cache: Float[Array, "batch cache_len kv_heads head_dim"],
    lengths: Int[Array, " _batch"],  # _: edl checks it and names the problem
    *,
    kv_start: Int[Array, " _batch"] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
    interpret: bool | None = None,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """Attention of ``new_tokens`` queries per row over a KV cache with per-row lengths.

    Row ``b`` holds valid keys at cache positions ``[kv_start[b], lengths[b])`` (``kv_start``
    masks left padding; default 0) and its queries are the last ``new_tokens`` of them, at
    positions ``lengths[b] - new_tokens + i``; they attend causally. Rows with no visible key
    give zeros. float32 accumulation whatever the input dtype.

    Args:
        window: left sliding window (Mistral), as in ``flash_attention``.
        softcap, scale: as in ``flash_attention``.
        sinks: attention sinks ``(heads,)`` (GPT-OSS): one more split in the merge of the
            splits (``merge_query_rows``); not differentiated.
        block_k: cached keys per block (default 512 on CPU, 64 on GPU; always a divisor of
            ``cache_len``).
        num_splits: cache splits processed in parallel (default: enough programs to fill a
            GPU; 1 in interpret mode).
        num_warps, num_stages: Triton launch settings (GPU only).
        interpret: as in ``flash_attention`` (default: by the platform lowered for).
    """
    _check_inputs(q, k_cache, v_cache, lengths, kv_start)
    kernel = functools.partial(
        _decode,
        window=window,
        softcap=softcap,
        scale=scale,
        block_k=block_k,
        num_splits=num_splits,
        params=compiler_params(num_warps, num_stages),
    )
    return by_interpret(kernel, interpret, q, k_cache, v_cache, lengths, kv_start, sinks)


def _decode(
    q,
    k_cache,
    v_cache,
    lengths,
    kv_start,
    sinks,
    *,
    window,
    softcap,
    scale,
    block_k,
    num_splits,
    params,
    interpret: bool,
):
    """``decode_attention`` for ``interpret`` or Triton (block and split choices differ)."""
    batch, new_tokens, heads, head_dim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block = _cache_block(cache_len, block_k or (512 if interpret else 64), interpret)
    num_blocks = cache_len // block
    num_splits = decode_splits(num_splits, batch * kv_heads, num_blocks, interpret)
    plan = _DecodePlan(
        new_tokens=new_tokens,
        group=group,
        window=window,
        softcap=None if softcap is None else float(softcap),
        scale=head_dim**-0.5 if scale is None else float(scale),
        block_k=block,
        blocks_per_split=cdiv(num_blocks, num_splits),
        has_start=kv_start is not None,
    )

    q_rows = query_rows(q, kv_heads, interpret)  # (batch, kv_heads, new * group, d)
    dim = q_rows.shape[3]
    k_cache, v_cache = pad_axis(k_cache, 3, dim), pad_axis(v_cache, 3, dim)

    scalars = [lengths.astype(jnp.int32)]
    if kv_start is not None:
        scalars.append(kv_start.astype(jnp.int32))
    call = functools.partial(
        _decode_call, plan=plan, num_splits=num_splits, params=params, interpret=interpret
    )
    if interpret and batch * kv_heads > 1:
        out, lse = _call_per_head(call, scalars, q_rows, k_cache, v_cache, num_splits)
    else:
        out, lse = call(scalars, q_rows, k_cache, v_cache)
    return merge_query_rows(out, lse, q, sinks)


def _check_inputs(q, k_cache, v_cache, lengths, kv_start) -> None:
    """Shapes and dtypes ``decode_attention`` accepts, each problem named."""
    batch, _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"decode_attention: incompatible q {q.shape}, k_cache {k_cache.shape}, "
            f"v_cache {v_cache.shape}"
        )
    if heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} heads not a multiple of {kv_heads} kv heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"decode_attention: q/k_cache/v_cache must share one of float32/bfloat16/float16, "
            f"got {q.dtype}/{k_cache.dtype}/{v_cache.dtype}"
        )
    for name, arr in (("lengths", lengths), ("kv_start", kv_start)):
        if arr is not None and (
            arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.integer)
        ):
            raise ValueError(
                f"decode_attention: {name} must be integers of shape ({batch},), "
                f"got {arr.dtype}{arr.shape}"
            )


def _call_per_head(call, scalars, q_rows, k_cache, v_cache, num_splits):
    """``call`` once per (row, kv head) under ``lax.map``, for interpret mode: as in
    flash_attention, Pallas' interpreter copies every input (here the whole cache) on every
    grid step."""
    batch, kv_heads, padded_rows, dim = q_rows.shape
    cache_len, n = k_cache.shape[1], batch * kv_heads
    per_head = (
        [jnp.repeat(x, kv_heads)[:, None] for x in scalars],
        q_rows.reshape(n, 1, 1, padded_rows, dim),
        *(c.transpose(0, 2, 1, 3).reshape(n, 1, cache_len, 1, dim) for c in (k_cache, v_cache)),
    )
    out, lse = jax.lax.map(lambda xs: call(*xs), per_head)
    out = out.reshape(batch, kv_heads, num_splits, padded_rows, dim)
    return out, lse.reshape(batch, kv_heads, num_splits, padded_rows)
