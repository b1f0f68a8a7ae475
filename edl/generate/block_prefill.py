"""The prefill of a prompt whose images attend to themselves both ways (Gemma 3).

transformers' Gemma 3 ``generate`` passes the processor's ``token_type_ids`` to the prefill
only: the tokens of one image see each other both ways there, and every later token decodes
causally over the cache. ``BlockPrefill`` wraps a fresh cache for that one call: it writes the
keys and values into the cache as usual, and the new tokens attend to each other with the
blocks' mask (``edl.ops.block_attention``), which a fresh cache's prefill reads from the new
tokens alone. ``unwrap`` gives the filled cache back for decoding.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int

from edl.nn.attention import KVCacheLike
from edl.ops.attention import attention
from edl.ops.block_attention import BidirectionalBlocks, block_ids

__all__ = ["BlockPrefill", "unwrap"]


class BlockPrefill(eqx.Module):
    """A fresh cache (``inner``) whose prefill opens each block of ``blocks`` ``(batch,
    seq)`` (ids ``>= 0``; ``-1`` elsewhere) both ways."""

    inner: Any  # a fresh KVCacheLike
    blocks: Int[Array, "batch seq"]

    @classmethod
    def of(cls, cache: KVCacheLike, is_image: Bool[Array, "batch seq"]) -> BlockPrefill:
        """``cache`` (fresh) for a prefill whose image tokens are ``is_image``."""
        if not getattr(cache, "fresh", False):
            raise ValueError(
                f"BlockPrefill: a {type(cache).__name__} that already holds tokens; images "
                "attend both ways only in a prompt's prefill"
            )
        return cls(cache, block_ids(is_image.astype(jax.numpy.int32)))

    @property
    def lengths(self) -> Int[Array, " batch"]:
        return self.inner.lengths

    def reserve(self, num_new: Int[Array, " batch"]) -> BlockPrefill:
        return BlockPrefill(self.inner.reserve(num_new), self.blocks)

    def advance(self, num_new: Int[Array, " batch"]) -> BlockPrefill:
        return BlockPrefill(self.inner.advance(num_new), self.blocks)

    def update(self, layer: jax.Array | int, k: jax.Array, v: jax.Array) -> BlockPrefill:
        return BlockPrefill(self.inner.update(layer, k, v), self.blocks)

    def attend(
        self,
        layer: jax.Array | int,
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
        """The new tokens attend to each other (the cache was fresh): causal, each block
        both ways; right padding is never a block and lies after every real token."""
        del layer
        segments = BidirectionalBlocks.of(None, self.blocks)
        options = dict(window=window, softcap=softcap, scale=scale, sinks=sinks, impl=impl)
        return attention(q, k, v, causal=True, segment_ids=segments, **options)


def unwrap(cache: Any) -> Any:
    """The cache inside a ``BlockPrefill``; any other cache as it is."""
    return cache.inner if isinstance(cache, BlockPrefill) else cache
