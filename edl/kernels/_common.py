"""Pieces shared by edl's Pallas kernels: where they run, block sizes, padding and masks.

Kernels run through Pallas' Triton lowering in programs lowered for GPUs and with
``interpret=True`` elsewhere (CPU), where Pallas turns the kernel body into an ordinary XLA
loop over the grid (``by_interpret`` chooses by the platform a program is lowered for). Both
see the same kernel code; only the block sizes differ. Triton wants every in-kernel array to
have power-of-two dimensions, with matrix-multiply operands of at least 16 in each, so on GPU
head dims are zero-padded to a power of two (zeros add nothing to ``q @ k.T`` and give zero
output columns that are sliced off) and sequence blocks are powers of two; in interpret mode
any block size works.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

from edl.platforms import failing_when_lowered_on_error, platform_dependent

LOG2E = math.log2(math.e)
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def by_interpret(kernel: Callable[..., jax.Array], interpret: bool | None, *args: Any) -> jax.Array:
    """``kernel(*args, interpret=interpret)``; with ``interpret=None``, per platform the program
    is lowered for (``jax.lax.platform_dependent``): compiled through Triton on GPUs,
    interpreted elsewhere. A limit of the compiled kernel (a ``ValueError`` raised while
    tracing it, such as a cache length Triton cannot tile) then fails only when lowered for a
    GPU."""
    if interpret is not None:
        return kernel(*args, interpret=interpret)

    interpreted = functools.partial(kernel, interpret=True)
    compiled = failing_when_lowered_on_error(
        functools.partial(kernel, interpret=False), like=interpreted, message=str
    )
    return platform_dependent(*args, cuda=compiled, rocm=compiled, default=interpreted)


# The widest head the Triton kernels take: a block of wider K / V rows (with the query rows
# and the pipeline's second buffer) overflows an SM's shared memory, 232 KB on an H100 /
# H200 (seen: a 576-wide MLA latent at 64 keys a block asked for 594 KB).
TRITON_MAX_HEAD_DIM = 256


def triton_head_dim_reason(head_dim: int) -> str | None:
    """Why the Triton kernels cannot take heads of ``head_dim`` (None when they can)."""
    if head_dim > TRITON_MAX_HEAD_DIM:
        return (
            f"head_dim {head_dim} > {TRITON_MAX_HEAD_DIM} does not fit the GPU kernel's "
            "shared memory"
        )
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def seq_block(requested: int, length: int, interpret: bool) -> int:
    """The block actually used along a sequence of ``length``: no larger than needed.

    In interpret mode a block spanning the whole (short) sequence is best: each grid step
    costs a loop iteration, so fewer, larger steps win. On GPU a power of two >= 16.
    """
    if interpret:
        return max(1, min(requested, length))
    return max(16, min(requested, next_pow2(length)))


def padded_head_dim(head_dim: int, interpret: bool) -> int:
    return head_dim if interpret else max(16, next_pow2(head_dim))


def pad_axis(x: jax.Array, axis: int, size: int, value: float | int = 0) -> jax.Array:
    """Pad ``x`` at the end of ``axis`` to ``size`` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def compiler_params(num_warps: int | None, num_stages: int | None):
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def visible(
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    causal: bool,
    window: int | None,
    kv_len: int | jax.Array | None,
    kv_start: jax.Array | None = None,
    q_seg: jax.Array | None = None,
    kv_seg: jax.Array | None = None,
) -> jax.Array | None:
    """``(len(q_pos), len(k_pos))`` mask of visible keys, or None when all are visible.

    Positions are in kv coordinates (a query at ``q_pos`` sees keys ``k_pos <= q_pos`` when
    causal). ``kv_len`` masks padding keys at ``k_pos >= kv_len``; ``kv_start`` keys before
    it (left padding in a cache).
    """
    q_col, k_row = q_pos[:, None], k_pos[None, :]
    terms = []
    if kv_len is not None:
        terms.append(k_row < kv_len)
    if kv_start is not None:
        terms.append(k_row >= kv_start)
    if causal or window is not None:
        terms.append(k_row <= q_col)
    if window is not None:
        terms.append(q_col - k_row < window)
    if q_seg is not None:
        terms.append(q_seg[:, None] == kv_seg[None, :])
    if not terms:
        return None
    mask = terms[0]
    for term in terms[1:]:
        mask = mask & term
    return mask


def scores(q, k, *, scale: float, softcap: float | None):
    """``(rows, keys)`` float32 logits ``q @ k.T * scale``, soft-capped when asked, and the
    ``tanh`` value the soft-cap gradient needs (None without soft-capping)."""
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    if softcap is None:
        return s, None
    t = jnp.tanh(s / jnp.float32(softcap))
    return t * jnp.float32(softcap), t


def online_softmax_step(carry, s, v):
    """Fold one block of base-2 logits ``s (rows, keys)`` (``-inf`` where masked) and its
    values ``v (keys, d)`` into the running ``(acc, row_max, row_sum)`` of an online softmax.

    Rows that have seen no visible key yet keep ``row_max = -inf`` and contribute nothing
    (their exponent is taken against 0 instead of ``-inf``, so no ``inf - inf`` NaN).
    """
    acc, row_max, row_sum = carry
    new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp2(row_max - safe_max)
    p = jnp.exp2(s - safe_max[:, None])
    row_sum = row_sum * correction + jnp.sum(p, axis=1)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc * correction[:, None] + pv, new_max, row_sum


def online_softmax_init(rows: int, dim: int):
    """The empty ``(acc, row_max, row_sum)`` carry of :func:`online_softmax_step`."""
    return (
        jnp.zeros((rows, dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def online_softmax_finish(carry, empty_lse: float):
    """``(normalised output, base-2 log-sum-exp)``; rows that saw no key give zeros and
    ``empty_lse``."""
    acc, row_max, row_sum = carry
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)
    out = jnp.where(seen[:, None], acc / safe_sum[:, None], 0.0)
    return out, jnp.where(seen, row_max + jnp.log2(safe_sum), empty_lse)


GPU_PROGRAMS = 264  # ~2 waves on a 132-SM H100; decode kernels pick splits to reach this


def decode_splits(requested: int | None, programs: int, num_blocks: int, interpret: bool) -> int:
    """Flash-decoding splits of ``num_blocks`` key blocks: ``requested``, else 1 in interpret
    mode and enough to give a GPU ``GPU_PROGRAMS`` programs besides ``programs``."""
    if requested is None:
        requested = 1 if interpret else cdiv(GPU_PROGRAMS, programs)
    return max(1, min(requested, num_blocks))


def query_rows(q: jax.Array, kv_heads: int, interpret: bool) -> jax.Array:
    """``(batch, new, heads, d) -> (batch, kv_heads, rows, dim)``: the ``new * group`` query
    rows sharing each kv head as one tile (row ``r`` is new token ``r // group``), padded on
    GPU to a power of two >= 16 rows and to :func:`padded_head_dim` columns."""
    batch, new_tokens, heads, head_dim = q.shape
    group, rows = heads // kv_heads, new_tokens * (heads // kv_heads)
    q_rows = q.reshape(batch, new_tokens, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, kv_heads, rows, head_dim)
    padded_rows = rows if interpret else max(16, next_pow2(rows))
    return pad_axis(pad_axis(q_rows, 2, padded_rows), 3, padded_head_dim(head_dim, interpret))


def _sink_split(out, lse, sinks, new_tokens: int):
    """``out`` / ``lse`` with the sinks as one more split (see :func:`merge_query_rows`):
    row ``r`` of kv head ``h`` is query head ``h * group + r % group``; padded rows get
    ``-inf``."""
    batch, kv_heads, _, rows, dim = out.shape
    per_head = sinks.astype(jnp.float32).reshape(kv_heads, -1) * LOG2E  # (kv_heads, group)
    per_row = jnp.tile(per_head, (1, new_tokens))
    per_row = jnp.pad(per_row, ((0, 0), (0, rows - per_row.shape[1])), constant_values=-jnp.inf)
    sink_lse = jnp.broadcast_to(per_row[None, :, None], (batch, kv_heads, 1, rows))
    zeros = jnp.zeros((batch, kv_heads, 1, rows, dim), out.dtype)
    return (
        jnp.concatenate([out, zeros], axis=2),
        jnp.concatenate([lse.astype(jnp.float32), sink_lse], axis=2),
    )


def merge_query_rows(
    out: jax.Array, lse: jax.Array, q: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """Inverse of :func:`query_rows` after merging flash-decoding splits: per-split
    normalised outputs ``(batch, kv_heads, splits, rows, dim)`` and their base-2
    log-sum-exp ``(batch, kv_heads, splits, rows)`` -> ``q``'s shape and dtype.

    Splits are weighted by their log-sum-exp (an empty split has ``-inf``, weight 0); rows no
    split saw give zeros. Attention ``sinks`` ``(heads,)`` (GPT-OSS) join as one more split
    of zero output whose log-sum-exp is the row's head's sink: only the normalisation changes.
    """
    batch, new_tokens, heads, head_dim = q.shape
    kv_heads = out.shape[1]
    if sinks is not None:
        out, lse = _sink_split(out, lse, sinks, new_tokens)
    top = jnp.max(lse, axis=-2, keepdims=True)
    weight = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))
    total = jnp.sum(weight, axis=-2)
    merged = jnp.sum(out * weight[..., None], axis=-3)
    merged = merged / jnp.where(total == 0, 1.0, total)[..., None]
    merged = merged[:, :, : new_tokens * (heads // kv_heads), :head_dim]
    merged = merged.reshape(batch, kv_heads, new_tokens, heads // kv_heads, head_dim)
    return merged.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
