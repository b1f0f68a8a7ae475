"""A paged KV cache: one pool of fixed-size pages shared by every sequence.

Each row (sequence) owns the pages its ``page_table`` row lists, in order; position ``p``
of row ``b`` lives in page ``page_table[b, p // page_size]`` at slot ``p % page_size``.
Pages are taken from the pool as rows grow (``reserve``, called by the model before it
writes) and given back by ``free_rows``, so sequences of very different lengths share memory
instead of each holding ``cache_len`` slots. Allocation is a pure function of the cache (the
lowest-numbered free pages go to rows in row order), so it runs inside the compiled decode
loop. Running out of pages is a checked runtime error (``edl.ops.checks.error_if``).

Size the pool from the device's free memory with ``paged_cache_config``, then build it with
``init_paged_cache``. ``kv_cache_dtype="int8"`` / ``"fp8_e4m3"`` (``edl.ops.kv_quant``) stores
the pages quantized, one float32 scale per token and KV head beside them: writes quantize,
reads dequantize (attention through ``"xla"``: no kernel reads quantized pages yet).
The interface is ``edl.generate.KVCache``'s (see ``edl.generate.cache``).
"""

from __future__ import annotations

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from edl.generate.cache import Cache, cache_dims
from edl.models.config import DecoderConfig
from edl.ops.cached_attention import paged_attention
from edl.ops.checks import error_if
from edl.ops.kv_quant import (
    KV_CACHE_DTYPES,
    QuantizedPages,
    bytes_per_token,
    dequantize_kv,
    quantize_kv,
)

__all__ = [
    "PagedCacheConfig",
    "PagedKVCache",
    "free_rows",
    "init_paged_cache",
    "paged_cache_config",
]


@dataclasses.dataclass(frozen=True)
class PagedCacheConfig:
    """Pool geometry: ``num_pages`` pages of ``page_size`` tokens; one sequence may grow to
    ``cache_len`` tokens (``pages_per_seq`` pages)."""

    num_pages: int
    page_size: int
    cache_len: int

    @property
    def pages_per_seq(self) -> int:
        return -(-self.cache_len // self.page_size)


def _page_bytes(
    config: DecoderConfig, page_size: int, dtype: DTypeLike, kv_cache_dtype: str = "auto"
) -> int:
    layers, kv_heads, head_dim = cache_dims(config)
    return layers * page_size * bytes_per_token(kv_cache_dtype, kv_heads, head_dim, dtype)


def _free_device_bytes(device: jax.Device) -> int:
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    # CPU devices report no stats: the host's available physical memory.
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def paged_cache_config(
    config: DecoderConfig,
    *,
    page_size: int = 16,
    cache_len: int,
    memory_fraction: float = 0.9,
    dtype: DTypeLike = jnp.float32,
    device: jax.Device | None = None,
    kv_cache_dtype: str = "auto",
) -> PagedCacheConfig:
    """As many pages as ``memory_fraction`` of ``device``'s free memory holds (EasyDeL's
    ``create_paged_metadata(hbm_utilization, ...)``), for a model with this config
    (``kv_cache_dtype``: pages stored quantized, codes and scales counted).

    Call it after the model's weights are on the device, so they are not counted as free.
    """
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if page_size < 1 or cache_len < 1:
        raise ValueError(f"page_size/cache_len must be >= 1: {page_size}, {cache_len}")
    free = _free_device_bytes(device or jax.devices()[0])
    per_page = _page_bytes(config, page_size, dtype, kv_cache_dtype)
    geometry = PagedCacheConfig(int(free * memory_fraction) // per_page, page_size, cache_len)
    if geometry.num_pages < geometry.pages_per_seq:
        raise ValueError(
            f"paged_cache_config: {memory_fraction:.0%} of {free / 2**30:.2f} GiB free holds "
            f"{geometry.num_pages} pages of {per_page} bytes, fewer than one sequence of "
            f"{cache_len} tokens needs ({geometry.pages_per_seq})"
        )
    return geometry


class PagedKVCache(Cache):
    """Pages ``(layers, num_pages, page_size, kv_heads, head_dim)``, each row's
    ``page_table`` (``-1`` = no page), its ``lengths``, and which pages are ``free``.
    The pools are ``QuantizedPages`` (``edl.ops.kv_quant``) in an int8 / fp8 cache.

    ``whole_table`` (static): the page table's width is already what a step needs (the
    serving engine trims it on the host to a few fixed widths), so attention reads every page
    of it instead of choosing, in the program, how much of it is live (``edl.ops.
    paged_attention``'s ``live_prefix``: one compiled branch per live length and layer).
    ``checked`` (static): ``reserve`` raises, through a host callback, when pages run out or
    a row outgrows its table; the serving engine checks that on the host before each step
    and turns it off, since jax never writes a program holding a host callback to its
    persistent compilation cache."""

    k_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages
    v_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages
    page_table: Int[Array, "batch pages_per_seq"]
    lengths: Int[Array, " batch"]
    free: Bool[Array, " num_pages"]
    fresh: bool = eqx.field(static=True, default=False)
    whole_table: bool = eqx.field(static=True, default=False)
    checked: bool = eqx.field(static=True, default=True)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    def reserve(self, num_new: Int[Array, " batch"]) -> PagedKVCache:
        """Give every row the pages it needs for ``lengths + num_new`` tokens."""
        table, page_size = self.page_table, self.page_size
        pages_per_seq = table.shape[1]
        needed = (self.lengths + num_new + page_size - 1) // page_size
        have = jnp.sum(table >= 0, axis=1, dtype=jnp.int32)
        slot = jnp.arange(pages_per_seq, dtype=jnp.int32)[None]
        wanted = (slot >= have[:, None]) & (slot < needed[:, None])
        rank = jnp.cumsum(wanted.reshape(-1), dtype=jnp.int32).reshape(wanted.shape) - 1
        free_ids = jnp.nonzero(self.free, size=self.num_pages, fill_value=self.num_pages)[0]
        short = jnp.sum(wanted) > jnp.sum(self.free)
        too_long = jnp.any(needed > pages_per_seq)
        if self.checked:  # a host callback: such a program is never in jax's disk cache
            table = error_if(table, short, "PagedKVCache: out of free pages")
            table = error_if(table, too_long, "PagedKVCache: a row outgrew pages_per_seq")
        new_pages = jnp.take(free_ids, rank, mode="clip").astype(jnp.int32)
        table = jnp.where(wanted, new_pages, table)
        taken = jnp.where(wanted, new_pages, self.num_pages).reshape(-1)
        return dataclasses.replace(
            self, page_table=table, free=self.free.at[taken].set(False, mode="drop")
        )

    def _slots(self, new: int) -> tuple[Int[Array, "batch new"], Int[Array, "batch new"]]:
        """Page and in-page slot of each new token (page ``num_pages`` = drop the write)."""
        pos = self.lengths[:, None] + jnp.arange(new, dtype=jnp.int32)[None]
        index = pos // self.page_size
        page = jnp.take_along_axis(self.page_table, index, axis=1, mode="fill", fill_value=-1)
        page = jnp.where(page < 0, self.num_pages, page)
        return page, pos % self.page_size

    def update(
        self,
        layer: Int[Array, ""] | int,
        k: Float[Array, "batch new kv_heads head_dim"],
        v: Float[Array, "batch new kv_heads head_dim"],
    ) -> PagedKVCache:
        """Write ``layer``'s new keys/values into their rows' pages."""
        page, slot = self._slots(k.shape[1])
        index = (layer, page, slot)
        return dataclasses.replace(
            self, k_pages=_written(self.k_pages, index, k), v_pages=_written(self.v_pages, index, v)
        )

    def stored(
        self,
        k: Float[Array, "batch new kv_heads head_dim"],
        v: Float[Array, "batch new kv_heads head_dim"],
    ) -> tuple[
        Float[Array, "batch new kv_heads head_dim"], Float[Array, "batch new kv_heads head_dim"]
    ]:
        """``k``, ``v`` as reads will see them: quantized and back in a quantized cache, so a
        fresh cache's prefill attends to what later steps read (and the serving engine,
        whose prefill reads the pages, computes the same)."""
        if not isinstance(self.k_pages, QuantizedPages):
            return k, v
        fmt = self.k_pages.format
        return tuple(_round_trip(x, fmt) for x in (k, v))

    def _read(self, layer, q, lengths, options):
        quantized = isinstance(self.k_pages, QuantizedPages)
        return paged_attention(
            q if quantized else q.astype(self.k_pages.dtype),
            self.k_pages,
            self.v_pages,
            self.page_table,
            lengths,
            layer=layer,
            live_prefix=not self.whole_table,
            **options,
        )

    def select_rows(self, rows: Int[Array, " new_batch"]) -> PagedKVCache:
        raise NotImplementedError(
            "PagedKVCache cannot copy rows (beam search); use the contiguous KVCache"
        )


def _written(pool, index: tuple, x: jax.Array):
    """``pool`` with ``x`` written at ``index`` (quantized for ``QuantizedPages``)."""
    if isinstance(pool, QuantizedPages):
        return pool.set(index, x)
    return pool.at[index].set(x.astype(pool.dtype), mode="drop")


def _round_trip(x: jax.Array, fmt: str) -> jax.Array:
    return dequantize_kv(*quantize_kv(x, fmt), x.dtype)


def free_rows(cache: PagedKVCache, rows: Bool[Array, " batch"]) -> PagedKVCache:
    """Return the pages of ``rows`` to the pool and empty those rows (finished sequences),
    so new sequences can take their place."""
    owned = cache.page_table >= 0
    released = jnp.where(rows[:, None] & owned, cache.page_table, cache.num_pages).reshape(-1)
    return dataclasses.replace(
        cache,
        page_table=jnp.where(rows[:, None], -1, cache.page_table),
        lengths=jnp.where(rows, 0, cache.lengths),
        free=cache.free.at[released].set(True, mode="drop"),
    )


def init_paged_cache(
    config: DecoderConfig,
    num_pages: int,
    page_size: int,
    *,
    batch: int,
    cache_len: int,
    dtype: DTypeLike = jnp.float32,
    kv_cache_dtype: str = "auto",
) -> PagedKVCache:
    """An empty (``fresh``) paged cache: ``num_pages`` pages of ``page_size`` tokens shared by
    ``batch`` rows of up to ``cache_len`` tokens each (no page assigned yet).
    ``kv_cache_dtype``: an ``edl.ops.kv_quant.KV_CACHE_DTYPES`` name; a quantized one stores
    ``QuantizedPages`` (refused for models with their own cache layout: DeepSeek-V3's
    latents, Qwen3-Next's states)."""
    quantized = KV_CACHE_DTYPES.lookup(kv_cache_dtype, "kv_cache_dtype").quantized
    if quantized:
        check_quantizable(config, kv_cache_dtype)
    geometry = PagedCacheConfig(num_pages, page_size, cache_len)
    if num_pages < 1 or page_size < 1 or batch < 1:
        raise ValueError(
            f"init_paged_cache: num_pages, page_size and batch must be >= 1, got "
            f"{num_pages}, {page_size}, {batch}"
        )
    layers, kv_heads, head_dim = cache_dims(config)
    shape = (layers, num_pages, page_size, kv_heads, head_dim)
    pages = QuantizedPages.zeros(shape, kv_cache_dtype) if quantized else jnp.zeros(shape, dtype)
    return PagedKVCache(
        pages,
        pages,
        jnp.full((batch, geometry.pages_per_seq), -1, jnp.int32),
        jnp.zeros((batch,), jnp.int32),
        jnp.ones((num_pages,), jnp.bool_),
        fresh=True,
    )


def check_quantizable(config: DecoderConfig, kv_cache_dtype: str) -> None:
    """Refuse a quantized KV cache for a model whose cache is not plain keys / values."""
    own = (
        "DeepSeek-V3's latent cache"
        if getattr(config, "latent_cache_dim", None) is not None
        or getattr(config, "cache_geometry", None) is not None
        else "Qwen3-Next's recurrent states beside its pages"
        if getattr(config, "kv_cache_layers", None) is not None
        else None
    )
    if own is not None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: not supported for "
            f"{type(config).__name__} ({own}); use kv_cache_dtype='auto'"
        )


def pages_in_use(cache: PagedKVCache) -> int:
    """How many pages rows hold (host-side, for monitoring)."""
    return int(np.sum(~np.asarray(cache.free)))
