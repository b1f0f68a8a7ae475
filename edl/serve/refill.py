"""The serving engine's LongRoPE refill (Phi-3 / Phi-4-mini): host planning, no jax.

transformers' Phi-3 re-runs a sequence whole when it first grows past
``original_max_position_embeddings`` (``edl.generate.steps.refill_length``, the ``limit``),
so that every key, cached ones included, is rotated by the long factors from then on, and
``generate`` does the same. The engine keeps each request to that rule on its own (its rows'
factors follow their own lengths, ``with_row_rope_lengths``):

- **prefill**: a prompt's chunks all read the factors of the whole prompt's length
  (``rope_floor``: ``model_step``'s ``rope_min_length``), as ``generate``'s one-call prefill
  does; without it a prompt longer than the limit would rotate its first chunks by the
  short factors.
- **crossing**: before the decode call that feeds a request's token at position ``limit``
  (its cache then holds exactly ``limit`` tokens), the engine re-runs those ``limit`` tokens
  (prompt and generated) through the request's own pages with the long factors
  (``refill_chunks``: prefill-shaped calls, one row, ``prefill_chunk`` tokens each, their
  logits dropped); the decode call then reads long-factor keys only, as ``generate``'s
  refill. Other rows' pages and calls are untouched.
- **speculation**: a verification chunk is cut at the limit (``cap_drafts``), so a cache
  reaches it exactly and never holds short-factor keys past it.
- **prefix pages** are never overwritten: a request that can reach the limit
  (``may_share``) neither takes shared prefix pages nor publishes its own, so its pages are
  its alone when the refill rewrites them (unshared from admission rather than copied on
  write at the crossing: a copy would need free pages the admission did not reserve).
  Requests that stay inside the limit share as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from edl.serve.requests import Request
from edl.serve.shapes import bucket

__all__ = ["cap_drafts", "crossing", "may_share", "refill_chunks", "rope_floor"]


def may_share(limit: int | None, prompt_len: int, max_tokens: int) -> bool:
    """Whether a request may use prefix-cached pages: always without a ``limit``; with one,
    when its prompt is within it and no decode call feeds a token at position ``limit``
    (the last one fed is at ``prompt_len + max_tokens - 2``)."""
    return limit is None or (prompt_len <= limit and prompt_len + max_tokens - 2 < limit)


def rope_floor(limit: int | None, requests: Sequence[Request], rows: int) -> np.ndarray | None:
    """A call's ``rope_min_length`` ``(rows,)``: a prefilling request's prompt length (its
    chunks read the whole prompt's factors), 0 elsewhere; None without a ``limit`` (the
    model's programs stay as they were)."""
    if limit is None:
        return None
    floor = np.zeros(rows, np.int32)
    for i, r in enumerate(requests):
        if r.prefilling:
            floor[i] = len(r.prompt)
    return floor


def crossing(limit: int | None, decoding: Sequence[Request]) -> list[Request]:
    """The decoding requests whose next call feeds the token at position ``limit``."""
    if limit is None:
        return []
    return [r for r in decoding if r.computed == limit]


def cap_drafts(
    limit: int | None, decoding: Sequence[Request], drafts: list[np.ndarray] | None
) -> list[np.ndarray] | None:
    """``drafts`` cut so that no verification runs past ``limit`` from below (a request's
    pending token and drafts fill positions ``computed .. computed + len(d)``); None when
    no request keeps a draft (the plain decode call)."""
    if limit is None or drafts is None:
        return drafts
    out = [
        d[: max(0, limit - r.computed - 1)] if r.computed < limit else d
        for r, d in zip(decoding, drafts, strict=True)
    ]
    return out if any(len(d) for d in out) else None


def refill_chunks(
    request: Request,
    limit: int,
    chunk: int,
    page_size: int,
    width_buckets: tuple[int, ...],
    page_buckets: tuple[int, ...],
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The one-row calls that re-run ``request``'s first ``limit`` tokens through its own
    pages: ``(tokens (1, width), num_new (1,), lengths (1,), table (1, pages))`` per chunk of
    at most ``chunk`` tokens, in the prefill shapes (``width`` and ``pages`` from their
    buckets)."""
    history = (*request.prompt, *request.generated)[:limit]
    if len(history) != limit or request.computed != limit:
        raise RuntimeError(
            f"Engine refill: request {request.id} holds {request.computed} tokens and "
            f"{len(history)} known, expected {limit} (the original context) of each"
        )
    for start in range(0, limit, chunk):
        new = history[start : start + chunk]
        width = bucket(width_buckets, len(new))
        pages = bucket(page_buckets, -(-(start + len(new)) // page_size))
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(new)] = new
        table = np.full((1, pages), -1, np.int32)
        table[0, : min(len(request.pages), pages)] = request.pages[:pages]
        yield tokens, np.array([len(new)], np.int32), np.array([start], np.int32), table
