"""Logits processors and token sampling for generation, with transformers' semantics.

A :data:`LogitsProcessor` is a pure function ``(logits, tokens, valid) -> logits``: ``logits``
is the float32 ``(batch, vocab)`` next-token scores, ``tokens`` the fixed-size ``(batch, seq)``
buffer of everything so far (prompt + generated) and ``valid`` marks which buffer entries are
real tokens. The factories below validate their arguments eagerly and return such functions;
all of them are shape-static and jittable, so a generation loop can call them inside
``lax.while_loop``. Filtered logits are ``-inf``. Chain them with :func:`compose`, or build
transformers' chain from ``generate``-style arguments with :func:`processors_for`, then pick a
token with :func:`sample` or :func:`greedy`.

Deviations from transformers, all on measure-zero inputs unless stated:

* ``repetition_penalty`` only penalises tokens where ``valid`` is True. HF's processor
  penalises every id in ``input_ids``, including pad ids (``generate`` skips only left padding
  via ``prompt_ignore_length``); edl deliberately never penalises padding or empty slots.
* Ties at a cut-off are all kept. ``top_k`` does exactly what HF does (keeps every logit
  ``>=`` the k-th largest, so possibly more than k). ``top_p`` and ``min_p``'s
  ``min_tokens_to_keep`` keep every token tied with the last kept one, where HF keeps a subset
  that depends on ``torch.sort``/``torch.topk`` order; ``min_p`` ranks those by logit.
* Out-of-range ids in ``tokens`` (negative, or ``>= vocab``) are ignored, as HF ignores ids
  ``>= vocab``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

__all__ = [
    "LogitsProcessor",
    "compose",
    "greedy",
    "min_p",
    "processors_for",
    "repetition_penalty",
    "sample",
    "suppress_tokens",
    "temperature",
    "top_k",
    "top_p",
]

Logits = Float[Array, "batch vocab"]
Tokens = Int[Array, "batch seq"]
Valid = Bool[Array, "batch seq"]
LogitsProcessor = Callable[[Logits, Tokens, Valid], Logits]


def _real(name: str, value: object, ok: Callable[[float], bool], expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(float(value)):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _keep_from(logits: Logits, cutoff: Float[Array, "batch 1"]) -> Logits:
    """``-inf`` wherever ``logits < cutoff`` (so ties with the cut-off are kept)."""
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def _kth_largest(logits: Logits, k: int) -> Float[Array, "batch 1"]:
    k = min(k, logits.shape[-1])
    return jax.lax.top_k(logits, k)[0][:, k - 1 :]


def temperature(t: float) -> LogitsProcessor:
    """``logits / t`` (HF ``TemperatureLogitsWarper``); ``t`` must be finite and > 0."""
    t = _real(
        "temperature",
        t,
        lambda v: 0 < v < math.inf,
        "a finite float > 0 (for greedy decoding use greedy())",
    )

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        return logits / t

    return apply


def top_k(k: int, min_tokens_to_keep: int = 1) -> LogitsProcessor:
    """Keep logits ``>=`` the ``max(k, min_tokens_to_keep)``-th largest (HF ``TopKLogitsWarper``).

    Like HF (``scores < topk(scores, k).values[..., -1]``), every logit tied with the k-th
    largest is kept, so more than k tokens may survive. ``k`` above the vocab keeps everything.
    """
    k = max(_positive_int("top_k", k), _positive_int("min_tokens_to_keep", min_tokens_to_keep))

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        return _keep_from(logits, _kth_largest(logits, k))

    return apply


def top_p(p: float, min_tokens_to_keep: int = 1) -> LogitsProcessor:
    """Nucleus filtering (HF ``TopPLogitsWarper``), ``p`` in [0, 1].

    As HF: sort ascending, drop the tokens whose cumulative softmax is ``<= 1 - p`` but never
    the ``min_tokens_to_keep`` largest. ``p = 0`` keeps only those; ``p = 1`` drops only tokens
    whose probability underflows to 0. Tokens tied with the smallest kept logit are kept.
    """
    p = _real("top_p", p, lambda v: 0 <= v <= 1, "a float in [0, 1]")
    keep = _positive_int("min_tokens_to_keep", min_tokens_to_keep)
    threshold = 1.0 - p  # computed in Python as HF does, then compared in float32

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        ascending = jnp.sort(logits, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        rank = jnp.arange(logits.shape[-1]).reshape(1, -1)
        remove = (cumulative <= threshold) & (rank < logits.shape[-1] - keep)
        cutoff = jnp.min(jnp.where(remove, jnp.inf, ascending), axis=-1, keepdims=True)
        return _keep_from(logits, cutoff)

    return apply


def min_p(p: float, min_tokens_to_keep: int = 1) -> LogitsProcessor:
    """Drop tokens with probability ``< p * max probability`` (HF ``MinPLogitsWarper``).

    ``p`` in [0, 1]; the ``min_tokens_to_keep`` highest logits (and any tied with them) always
    survive.
    """
    p = _real("min_p", p, lambda v: 0 <= v <= 1, "a float in [0, 1]")
    keep = _positive_int("min_tokens_to_keep", min_tokens_to_keep)

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        probs = jax.nn.softmax(logits, axis=-1)
        remove = probs < p * jnp.max(probs, axis=-1, keepdims=True)
        remove = remove & (logits < _kth_largest(logits, keep))
        return jnp.where(remove, -jnp.inf, logits)

    return apply


def repetition_penalty(penalty: float) -> LogitsProcessor:
    """CTRL's penalty (HF ``RepetitionPenaltyLogitsProcessor``) on every token seen so far.

    For each vocab id occurring at a ``valid`` position of ``tokens`` (once, however often it
    occurs): negative logits are multiplied by ``penalty``, others divided by it. Unlike HF,
    invalid positions (padding, unfilled slots) are never penalised, whatever id they hold.
    """
    penalty = _real("repetition_penalty", penalty, lambda v: 0 < v < math.inf, "a float > 0")

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        batch, vocab = logits.shape
        ids = jnp.where(valid & (tokens >= 0) & (tokens < vocab), tokens, vocab)  # vocab: dropped
        rows = jnp.broadcast_to(jnp.arange(batch).reshape(-1, 1), ids.shape)
        seen = jnp.zeros((batch, vocab + 1), jnp.bool_).at[rows, ids].set(True)[:, :vocab]
        penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
        return jnp.where(seen, penalised, logits)

    return apply


def suppress_tokens(ids: Iterable[int]) -> LogitsProcessor:
    """Set the given vocab ids to ``-inf`` (HF ``SuppressTokensLogitsProcessor``).

    Ids ``>= vocab`` are ignored, as HF's ``isin`` ignores them; negative ids are an error.
    """
    ids = tuple(ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise ValueError(f"suppress_tokens: ids must be non-negative integers, got {i!r}")

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        mask = np.isin(np.arange(logits.shape[-1]), np.asarray(ids, np.int64)).reshape(1, -1)
        return jnp.where(mask, -jnp.inf, logits)

    return apply


def compose(*processors: LogitsProcessor) -> LogitsProcessor:
    """One processor applying ``processors`` left to right (none: the identity)."""

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        for processor in processors:
            logits = processor(logits, tokens, valid)
        return logits

    return apply


# processors_for's keyword arguments shadow the factories of the same names.
_temperature, _top_k, _top_p, _min_p = temperature, top_k, top_p, min_p
_repetition_penalty = repetition_penalty


def processors_for(
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
) -> LogitsProcessor:
    """transformers' sampling chain (``GenerationMixin._get_logits_processor``, ``do_sample``).

    Order as HF: repetition penalty, temperature, top-k, top-p, min-p. Skipped exactly where HF
    skips them: ``None``, ``repetition_penalty == 1.0``, ``temperature == 1.0``, ``top_k == 0``,
    ``top_p >= 1.0`` (``top_p > 1`` is rejected rather than ignored); ``min_p`` is applied
    whenever given. Every other value is validated by its factory.
    """
    chain: list[LogitsProcessor] = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        chain.append(_repetition_penalty(repetition_penalty))
    if temperature is not None and temperature != 1.0:
        chain.append(_temperature(temperature))
    if top_k is not None and top_k != 0:
        chain.append(_top_k(top_k))
    if top_p is not None:
        nucleus = _top_p(top_p)  # validates first, so top_p > 1 raises instead of being skipped
        if top_p < 1.0:
            chain.append(nucleus)
    if min_p is not None:
        chain.append(_min_p(min_p))
    return compose(*chain)


def sample(logits: Logits, key: PRNGKeyArray) -> Int[Array, " batch"]:
    """One token per row drawn from ``softmax(logits)`` (``-inf`` logits are never drawn).

    Gumbel-max via ``jax.random.categorical``; the same key gives the same tokens.
    """
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def greedy(logits: Logits) -> Int[Array, " batch"]:
    """The highest-scoring token per row; the first such index on ties, as ``torch.argmax``."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
