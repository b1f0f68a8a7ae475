"""Speculative decoding's verification: which drafted tokens the target model accepts.

Pure functions over arrays, shared by ``generate(..., speculative=...)`` and any other loop
that drafts ``k`` tokens per row and scores them in one target forward (the serving engine's
speculative path can call the same ones). The target's forward over a row's pending token
and its ``k`` drafts gives ``k + 1`` distributions: position ``i`` is the target's choice for
the token after draft ``i`` (position 0: after the pending token). A row accepts a prefix of
its drafts, then one more token from the target (the correction, or a bonus token when every
draft was accepted), so each verification emits ``accepted + 1`` tokens.

- ``greedy_verify``: accept while the draft equals the target's argmax; the extra token is
  the target's argmax after the accepted prefix. The output equals plain greedy decoding's.
- ``rejection_verify``: speculative sampling (Leviathan et al. 2023, Chen et al. 2023):
  accept draft ``x`` with probability ``min(1, p(x) / q(x))``; at the first rejection draw
  from ``norm(max(0, p - q))``; after all ``k``, draw the bonus token from ``p``. Every
  emitted token is then distributed as the target's ``p``, whatever the draft ``q``. A
  deterministic draft (prompt lookup) is ``q = one_hot(x)``: accept with probability
  ``p(x)``, else draw from ``p`` with ``x`` removed.

Drafts marked invalid (a proposer that found fewer than ``k`` tokens) are never accepted
and count as ``q = 0`` there, so a rejection at one of them draws from ``p`` itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

__all__ = ["accepted_prefix", "emitted_tokens", "greedy_verify", "rejection_verify"]


def accepted_prefix(ok: Bool[Array, "batch k"]) -> Int[Array, " batch"]:
    """The length of each row's leading run of ``True``: the drafts accepted before the
    first rejection."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def _at(x: Array, index: Int[Array, " batch"]) -> Array:
    """``x[b, index[b]]`` for each row (axis 1)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


def greedy_verify(
    scores: Float[Array, "batch k1 vocab"],
    drafts: Int[Array, "batch k"],
    valid: Bool[Array, "batch k"],
) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
    """Greedy verification: ``(accepted, next_token)`` per row.

    Args:
        scores: the target's processed scores at the pending token and each draft
            (``k + 1`` positions).
        drafts: the ``k`` drafted tokens; ``valid``: which of them were proposed.
    """
    choice = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    accepted = accepted_prefix(valid & (drafts == choice[:, :-1]))
    return accepted, _at(choice, accepted)


def rejection_verify(
    probs: Float[Array, "batch k1 vocab"],
    draft_probs: Float[Array, "batch k vocab"] | None,
    drafts: Int[Array, "batch k"],
    valid: Bool[Array, "batch k"],
    key: PRNGKeyArray,
) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
    """Speculative sampling's rule: ``(accepted, next_token)`` per row (module docstring).

    Args:
        probs: the target's distribution ``p`` at the pending token and each draft.
        draft_probs: the distribution ``q`` each draft was drawn from, or ``None`` for a
            deterministic draft (``q`` one-hot at the drafted token).
        drafts, valid: the drafted tokens and which of them were proposed.
        key: the randomness of this verification (acceptance tests and the extra token).
    """
    k = drafts.shape[1]
    accept_key, draw_key = jax.random.split(key)
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=2)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        q_all = jax.nn.one_hot(drafts, probs.shape[-1], dtype=probs.dtype)
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=2)[..., 0]
        q_all = draft_probs
    u = jax.random.uniform(accept_key, p_draft.shape, probs.dtype)
    # u < p / q, written without the division (q > 0 wherever the draft was drawn).
    accepted = accepted_prefix(valid & (u * q_draft < p_draft))
    # q at the first rejected position; zero when it was no draft or all k were accepted.
    q_all = jnp.where(valid[..., None], q_all, 0.0)
    q_all = jnp.concatenate([q_all, jnp.zeros_like(q_all[:, :1])], axis=1)
    p_next, q_next = _at(probs, accepted), _at(q_all, accepted)
    residual = jnp.maximum(p_next - q_next, 0.0)
    # p == q leaves nothing (a rejection then has probability 0, reached only by rounding).
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
    token = jax.random.categorical(draw_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, token


def emitted_tokens(
    drafts: Int[Array, "batch k"],
    accepted: Int[Array, " batch"],
    next_token: Int[Array, " batch"],
    pad_id: int,
) -> Int[Array, "batch k1"]:
    """The tokens a verification emits per row: the accepted drafts, then ``next_token``,
    then ``pad_id`` (``accepted + 1`` real tokens of ``k + 1``)."""
    rows, k = drafts.shape
    pos = jnp.arange(k + 1, dtype=jnp.int32)[None]
    padded = jnp.concatenate([drafts, jnp.full((rows, 1), pad_id, drafts.dtype)], axis=1)
    out = jnp.where(pos < accepted[:, None], padded, pad_id)
    return jnp.where(pos == accepted[:, None], next_token[:, None], out)
