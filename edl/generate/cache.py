"""KV caches as pytrees: a preallocated contiguous cache and a paged one.

Both hold every layer's keys and values (a leading layer axis, like the model's stacked
layers) and each row's number of valid tokens. A model run on ``n`` new tokens per row calls,
in this order::

    cache = cache.reserve(num_new)            # paged: allocate pages for the new tokens
    cache = cache.update(layer, k, v)         # per layer: write the new keys/values
    out = cache.attend(layer, q, k, v, ...)   # per layer: the new queries attend
    cache = cache.advance(num_new)            # after the last layer: lengths += num_new

Row ``b``'s new tokens go to positions ``lengths[b] + i``. Rows may have fewer valid new
tokens than the array holds (right padding, as generation's prefill has): positions past a
row's ``lengths[b] + num_new[b]`` are written but never read, and writes past the cache's
end are dropped.

A cache straight from ``init_cache`` is ``fresh`` (a static flag, so prefill and decode are
separate compiled programs): its new tokens attend only to each other, through the
training-time ``edl.ops.attention`` (the flash kernel), which is how a whole prompt is
prefilled efficiently. Later calls attend over the cache (``edl.ops.cached_attention``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from edl.models.config import DecoderConfig
from edl.ops.attention import attention
from edl.ops.cached_attention import cached_attention

__all__ = [
    "Cache",
    "KVCache",
    "LatentKVCache",
    "init_cache",
]

CACHE_MULTIPLE = 16  # cache lengths are rounded up to this (the GPU decode kernel's block)


def cache_dims(config: DecoderConfig) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a model config (HF field names), or the
    config's own ``cache_geometry`` (DeepSeek-V3's MLA: one latent head)."""
    geometry = getattr(config, "cache_geometry", None)
    if geometry is not None:
        return geometry
    try:
        # A hybrid model (Qwen3-Next) caches keys / values of its attention layers only.
        layers = getattr(config, "kv_cache_layers", None) or config.num_hidden_layers
        return layers, config.num_key_value_heads, config.head_dim
    except AttributeError as e:
        raise TypeError(f"init_cache: {type(config).__name__} lacks a field: {e}") from None


def _new_positions(lengths: Int[Array, " batch"], new: int) -> Int[Array, "batch new"]:
    return lengths[:, None] + jnp.arange(new, dtype=lengths.dtype)[None]


class Cache(eqx.Module):
    """What the contiguous and the paged cache share: how new queries attend and how
    ``lengths`` advance; each cache says only how it reads its keys and values
    (``_read``). A cache holds ``lengths`` ``(batch,)`` and the static flag ``fresh``."""

    @abc.abstractmethod
    def _read(
        self,
        layer: Int[Array, ""] | int,
        q: Float[Array, "batch new heads head_dim"],
        lengths: Int[Array, " batch"],
        options: dict[str, Any],
    ) -> Float[Array, "batch new heads head_dim"]:
        """``q`` (in the cache's dtype) attending to each row's first ``lengths`` tokens
        of layer ``layer``, the new ones included."""

    def attend(
        self,
        layer: Int[Array, ""] | int,
        q: Float[Array, "batch new heads head_dim"],
        k: Float[Array, "batch new kv_heads head_dim"],
        v: Float[Array, "batch new kv_heads head_dim"],
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        sinks: Float[Array, " heads"] | None = None,
        impl: str = "auto",
    ) -> Float[Array, "batch new heads head_dim"]:
        """The new queries attend to the cache (after ``update`` of this layer); a fresh
        cache's new tokens attend only to each other (the flash kernel: a whole prefill).
        ``sinks``: GPT-OSS's attention sinks (``edl.ops.attention``)."""
        options = dict(window=window, softcap=softcap, scale=scale, sinks=sinks, impl=impl)
        if self.fresh:
            k, v = self.stored(k, v)
            return attention(q, k, v, causal=True, **options)
        return self._read(layer, q, self.lengths + q.shape[1], options).astype(q.dtype)

    def stored(
        self,
        k: Float[Array, "batch new kv_heads head_dim"],
        v: Float[Array, "batch new kv_heads head_dim"],
    ) -> tuple[
        Float[Array, "batch new kv_heads head_dim"], Float[Array, "batch new kv_heads head_dim"]
    ]:
        """``k``, ``v`` as later reads of the cache see them (a quantized cache rounds them)."""
        return k, v

    def advance(self, num_new: Int[Array, " batch"]) -> Cache:
        """``lengths += num_new`` once every layer has been updated."""
        return dataclasses.replace(self, lengths=self.lengths + num_new, fresh=False)


class KVCache(Cache):
    """Contiguous cache: keys/values ``(layers, batch, cache_len, kv_heads, head_dim)``."""

    k: Float[Array, "layers batch cache_len kv_heads head_dim"]
    v: Float[Array, "layers batch cache_len kv_heads head_dim"]
    lengths: Int[Array, " batch"]
    fresh: bool = eqx.field(static=True, default=False)

    @property
    def cache_len(self) -> int:
        return self.k.shape[2]

    def reserve(self, num_new: Int[Array, " batch"]) -> KVCache:
        """Nothing to allocate: every row owns ``cache_len`` slots."""
        del num_new
        return self

    def update(
        self,
        layer: Int[Array, ""] | int,
        k: Float[Array, "batch new kv_heads head_dim"],
        v: Float[Array, "batch new kv_heads head_dim"],
    ) -> KVCache:
        """Write ``layer``'s new keys/values at positions ``lengths[b] + i``."""
        new = k.shape[1]
        k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        if self.fresh:  # every row starts at 0: one contiguous write
            if new > self.cache_len:
                raise ValueError(
                    f"KVCache: {new} new tokens exceed the cache length {self.cache_len}"
                )
            start = (layer, 0, 0, 0, 0)
            return dataclasses.replace(
                self,
                k=jax.lax.dynamic_update_slice(self.k, k[None], start),
                v=jax.lax.dynamic_update_slice(self.v, v[None], start),
            )
        rows = jnp.arange(k.shape[0])[:, None]
        pos = _new_positions(self.lengths, new)
        return dataclasses.replace(
            self,
            k=self.k.at[layer, rows, pos].set(k, mode="drop"),
            v=self.v.at[layer, rows, pos].set(v, mode="drop"),
        )

    def _read(self, layer, q, lengths, options):
        return cached_attention(
            q.astype(self.k.dtype), self.k, self.v, lengths, layer=layer, **options
        )

    def select_rows(self, rows: Int[Array, " new_batch"]) -> KVCache:
        """The cache of rows ``rows`` (repeat a prompt for beams, reorder beams)."""
        return dataclasses.replace(
            self,
            k=jnp.take(self.k, rows, axis=1),
            v=jnp.take(self.v, rows, axis=1),
            lengths=jnp.take(self.lengths, rows, axis=0),
        )


class LatentKVCache(Cache):
    """Contiguous cache of MLA's compressed latents, ``(layers, batch, cache_len, 1,
    kv_lora_rank + qk_rope_head_dim)``: one array that is both the keys and the values of
    the absorbed attention (``edl.ops.mla``; the values are its first ``kv_lora_rank``
    features, cut from the output by the model), so nothing is stored twice."""

    latent: Float[Array, "layers batch cache_len 1 latent_dim"]
    lengths: Int[Array, " batch"]
    fresh: bool = eqx.field(static=True, default=False)

    def reserve(self, num_new: Int[Array, " batch"]) -> LatentKVCache:
        del num_new
        return self

    def update(
        self,
        layer: Int[Array, ""] | int,
        k: Float[Array, "batch new 1 latent_dim"],
        v: Float[Array, "batch new 1 latent_dim"] | None = None,
    ) -> LatentKVCache:
        """Write ``layer``'s new latents ``k`` (``v``, the same latents, is not stored)."""
        del v
        as_kv = KVCache(self.latent, self.latent, self.lengths, fresh=self.fresh)
        return dataclasses.replace(self, latent=as_kv.update(layer, k, k).k)

    def _read(self, layer, q, lengths, options):
        latent = self.latent
        return cached_attention(
            q.astype(latent.dtype), latent, latent, lengths, layer=layer, **options
        )

    def select_rows(self, rows: Int[Array, " new_batch"]) -> LatentKVCache:
        """The cache of rows ``rows`` (beams)."""
        return dataclasses.replace(
            self,
            latent=jnp.take(self.latent, rows, axis=1),
            lengths=jnp.take(self.lengths, rows, axis=0),
        )


def init_cache(
    config: DecoderConfig, batch: int, cache_len: int, dtype: DTypeLike = jnp.float32
) -> KVCache | LatentKVCache:
    """An empty (``fresh``) cache for ``batch`` rows of up to ``cache_len`` tokens (rounded up
    to a multiple of 16) for a model with this config (HF field names: ``num_hidden_layers``,
    ``num_key_value_heads``, ``head_dim``; a config's ``cache_geometry`` where it has one). A
    config with a ``latent_cache_dim`` (DeepSeek-V3's MLA) gets a ``LatentKVCache``."""
    if batch < 1 or cache_len < 1:
        raise ValueError(f"init_cache: batch and cache_len must be >= 1, got {batch}, {cache_len}")
    layers, kv_heads, head_dim = cache_dims(config)
    cache_len = -(-cache_len // CACHE_MULTIPLE) * CACHE_MULTIPLE
    zeros = jnp.zeros((layers, batch, cache_len, kv_heads, head_dim), dtype)
    if getattr(config, "latent_cache_dim", None) is not None:  # MLA: keys are the values
        return LatentKVCache(zeros, jnp.zeros((batch,), jnp.int32), fresh=True)
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32), fresh=True)
