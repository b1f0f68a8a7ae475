"""Attention of a few new tokens against a KV cache: the decode-time entry points.

``cached_attention`` takes a contiguous cache ``(batch, cache_len, kv_heads, head_dim)`` with
per-row valid lengths; ``paged_attention`` the same logical cache stored in pages of a shared
pool, ``(num_pages, page_size, kv_heads, head_dim)``, through a ``(batch, pages_per_seq)``
page table. Row ``b``'s queries are its newest tokens, at cache positions
``lengths[b] - new_tokens + i``; they see the cached keys below ``lengths[b]``, causally and
within the sliding window. ``impl`` chooses, per platform the program is lowered for
(``edl.ops.dispatch``, tables :data:`DECODE_KERNELS` and :data:`PAGED_KERNELS`):

- ``"pallas"``: the platform's Pallas decode kernel: ``edl.kernels.decode_attention`` /
  ``paged_decode_attention`` (Triton on GPU, interpreted on CPU), ``edl.kernels.tpu``'s
  (Mosaic) on TPU.
- ``"native"``: ``edl.kernels.native.paged_attention_cpu``, a C++ kernel for CPU that reads
  the cache where it lies (a contiguous cache is a pool of one page per row to it).
- ``"reference"``: ``masked_attention`` under :func:`cache_mask`, the definition.
- ``"xla"``: the same maths arranged for XLA. With one new token per row (a decode step) and
  lowering for CPU it reads the cache in place (``edl.ops.cpu.one_token_attention``).
- ``"auto"``: the Pallas kernel on GPUs and TPUs; on CPU ``"xla"`` for a contiguous cache
  (Pallas only interprets its kernel there; the native kernel, by name, was no faster in
  ``generate``'s decode steps: ``benchmarks/RESULTS.md``, "generate: the native kernel on a
  contiguous cache") and the native kernel for a paged one (at most
  ``NATIVE_MAX_NEW_TOKENS`` new tokens per row).

Attention sinks (``sinks``, GPT-OSS) change only each row's final normalisation: the Pallas
decode kernels for GPU (and interpreted on CPU) take them as one more split in their merge,
the TPU ones as one more term of the softmax's sum at the last step; the native CPU kernel
has none (``"auto"`` uses ``"xla"`` there, warning why when it preferred it). ``"xla"`` /
``"reference"``: ``masked_attention`` with the sinks.

Quantized pages (``edl.ops.kv_quant.QuantizedPages``: an int8 / fp8 KV cache): ``"xla"`` /
``"reference"`` dequantize the pages they gather, in the queries' dtype. The paged kernels
(Pallas on GPU / TPU / interpreted, native on CPU) read the codes and their scales where they
lie and dequantize each block or position after loading it, so ``"auto"`` picks the same
kernel for quantized pages as for float ones.

Caches stacked over layers (``(layers, batch, cache_len, ...)``, as ``edl.generate`` keeps
them) are read at ``layer=``. Lowered for CPU, ``"xla"`` then reads only the live prefix of
that layer: the longest row's length rounded up to one of a few static lengths
(``edl.ops.cpu.live_lengths`` and ``read_live``), sliced straight out of the stack. The
Pallas kernels visit only blocks below each row's length already.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.kernels import decode_attention, native, paged_decode_attention, tpu
from edl.kernels._common import KERNEL_DTYPES, triton_head_dim_reason
from edl.kernels.paged_attention import gather_pages
from edl.ops import cpu
from edl.ops.attention import dtype_reason, masked_attention
from edl.ops.cpu import live_lengths
from edl.ops.dispatch import Kernel, by_platform, never
from edl.ops.kv_quant import QuantizedPages, dequantize_kv
from edl.platforms import platform_dependent

__all__ = [
    "DECODE_KERNELS",
    "NATIVE_MAX_NEW_TOKENS",
    "PAGED_KERNELS",
    "cached_attention",
    "paged_attention",
]

# The native CPU kernel's loops are scalar code over one key at a time: right for decode
# steps, slower than XLA's GEMMs for prompt chunks (benchmarks/RESULTS.md, "serve: paged
# attention read in place on CPU").
NATIVE_MAX_NEW_TOKENS = 4
IMPLS = ("auto", "pallas", "native", "xla", "reference")
PAGED_IMPLS = ("auto", "pallas", "native", "xla", "reference")


def _read_live(
    impl: str, read: Callable[[int], jax.Array], bound: Int[Array, ""], sizes: tuple[int, ...]
) -> jax.Array:
    """``read(sizes[-1])`` (the whole cache), or lowered for CPU and not ``"reference"`` (the
    definition reads the whole cache) the live prefix: ``cpu.read_live``."""
    if impl == "reference":
        return read(sizes[-1])
    live = functools.partial(cpu.read_live, read, sizes=sizes)
    return platform_dependent(bound, cpu=live, default=lambda _: read(sizes[-1]))


def _at_layer(stack: jax.Array, layer: Int[Array, ""] | int | None, length: int) -> jax.Array:
    """``stack[layer, :, :length]`` (``stack[:, :length]`` without a layer), one slice."""
    if layer is None:
        return stack[:, :length]
    layer = jnp.asarray(layer)
    start = (layer, *(jnp.zeros((), layer.dtype),) * (stack.ndim - 1))  # one index dtype (x64)
    return jax.lax.dynamic_slice(stack, start, (1, stack.shape[1], length, *stack.shape[3:]))[0]


def _check_layer(
    name: str, cache: jax.Array | QuantizedPages, layer: Int[Array, ""] | int | None
) -> None:
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
    sinks: Float[Array, " heads"] | None = None,
    impl: str = "auto",
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """The newest ``new_tokens`` of each row attend to its cache (see the module docstring).

    Args:
        lengths: valid cache entries per row, the new tokens included.
        layer: with caches stacked over layers, the layer to read (module docstring).
        window, softcap, scale, sinks: as ``edl.ops.attention``.
        impl: ``"pallas"``, ``"native"``, ``"reference"``, ``"xla"`` or ``"auto"`` (module
            docstring).
    """
    _check_layer("cached_attention", k_cache, layer)
    impl = _checked_impl("cached_attention", impl, IMPLS)
    cache_len = k_cache.shape[-3]
    options = _Options(window=window, softcap=softcap, scale=scale)

    def plain(q, k_cache, v_cache, lengths, layer, sinks):
        def read(length: int) -> jax.Array:
            k, v = (_at_layer(x, layer, length) for x in (k_cache, v_cache))
            mask = cache_mask(q.shape[1], length, lengths, window=window)
            return _plain(impl, q, k, v, mask, softcap=softcap, scale=scale, sinks=sinks)

        return _read_live(impl, read, jnp.max(lengths), live_lengths(cache_len))

    arrays = (q, k_cache, v_cache, lengths, _layer_index(layer), sinks)
    if impl in ("xla", "reference"):
        return plain(*arrays)
    return by_platform("cached_attention", impl, DECODE_KERNELS, options, arrays, fallback=plain)


def paged_attention(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Float[Array, "*layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    v_pages: Float[Array, "*layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    page_table: Int[Array, "_batch pages_per_seq"],
    lengths: Int[Array, " _batch"],
    *,
    layer: Int[Array, ""] | int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
    live_prefix: bool = True,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``cached_attention`` over a paged cache: row ``b``'s position ``p`` lives at
    ``k_pages[page_table[b, p // page_size], p % page_size]`` (``k_pages[layer, ...]`` with
    pools stacked over layers).

    ``impl``: as in the module docstring; ``"reference"`` / ``"xla"`` gather each row's pages
    into a contiguous cache first (``"xla"`` on CPU only the pages below the longest row's
    length, unless ``live_prefix=False``: every page of the table, for a caller that trimmed
    the table to what is live). The kernels read the pages where they lie (and the pools at
    ``layer`` without copying that layer's pool out). ``QuantizedPages`` (an int8 / fp8
    cache): ``"xla"`` / ``"reference"`` dequantize them to ``q``'s dtype as gathered; the
    kernels read codes and scales in place (module docstring).
    """
    _check_layer("paged_attention", k_pages, layer)
    impl = _checked_impl("paged_attention", impl, PAGED_IMPLS)
    options = _Options(window=window, softcap=softcap, scale=scale)
    plain = functools.partial(
        _paged_xla,
        impl=impl,
        window=window,
        softcap=softcap,
        scale=scale,
        live_prefix=live_prefix,
    )
    arrays = (q, k_pages, v_pages, page_table, lengths, _layer_index(layer), sinks)
    if impl in ("xla", "reference"):
        return plain(*arrays)
    return by_platform("paged_attention", impl, PAGED_KERNELS, options, arrays, fallback=plain)


def _paged_xla(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    layer,
    sinks,
    *,
    impl,
    window,
    softcap,
    scale,
    live_prefix,
):
    """``paged_attention``'s gathered form (``"xla"`` / ``"reference"``)."""
    page_size = k_pages.shape[-3]

    def read(num_pages: int) -> jax.Array:
        table = page_table[:, :num_pages]
        k, v = (_gathered(x, table, layer, q.dtype) for x in (k_pages, v_pages))
        mask = cache_mask(q.shape[1], num_pages * page_size, lengths, window=window)
        return _plain(impl, q, k, v, mask, softcap=softcap, scale=scale, sinks=sinks)

    if not live_prefix:
        return read(page_table.shape[1])
    bound = -(-jnp.max(lengths) // page_size)  # pages holding the longest row
    return _read_live(impl, read, bound, live_lengths(page_table.shape[1], multiple=1))


def _gathered(pages, table, layer, dtype) -> jax.Array:
    """Rows' pages as a contiguous cache; quantized pages dequantized to ``dtype``."""
    if not isinstance(pages, QuantizedPages):
        return gather_pages(pages, table, layer=layer)
    codes, scales = (gather_pages(x, table, layer=layer) for x in (pages.values, pages.scales))
    return dequantize_kv(codes, scales, dtype)


def _plain(impl: str, q, k, v, mask, *, softcap: float | None, scale: float | None, sinks=None):
    """The non-Pallas impls over a contiguous cache and its mask."""
    if impl == "reference" or q.shape[1] != 1 or sinks is not None:
        return masked_attention(q, k, v, mask, softcap=softcap, scale=scale, sinks=sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # platform_dependent keeps only the branch of the platform being lowered for.
    return platform_dependent(
        q,
        k,
        v,
        mask,
        cpu=functools.partial(cpu.one_token_attention, softcap=softcap, scale=scale),
        default=functools.partial(masked_attention, softcap=softcap, scale=scale),
    )


def _checked_impl(name: str, impl: str, impls: tuple[str, ...]) -> str:
    """``impl`` checked; a model's ``attention_impl="ring"`` (context parallelism for a
    sharded sequence) is ``"auto"`` here: a decode step's few new tokens shard nothing."""
    if impl == "ring":
        return "auto"
    if impl not in impls:
        raise ValueError(f"{name}: impl must be one of {'/'.join(impls)}, got {impl!r}")
    return impl


def _layer_index(layer: Int[Array, ""] | int | None) -> Int[Array, ""] | None:
    return None if layer is None else jnp.asarray(layer, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The decode ops' static settings, as every kernel of their tables takes them."""

    window: int | None
    softcap: float | None
    scale: float | None


def _dtyped(q, k, v) -> tuple:
    """The operands whose dtypes a kernel checks: all three, or only ``q`` for quantized
    pages (the kernels dequantize the codes to ``q``'s dtype)."""
    return (q,) if isinstance(k, QuantizedPages) else (q, k, v)


def _pallas_dtypes(options: _Options, q, k, v, *_) -> str | None:
    return dtype_reason("the Pallas kernel", KERNEL_DTYPES, *_dtyped(q, k, v))


def _tpu_dtypes(options: _Options, q, k, v, *_) -> str | None:
    return dtype_reason("the TPU kernel", tpu.DTYPES, *_dtyped(q, k, v))


# -- contiguous caches --------------------------------------------------------------------------


def _decode(kernel, **kernel_options):
    def call(options: _Options, q, k_cache, v_cache, lengths, layer, sinks):
        k, v = (_at_layer(x, layer, k_cache.shape[-3]) for x in (k_cache, v_cache))
        options = dataclasses.asdict(options)
        if sinks is not None:
            options["sinks"] = sinks
        return kernel(q, k, v, lengths, **options, **kernel_options)

    return call


def _triton_decode_unsupported(options: _Options, q, k_cache, v_cache, *_) -> str | None:
    if reason := triton_head_dim_reason(q.shape[-1]):
        return reason
    if k_cache.shape[-3] % 16:
        return (
            f"the GPU kernel needs a cache length that is a multiple of 16, got {k_cache.shape[-3]}"
        )
    return _pallas_dtypes(options, q, k_cache, v_cache)


_TRITON_DECODE = Kernel(
    "pallas", _decode(decode_attention, interpret=False), _triton_decode_unsupported
)


def _native_paged(options: _Options, q, k_pages, v_pages, page_table, lengths, layer, sinks):
    (k_pages, v_pages), scales = _codes_and_scales(k_pages, v_pages)
    if layer is None:  # one layer's pools: a leading axis of one (a free reshape)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        scales = {name: x[None] for name, x in scales.items()}
    scale = q.shape[-1] ** -0.5 if options.scale is None else options.scale
    return native.paged_attention_cpu(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        layer,
        scale=scale,
        window=options.window,
        softcap=options.softcap,
        **scales,
    )


def _native_unsupported(options: _Options, q, k_pages, v_pages, *rest) -> str | None:
    if rest[-1] is not None:
        return "the native CPU kernel has no attention sinks"
    return native.unavailable() or dtype_reason(
        "the native CPU kernel", native.DTYPES, *_dtyped(q, k_pages, v_pages)
    )


def _few_tokens(options: _Options, q, *_) -> bool:
    return q.shape[1] <= NATIVE_MAX_NEW_TOKENS


def _native_contiguous(options: _Options, q, k_cache, v_cache, lengths, layer, sinks):
    """A contiguous cache is a pool of one page per row (``page_size = cache_len``): the
    native paged kernel reads it in place, the rows' live positions only."""
    table = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
    return _native_paged(options, q, k_cache, v_cache, table, lengths, layer, sinks)


# Per platform the kernels of ``cached_attention`` (edl.ops.dispatch): on CPU the native and
# the interpreted Pallas kernel only when asked for by name (XLA's form is as fast there).
DECODE_KERNELS: dict[str, tuple[Kernel, ...]] = {
    "cpu": (
        Kernel(
            "native",
            _native_contiguous,
            _native_unsupported,
            preferred=never,
            quiet=lambda: native.turned_off(),
        ),
        Kernel(
            "pallas", _decode(decode_attention, interpret=True), _pallas_dtypes, preferred=never
        ),
    ),
    "cuda": (_TRITON_DECODE,),
    "rocm": (_TRITON_DECODE,),
    "tpu": (Kernel("pallas", _decode(tpu.decode_attention), _tpu_dtypes),),
}


# -- paged caches -------------------------------------------------------------------------------


def _paged(kernel, **kernel_options):
    def call(options: _Options, q, k_pages, v_pages, page_table, lengths, layer, sinks):
        (k_pages, v_pages), extra = _codes_and_scales(k_pages, v_pages)
        if sinks is not None:
            extra["sinks"] = sinks
        return kernel(
            q,
            k_pages,
            v_pages,
            page_table,
            lengths,
            layer=layer,
            **dataclasses.asdict(options),
            **extra,
            **kernel_options,
        )

    return call


def _triton_paged_unsupported(options: _Options, q, k_pages, v_pages, *_) -> str | None:
    page_size = k_pages.shape[-3]
    if reason := triton_head_dim_reason(q.shape[-1]):
        return reason
    if page_size < 16 or page_size & (page_size - 1):
        return f"the GPU kernel needs a page size that is a power of two >= 16, got {page_size}"
    return _pallas_dtypes(options, q, k_pages, v_pages)


def _codes_and_scales(k_pages, v_pages) -> tuple[tuple, dict]:
    """``((k, v), scales)``: float pools and no scales, or a quantized pool's codes and its
    ``k_scales`` / ``v_scales`` keywords (what every paged kernel takes)."""
    if not isinstance(k_pages, QuantizedPages):
        return (k_pages, v_pages), {}
    return (k_pages.values, v_pages.values), {
        "k_scales": k_pages.scales,
        "v_scales": v_pages.scales,
    }


_TRITON_PAGED = Kernel(
    "pallas",
    _paged(paged_decode_attention, interpret=False),
    _triton_paged_unsupported,
)
# Per platform the kernels of ``paged_attention`` (edl.ops.dispatch).
PAGED_KERNELS: dict[str, tuple[Kernel, ...]] = {
    "cpu": (
        Kernel(
            "native",
            _native_paged,
            _native_unsupported,
            preferred=_few_tokens,
            quiet=lambda: native.turned_off(),
        ),
        Kernel(
            "pallas",
            _paged(paged_decode_attention, interpret=True),
            _pallas_dtypes,
            preferred=never,
        ),
    ),
    "cuda": (_TRITON_PAGED,),
    "rocm": (_TRITON_PAGED,),
    "tpu": (
        Kernel(
            "pallas",
            _paged(tpu.paged_decode_attention),
            _tpu_dtypes,
        ),
    ),
}
