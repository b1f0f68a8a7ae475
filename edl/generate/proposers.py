"""Speculative decoding's drafters: ``PROPOSERS``, one ``Proposer`` entry per method.

- ``"ngram"``: prompt lookup (``edl.generate.ngram.propose_ngram``); no model, no state; its
  drafts are deterministic (``q`` one-hot).
- ``"draft"``: a smaller causal LM with the target's vocabulary drafts ``k`` tokens
  autoregressively through its own KV cache (greedy, or sampled from its processed
  distribution ``q`` when the target samples).

A proposer's state travels in the decode loop's state. ``start`` builds it after the
target's prefill, ``propose`` drafts from the token buffer, ``commit`` rolls it back to the
accepted prefix once the target has verified.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from edl._registry import Registry
from edl.generate import steps
from edl.generate.ngram import propose_ngram
from edl.nn.attention import KVCacheLike
from edl.ops.sampling import LogitsProcessor, greedy, sample

__all__ = ["PROPOSERS", "DraftState", "ProposeInputs", "Proposer"]


class ProposeInputs(eqx.Module):
    """What a proposer drafts from: the token buffer (row ``b``'s tokens so far, prompt
    first, are ``seq[b, :lengths[b]]``; the last is the pending token the target has not
    cached yet), the draft model (or ``None``), the processors and this step's key."""

    seq: Int[Array, "batch width"]
    lengths: Int[Array, " batch"]
    key: PRNGKeyArray
    draft_model: Any
    processor: LogitsProcessor = eqx.field(static=True)
    num_tokens: int = eqx.field(static=True)
    do_sample: bool = eqx.field(static=True)
    pad_id: int = eqx.field(static=True)
    ngram: tuple[int, int] = eqx.field(static=True, default=(1, 3))


Proposal = tuple[
    Any, Int[Array, "batch k"], Bool[Array, "batch k"], Float[Array, "batch k vocab"] | None
]


@dataclasses.dataclass(frozen=True)
class Proposer:
    """One drafting method.

    ``start(draft_model, ids, mask, cache_len)`` -> state (after the prompt);
    ``propose(inputs, state)`` -> ``(state, drafts, valid, q)`` with ``q`` the draft's
    distributions, ``None`` when the drafts are deterministic; ``commit(before, after,
    cached, accepted, live)`` -> the state once ``accepted`` drafts were kept (``cached``:
    the target's cache lengths before the verification)."""

    name: str
    needs_model: bool
    start: Callable[..., Any]
    propose: Callable[[ProposeInputs, Any], Proposal]
    commit: Callable[..., Any]


def _ngram_propose(inputs: ProposeInputs, state: None) -> Proposal:
    low, high = inputs.ngram
    drafts, valid = propose_ngram(inputs.seq, inputs.lengths, inputs.num_tokens, low, high)
    return state, drafts, valid, None


class DraftState(eqx.Module):
    """A draft model's cache and ``lag``: 1 where the cache lacks the token before the
    pending one (the last draft, when the target accepted all ``k``: the draft never ran on
    it), 0 elsewhere. The draft's cache length + ``lag`` = the target's."""

    cache: KVCacheLike
    lag: Int[Array, " batch"]


def _draft_start(
    draft_model: Any,
    ids: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"],
    cache_len: int,
) -> DraftState:
    _, cache, _, _ = steps.start(draft_model, ids, mask, cache_len)
    return DraftState(cache, jnp.zeros((ids.shape[0],), jnp.int32))


def _at(x: Int[Array, "batch width"], index: Int[Array, " batch"]) -> Int[Array, " batch"]:
    return jnp.take_along_axis(x, index[:, None], axis=1)[:, 0]


def _catch_up(inputs: ProposeInputs, state: DraftState) -> tuple[Float[Array, "b v"], Any]:
    """The draft model's first step: the pending token, after the token it lacks where
    ``lag`` (two right-padded tokens per row): its logits for the first draft."""
    model, seq, lengths, lag = inputs.draft_model, inputs.seq, inputs.lengths, state.lag
    pending = _at(seq, lengths - 1)
    before = _at(seq, jnp.maximum(lengths - 2, 0))
    lagging = (lag == 1)[:, None]
    pad = jnp.full_like(pending, inputs.pad_id)
    tokens = jnp.where(lagging, jnp.stack([before, pending], 1), jnp.stack([pending, pad], 1))
    logits, _, cache = steps.forward(model, tokens, state.cache, num_new=1 + lag)
    return logits, cache


def _draft_propose(inputs: ProposeInputs, state: DraftState) -> Proposal:
    """``k`` tokens from the draft model: one two-token step, then ``k - 1`` one-token ones;
    its cache ends holding the pending token and the first ``k - 1`` drafts."""
    logits, cache = _catch_up(inputs, state)
    rows, width = inputs.seq.shape
    row_ids = jnp.arange(rows)[:, None]
    positions = jnp.arange(width, dtype=jnp.int32)[None]

    def choose(logits, seq, i):
        valid = positions < (inputs.lengths + i)[:, None]
        scores = inputs.processor(logits, seq, valid)
        if inputs.do_sample:
            token = sample(scores, jax.random.fold_in(inputs.key, i))
        else:
            token = greedy(scores)
        seq = seq.at[row_ids, (inputs.lengths + i)[:, None]].set(token[:, None], mode="drop")
        return token, seq, jax.nn.softmax(scores, axis=-1) if inputs.do_sample else None

    def body(carry, i):
        logits, cache, seq = carry
        token, seq, probs = choose(logits, seq, i)
        logits, cache = steps.decode_step(inputs.draft_model, token, cache)
        return (logits, cache, seq), (token, probs)

    count = inputs.num_tokens - 1
    (logits, cache, seq), (tokens, probs) = jax.lax.scan(
        body, (logits, cache, inputs.seq), jnp.arange(count, dtype=jnp.int32)
    )
    last, _, last_probs = choose(logits, seq, jnp.int32(count))
    drafts = jnp.concatenate([tokens.T, last[:, None]], axis=1)
    q = None if probs is None else jnp.concatenate([probs.swapaxes(0, 1), last_probs[:, None]], 1)
    return DraftState(cache, state.lag), drafts, jnp.ones(drafts.shape, jnp.bool_), q


def _draft_commit(
    before: DraftState,
    after: DraftState,
    cached: Int[Array, " batch"],
    accepted: Int[Array, " batch"],
    live: Bool[Array, " batch"],
) -> DraftState:
    """Keep the pending token and the accepted drafts the draft cache holds (all but the
    last draft); rows that were not live keep their state."""
    k = after.cache.lengths - cached  # the draft cached the pending token and k - 1 drafts
    lengths = jnp.where(live, cached + 1 + jnp.minimum(accepted, k - 1), before.cache.lengths)
    lag = jnp.where(live, (accepted >= k).astype(jnp.int32), before.lag)
    return DraftState(dataclasses.replace(after.cache, lengths=lengths), lag)


PROPOSERS: Registry[Proposer] = Registry(
    "speculative decoding method",
    [
        Proposer(
            "ngram",
            needs_model=False,
            start=lambda *_: None,
            propose=_ngram_propose,
            commit=lambda before, *_: before,
        ),
        Proposer(
            "draft",
            needs_model=True,
            start=_draft_start,
            propose=_draft_propose,
            commit=_draft_commit,
        ),
    ],
)
