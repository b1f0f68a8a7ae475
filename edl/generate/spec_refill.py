"""Speculative verification across LongRoPE's original context (Phi-3's refill).

Plain ``generate`` re-runs the whole sequence when the cache reaches ``refill_length``
(``steps.decode_or_refill``): a query at position ``p`` reads short-factor keys while
``p + 1 <= limit`` and, from then on, long-factor keys everywhere. A verification chunk
(the pending token and ``k`` drafts, positions ``c .. c + k``) may straddle the limit, and one
forward cannot give both. So, per row:

- a chunk is cut at the limit (``chunk_tokens``): only its first ``limit - c`` tokens run,
  and drafts past them count as not proposed, so a row's cache stops exactly at the limit;
- the step at which a live row's cache holds exactly ``limit`` tokens re-runs every row's
  whole sequence (prompt, emitted tokens, pending token, drafts) through the emptied cache
  (``target_logits``), the crossing rows' with the long factors, the others' as before.

Greedy output then equals plain ``generate``'s token for token, as it does inside the limit.
transformers' assisted generation does otherwise: Phi-3's ``prepare_inputs_for_generation``
drops the cache whenever the candidate sequence is longer than the limit while the cache is
not, and re-runs it whole with the long factors, so the logits of the chunk's positions
before the limit read long factors there and its tokens can part from its own greedy
``generate``; edl keeps speculative greedy equal to plain greedy instead.

Each row's LongRoPE factors follow its own length (``with_row_rope_lengths``), since rows
advance apart: a batch's tokens equal ``generate``'s on each prompt alone. A draft model's own
cache is not refilled; that only changes which drafts are accepted, never the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.generate import steps
from edl.generate.steps import CausalLM
from edl.nn.attention import KVCacheLike

__all__ = ["chunk_tokens", "target_logits"]


def chunk_tokens(
    model: CausalLM, cached: Int[Array, " batch"], k: int
) -> Int[Array, " batch"] | None:
    """How many of the ``k + 1`` verified tokens run for each row (cut at the limit for a row
    whose cache holds ``cached < limit`` tokens), or ``None`` for a model without a
    ``refill_length`` (all of them, no refill branch compiled)."""
    limit = steps.refill_length(model)
    if limit is None:
        return None
    return jnp.where(cached < limit, jnp.minimum(k + 1, limit - cached), k + 1).astype(jnp.int32)


def target_logits(
    model: CausalLM,
    tokens: Int[Array, "batch k1"],
    seq: Int[Array, "batch width"],
    cache: KVCacheLike,
    num_new: Int[Array, " batch"] | None,
    live: Bool[Array, " batch"],
) -> tuple[Float[Array, "batch k1 vocab"], KVCacheLike]:
    """The target's float32 logits at each verified position and the cache holding them.

    ``tokens``: each row's pending token and drafts, also in ``seq`` at positions
    ``cache.lengths .. + k`` after the row's tokens so far; ``num_new``: ``chunk_tokens``
    (``None``: a plain ``k + 1``-token forward). Where a ``live`` row's cache holds exactly
    ``refill_length`` tokens, every row's sequence re-runs from an emptied cache."""
    if num_new is None:
        logits, _, cache = steps.forward(model, tokens, cache, every=True)
        return logits, cache
    limit = steps.refill_length(model)
    cached = cache.lengths

    def verify(cache: KVCacheLike) -> tuple[Float[Array, "batch k1 vocab"], KVCacheLike]:
        logits, _, cache = steps.forward(model, tokens, cache, num_new=num_new, every=True)
        return logits, cache

    def refill(cache: KVCacheLike) -> tuple[Float[Array, "batch k1 vocab"], KVCacheLike]:
        emptied = dataclasses.replace(cache, lengths=jnp.zeros_like(cached))
        _, hidden, cache = steps.forward(model, seq, emptied, num_new=cached + num_new)
        index = cached[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        index = jnp.minimum(index, seq.shape[1] - 1)[:, :, None]
        chunk = jnp.take_along_axis(hidden, index, axis=1)
        return model.lm_logits(chunk).astype(jnp.float32), cache

    crossing = jnp.any(live & (cached == limit))
    return jax.lax.cond(crossing, refill, verify, cache)
