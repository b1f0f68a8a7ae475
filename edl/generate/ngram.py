"""Prompt lookup drafting (n-gram matching), as HF's ``prompt_lookup_num_tokens`` and vLLM's
ngram proposer: the tokens that followed an earlier occurrence of the sequence's last
``n`` tokens are proposed as its continuation. Texts that copy from their prompt
(summaries, edits, code, extraction) accept long runs of them.

A pure function of the token buffer, so any decode loop can call it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

__all__ = ["propose_ngram"]


def _matches(
    seq: Int[Array, "batch width"], lengths: Int[Array, " batch"], n: int
) -> Bool[Array, "batch width"]:
    """Where an earlier ``n``-gram equals each row's last ``n`` tokens and is followed by at
    least one token (so the last ``n`` tokens never match themselves)."""
    width = seq.shape[1]
    pos = jnp.arange(width, dtype=jnp.int32)[None]
    tail = jnp.clip(lengths[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None], 0, width - 1)
    suffix = jnp.take_along_axis(seq, tail, axis=1)
    padded = jnp.pad(seq, ((0, 0), (0, n)))
    match = (pos + n < lengths[:, None]) & (lengths[:, None] >= n)
    for i in range(n):
        match &= padded[:, i : i + width] == suffix[:, i : i + 1]
    return match


def propose_ngram(
    seq: Int[Array, "batch width"],
    lengths: Int[Array, " batch"],
    num_tokens: int,
    min_n: int,
    max_n: int,
) -> tuple[Int[Array, "batch k"], Bool[Array, "batch k"]]:
    """Draft up to ``num_tokens`` tokens per row by prompt lookup.

    Each row's sequence is ``seq[b, :lengths[b]]`` (prompt and tokens so far). The longest
    ``n`` in ``[min_n, max_n]`` whose last ``n`` tokens occur earlier wins, and its first
    (earliest) occurrence, as HF's prompt lookup: the draft is the tokens after it, as many
    as exist before the end of the sequence, up to ``num_tokens``.

    Returns:
        ``(drafts, valid)``, ``(batch, num_tokens)`` each: the proposed tokens and which
        positions hold one (a row with no match proposes nothing).
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"propose_ngram: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    rows, width = seq.shape
    start = jnp.zeros((rows,), jnp.int32)
    found = jnp.zeros((rows,), jnp.bool_)
    for n in range(max_n, min_n - 1, -1):  # longest first
        match = _matches(seq, lengths, n)
        has = jnp.any(match, axis=1)
        first = jnp.argmax(match, axis=1).astype(jnp.int32)
        start = jnp.where(has & ~found, first + n, start)
        found = found | has
    pos = start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None]
    drafts = jnp.take_along_axis(seq, jnp.clip(pos, 0, width - 1), axis=1)
    return drafts, found[:, None] & (pos < lengths[:, None])
