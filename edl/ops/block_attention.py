"""Attention in which the tokens of one block also see each other's future: Gemma 3's images.

transformers' Gemma 3 (``Gemma3ForConditionalGeneration`` given ``token_type_ids``) lets the
tokens of one image attend to each other both ways: the full layers' mask is
``causal OR same block``, the sliding layers' ``window AND (causal OR same block)``
(``masking_utils.blockwise_overlay``, ``sliding_window_overlay``: key ``k`` is in query
``q``'s window when ``k > q - window``, so a block's later tokens pass it), each AND the
padding mask. ``BidirectionalBlocks`` carries the block ids with the padding segments and is
handed to ``edl.ops.attention`` as its ``segment_ids``: that call then computes with the XLA
path (``edl.ops.attention_xla``) and this mask on every platform, as no kernel takes an
arbitrary mask.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.ops.attention_xla import xla_attention

__all__ = ["BidirectionalBlocks", "block_ids"]


def block_ids(token_type_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Block ids of ``token_type_ids`` (1 for image tokens): each run of image tokens gets
    its own id ``0, 1, ...`` per row, other tokens ``-1`` (transformers'
    ``get_block_sequence_ids_for_mask``)."""
    is_image = token_type_ids == 1
    previous = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = jnp.cumsum((is_image & ~previous).astype(jnp.int32), axis=1) - 1
    return jnp.where(is_image, starts, -1)


class BidirectionalBlocks(eqx.Module):
    """``segment_ids`` for ``edl.ops.attention`` (``edl.ops.padding_segments``' pair) plus
    block ids (``-1`` outside blocks) for queries and keys: a query sees a key of its own
    segment that the causal / window mask allows, or that lies in its own block."""

    q_ids: Int[Array, "batch q_len"]
    kv_ids: Int[Array, "batch kv_len"]
    q_blocks: Int[Array, "batch q_len"]
    kv_blocks: Int[Array, "batch kv_len"]

    @classmethod
    def of(
        cls,
        segments: tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]] | None,
        blocks: Int[Array, "batch seq"],
    ) -> BidirectionalBlocks:
        """Self-attention's blocks over ``segments`` (``None``: one segment per row)."""
        if segments is None:
            segments = (jnp.ones(blocks.shape, jnp.int32),) * 2
        return cls(segments[0], segments[1], blocks, blocks)

    def mask(self, causal: bool, window: int | None) -> Bool[Array, "batch q_len kv_len"]:
        """Which keys each query sees (queries are the last ``q_len`` positions)."""
        q_len, kv_len = self.q_ids.shape[1], self.kv_ids.shape[1]
        q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
        k_pos = jnp.arange(kv_len)[None, :]
        same = (self.q_blocks[:, :, None] == self.kv_blocks[:, None, :]) & (
            self.q_blocks[:, :, None] >= 0
        )
        allowed = jnp.ones_like(same)
        if causal or window is not None:  # a window implies causal, as in edl.ops.attention
            allowed = (k_pos <= q_pos)[None] | same
        if window is not None:
            allowed &= (q_pos - k_pos < window)[None]
        return allowed & (self.q_ids[:, :, None] == self.kv_ids[:, None, :])

    def attend(
        self,
        q: Float[Array, "batch q_len heads head_dim"],
        k: Float[Array, "batch kv_len kv_heads head_dim"],
        v: Float[Array, "batch kv_len kv_heads head_dim"],
        *,
        causal: bool,
        window: int | None,
        softcap: float | None,
        scale: float | None,
        sinks: Float[Array, " heads"] | None,
    ) -> Float[Array, "batch q_len heads head_dim"]:
        """``edl.ops.attention``'s result with this mask (the XLA path)."""
        if self.q_ids.shape[1] != q.shape[1] or self.kv_ids.shape[1] != k.shape[1]:
            raise ValueError(
                f"BidirectionalBlocks of lengths {self.q_ids.shape[1]}/{self.kv_ids.shape[1]} "
                f"for q_len {q.shape[1]} / kv_len {k.shape[1]}"
            )
        logit_scale = q.shape[-1] ** -0.5 if scale is None else scale
        mask = self.mask(causal, window)
        return xla_attention(q, k, v, mask, scale=logit_scale, softcap=softcap, sinks=sinks)
