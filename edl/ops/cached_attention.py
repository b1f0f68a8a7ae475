"""Attention of a few new tokens against a KV cache: the decode-time entry points.

``cached_attention`` takes a contiguous cache ``(batch, cache_len, kv_heads, head_dim)`` with
per-row valid lengths; ``paged_attention`` the same logical cache stored in pages of a shared
pool, ``(num_pages, page_size, kv_heads, head_dim)``, through a ``(batch, pages_per_seq)``
page table. Row ``b``'s queries are its newest tokens, at cache positions
``lengths[b] - new_tokens + i``; they see the cached keys below ``lengths[b]``, causally and
within the sliding window. ``impl`` chooses the Pallas decode kernel or the plain-jnp
definition, as ``edl.ops.attention`` does for training-time attention.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.kernels import decode_attention, gather_pages, paged_decode_attention
from edl.ops.attention import IMPLS, masked_attention, pallas_unsupported

__all__ = ["cache_mask", "cached_attention", "paged_attention"]

_warned: set[str] = set()


def cache_mask(
    new_tokens: int,
    cache_len: int,
    lengths: Int[Array, " batch"],
    *,
    window: int | None = None,
) -> Bool[Array, "batch new_tokens cache_len"]:
    """Which cache positions each new token sees: below its row's length, not after itself,
    and (with ``window``) fewer than ``window`` positions back."""
    q_pos = lengths[:, None] - new_tokens + jnp.arange(new_tokens, dtype=lengths.dtype)[None]
    k_pos = jnp.arange(cache_len, dtype=lengths.dtype)[None, None]
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < lengths[:, None, None])
    if window is not None:
        mask &= q_pos[:, :, None] - k_pos < window
    return mask


def cached_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_cache: Float[Array, "batch cache_len kv_heads head_dim"],
    v_cache: Float[Array, "batch cache_len kv_heads head_dim"],
    lengths: Int[Array, " _batch"],  # _: the kernel checks it and names the problem
    *,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """The newest ``new_tokens`` of each row attend to its cache (see the module docstring).

    Args:
        lengths: valid cache entries per row, the new tokens included.
        window, softcap, scale: as ``edl.ops.attention``.
        impl: ``"pallas"`` (``edl.kernels.decode_attention``), ``"reference"`` or ``"xla"``
            (plain jnp under :func:`cache_mask`), or ``"auto"``: Pallas wherever it can run.
    """
    if _use_pallas(impl, q, k_cache, "cached_attention"):
        return decode_attention(
            q, k_cache, v_cache, lengths, window=window, softcap=softcap, scale=scale
        )
    mask = cache_mask(q.shape[1], k_cache.shape[1], lengths, window=window)
    return masked_attention(q, k_cache, v_cache, mask, softcap=softcap, scale=scale)


def paged_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Float[Array, "num_pages page_size kv_heads head_dim"],
    v_pages: Float[Array, "num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "_batch pages_per_seq"],
    lengths: Int[Array, " _batch"],
    *,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``cached_attention`` over a paged cache: row ``b``'s position ``p`` lives at
    ``k_pages[page_table[b, p // page_size], p % page_size]``. ``"pallas"`` runs
    ``edl.kernels.paged_decode_attention`` (pages read in place); ``"reference"``/``"xla"``
    gather each row's pages into a contiguous cache first."""
    if _use_pallas(impl, q, k_pages, "paged_attention"):
        return paged_decode_attention(
            q, k_pages, v_pages, page_table, lengths, window=window, softcap=softcap,
            scale=scale,
        )  # fmt: skip
    k_cache, v_cache = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    mask = cache_mask(q.shape[1], k_cache.shape[1], lengths, window=window)
    return masked_attention(q, k_cache, v_cache, mask, softcap=softcap, scale=scale)


def _use_pallas(impl: str, q: jax.Array, cache: jax.Array, name: str) -> bool:
    """Whether ``impl`` means the Pallas kernel here (``"auto"`` warns once when it cannot)."""
    if impl not in IMPLS or impl == "cudnn":
        raise ValueError(f"{name}: impl must be one of auto/pallas/xla/reference, got {impl!r}")
    if impl not in ("auto", "pallas"):
        return False
    reason = pallas_unsupported(q, cache)
    if reason is None:
        return True
    if impl == "pallas":
        raise ValueError(f"{name}: impl='pallas' cannot run: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"edl {name}: {reason}; using impl='xla'", stacklevel=3)
    return False
