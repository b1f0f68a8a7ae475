"""Attention of a few new tokens against a KV cache: the decode-time entry points.

``cached_attention`` takes a contiguous cache ``(batch, cache_len, kv_heads, head_dim)`` with
per-row valid lengths; ``paged_attention`` the same logical cache stored in pages of a shared
pool, ``(num_pages, page_size, kv_heads, head_dim)``, through a ``(batch, pages_per_seq)``
page table. Row ``b``'s queries are its newest tokens, at cache positions
``lengths[b] - new_tokens + i``; they see the cached keys below ``lengths[b]``, causally and
within the sliding window. ``impl`` chooses the Pallas decode kernel or plain XLA:

- ``"pallas"``: ``edl.kernels.decode_attention`` / ``paged_decode_attention`` (Triton on GPU,
  interpreted on CPU).
- ``"reference"``: ``masked_attention`` under :func:`cache_mask`, the definition.
- ``"xla"``: the same maths arranged for XLA. With one new token per row (a decode step) and
  lowering for CPU it reads the cache in place (``edl.ops.cpu.one_token_attention``).
- ``"auto"``: the Pallas kernel on GPU; ``"xla"`` on CPU, where Pallas only interprets the
  kernel one (row, kv head) program at a time and is the slower path in a decode step
  (``benchmarks/RESULTS.md``, "generate: a decode step's attention reads the cache in place").

Caches stacked over layers (``(layers, batch, cache_len, ...)``, as ``edl.generate`` keeps
them) are read at ``layer=``. Lowered for CPU, ``"xla"`` then reads only the live prefix of
that layer: the longest row's length rounded up to one of a few static lengths
(``edl.ops.cpu.live_lengths`` and ``read_live``), sliced straight out of the stack. The
Pallas kernels visit only blocks below each row's length already.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.kernels import decode_attention, gather_pages, native, paged_decode_attention
from edl.ops import cpu
from edl.ops.attention import IMPLS, masked_attention, pallas_unsupported, use_native
from edl.ops.cpu import LIVE_BRANCHES, live_lengths

__all__ = [
    "LIVE_BRANCHES",
    "NATIVE_MAX_NEW_TOKENS",
    "cache_mask",
    "cached_attention",
    "live_lengths",
    "paged_attention",
]

# The native CPU kernel's loops are scalar code over one key at a time: right for decode
# steps, slower than XLA's GEMMs for prompt chunks (benchmarks/RESULTS.md, "serve: paged
# attention read in place on CPU").
NATIVE_MAX_NEW_TOKENS = 4

_warned: set[str] = set()


def _read_live(
    impl: str, read: Callable[[int], jax.Array], bound: Int[Array, ""], sizes: tuple[int, ...]
) -> jax.Array:
    """``read(sizes[-1])`` (the whole cache), or lowered for CPU and not ``"reference"`` (the
    definition reads the whole cache) the live prefix: ``cpu.read_live``."""
    if impl == "reference":
        return read(sizes[-1])
    live = functools.partial(cpu.read_live, read, sizes=sizes)
    return jax.lax.platform_dependent(bound, cpu=live, default=lambda _: read(sizes[-1]))


def _at_layer(stack: jax.Array, layer: Int[Array, ""] | int | None, length: int) -> jax.Array:
    """``stack[layer, :, :length]`` (``stack[:, :length]`` without a layer), one slice."""
    if layer is None:
        return stack[:, :length]
    start = (layer, *(0,) * (stack.ndim - 1))
    return jax.lax.dynamic_slice(stack, start, (1, stack.shape[1], length, *stack.shape[3:]))[0]


def _check_layer(name: str, cache: jax.Array, layer: Int[Array, ""] | int | None) -> None:
    want, what = (4, "one layer's cache") if layer is None else (5, "caches stacked over layers")
    if cache.ndim != want:
        hint = "" if layer is not None else "; pass layer= to read caches stacked over layers"
        raise ValueError(f"{name}: expected {what}, {want}-d, got shape {cache.shape}{hint}")


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
    k_cache: Float[Array, "*layers batch cache_len kv_heads head_dim"],
    v_cache: Float[Array, "*layers batch cache_len kv_heads head_dim"],
    lengths: Int[Array, " _batch"],  # _: the kernel checks it and names the problem
    *,
    layer: Int[Array, ""] | int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """The newest ``new_tokens`` of each row attend to its cache (see the module docstring).

    Args:
        lengths: valid cache entries per row, the new tokens included.
        layer: with caches stacked over layers, the layer to read (module docstring).
        window, softcap, scale: as ``edl.ops.attention``.
        impl: ``"pallas"``, ``"reference"``, ``"xla"`` or ``"auto"`` (module docstring).
    """
    _check_layer("cached_attention", k_cache, layer)
    cache_len = k_cache.shape[-3]
    if _use_pallas(impl, q, k_cache, "cached_attention"):
        k, v = (_at_layer(x, layer, cache_len) for x in (k_cache, v_cache))
        return decode_attention(q, k, v, lengths, window=window, softcap=softcap, scale=scale)

    def read(length: int) -> jax.Array:
        k, v = (_at_layer(x, layer, length) for x in (k_cache, v_cache))
        mask = cache_mask(q.shape[1], length, lengths, window=window)
        return _plain(impl, q, k, v, mask, softcap=softcap, scale=scale)

    return _read_live(impl, read, jnp.max(lengths), live_lengths(cache_len))


def paged_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Float[Array, "*layers num_pages page_size kv_heads head_dim"],
    v_pages: Float[Array, "*layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "_batch pages_per_seq"],
    lengths: Int[Array, " _batch"],
    *,
    layer: Int[Array, ""] | int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
    live_prefix: bool = True,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``cached_attention`` over a paged cache: row ``b``'s position ``p`` lives at
    ``k_pages[page_table[b, p // page_size], p % page_size]`` (``k_pages[layer, ...]`` with
    pools stacked over layers).

    ``impl``:

    - ``"pallas"``: ``edl.kernels.paged_decode_attention`` (pages read in place).
    - ``"native"``: ``edl.kernels.native.paged_attention_cpu``, a C++ kernel for CPU that
      reads the pages in place (float32 / bfloat16; built on first use).
    - ``"reference"`` / ``"xla"``: each row's pages gathered into a contiguous cache first
      (``"xla"`` on CPU only the pages below the longest row's length, see the module
      docstring, unless ``live_prefix=False``: every page of the table, for a caller that
      trimmed the table to what is live).
    - ``"auto"``: the Pallas kernel on GPU; on CPU the native kernel for at most
      ``NATIVE_MAX_NEW_TOKENS`` new tokens per row where it can run (else ``"xla"``, with a
      warning naming why once; none with ``EDL_NATIVE_KERNELS=0``).
    """
    _check_layer("paged_attention", k_pages, layer)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    few_tokens = q.shape[1] <= NATIVE_MAX_NEW_TOKENS
    if use_native(impl, "paged_attention", (q, k_pages, v_pages), fallback="xla",
                  warned=_warned, eligible=few_tokens):  # fmt: skip
        if layer is None:  # one layer's pools: a leading axis of one (a free reshape)
            k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        native_call = functools.partial(
            native.paged_attention_cpu, scale=scale, window=window, softcap=softcap
        )
        if impl == "native":
            return native_call(q, k_pages, v_pages, page_table, lengths, layer)
        return jax.lax.platform_dependent(
            q, k_pages, v_pages, page_table, lengths, jnp.asarray(layer, jnp.int32),
            cpu=native_call,
            default=functools.partial(_paged_xla, impl="xla", window=window, softcap=softcap,
                                      scale=scale, live_prefix=live_prefix),
        )  # fmt: skip
    if _use_pallas(impl, q, k_pages, "paged_attention"):
        if layer is not None:
            k_pages, v_pages = k_pages[layer], v_pages[layer]
        return paged_decode_attention(
            q, k_pages, v_pages, page_table, lengths, window=window, softcap=softcap,
            scale=scale,
        )  # fmt: skip
    return _paged_xla(
        q, k_pages, v_pages, page_table, lengths, layer, impl=impl, window=window,
        softcap=softcap, scale=scale, live_prefix=live_prefix,
    )  # fmt: skip


def _paged_xla(
    q, k_pages, v_pages, page_table, lengths, layer, *, impl, window, softcap, scale,
    live_prefix,
):  # fmt: skip
    """``paged_attention``'s gathered form (``"xla"`` / ``"reference"``)."""
    page_size = k_pages.shape[-3]

    def read(num_pages: int) -> jax.Array:
        table = page_table[:, :num_pages]
        k, v = (gather_pages(x, table, layer=layer) for x in (k_pages, v_pages))
        mask = cache_mask(q.shape[1], num_pages * page_size, lengths, window=window)
        return _plain(impl, q, k, v, mask, softcap=softcap, scale=scale)

    if not live_prefix:
        return read(page_table.shape[1])
    bound = -(-jnp.max(lengths) // page_size)  # pages holding the longest row
    return _read_live(impl, read, bound, live_lengths(page_table.shape[1], multiple=1))


def _plain(impl: str, q, k, v, mask, *, softcap: float | None, scale: float | None):
    """The non-Pallas impls over a contiguous cache and its mask."""
    if impl == "reference" or q.shape[1] != 1:
        return masked_attention(q, k, v, mask, softcap=softcap, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # platform_dependent keeps only the branch of the platform being lowered for.
    return jax.lax.platform_dependent(
        q, k, v, mask,
        cpu=functools.partial(cpu.one_token_attention, softcap=softcap, scale=scale),
        default=functools.partial(masked_attention, softcap=softcap, scale=scale),
    )  # fmt: skip


def _use_pallas(impl: str, q: jax.Array, cache: jax.Array, name: str) -> bool:
    """Whether ``impl`` means the Pallas kernel here (``"auto"``: on GPU; it warns once when
    the kernel cannot run there)."""
    if impl not in IMPLS or impl == "cudnn":
        natives = "/native" if name == "paged_attention" else ""
        raise ValueError(
            f"{name}: impl must be one of auto/pallas{natives}/xla/reference, got {impl!r}"
        )
    if impl not in ("auto", "pallas"):
        return False
    if impl == "auto" and jax.default_backend() == "cpu":
        return False  # the interpreted kernel is the slower path on CPU (module docstring)
    reason = pallas_unsupported(q, cache)
    if reason is None:
        return True
    if impl == "pallas":
        raise ValueError(f"{name}: impl='pallas' cannot run: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"edl {name}: {reason}; using impl='xla'", stacklevel=3)
    return False
