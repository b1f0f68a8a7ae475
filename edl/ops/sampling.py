"""Logits processors and token sampling for generation, with transformers' semantics.

A :data:`LogitsProcessor` is a pure function ``(logits, tokens, valid) -> logits``: ``logits``
is the float32 ``(batch, vocab)`` next-token scores, ``tokens`` the fixed-size ``(batch, seq)``
buffer of everything so far (prompt + generated) and ``valid`` marks which buffer entries are
real tokens. The factories below validate their arguments eagerly and return such functions;
all of them are shape-static and jittable, so a generation loop can call them inside
``lax.while_loop``. Filtered logits are ``-inf``. Chain them with :func:`compose`, or build
transformers' chain from ``generate``-style arguments with :func:`processors_for`, then pick a
token with :func:`sample` or :func:`greedy`.

Each factory is a call of a per-row function (``temperature_rows``, ``top_k_rows``,
``top_p_rows``, ``min_p_rows``, ``repetition_rows``, plus ``presence_frequency_rows`` and
``bias_rows``) with its one setting broadcast over the rows. The serving engine calls the
same functions with a different setting per row: :class:`RowSampling` (its docstring says
how each field matches OpenAI / vLLM) and :func:`sample_rows` (processors, then a seeded draw
or the argmax per row, and the sampled token's log-prob under the raw logits).

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, UInt

__all__ = [
    "LogitsProcessor",
    "RowSampling",
    "compose",
    "greedy",
    "min_p",
    "process_rows",
    "processors_for",
    "repetition_penalty",
    "sample",
    "sample_rows",
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


def _full(logits: Logits, value: float | int, dtype) -> Array:
    """``value`` for every row of ``logits`` (the factories' per-row argument)."""
    return jnp.full((logits.shape[0],), value, dtype)


def _kth_largest(logits: Logits, k: int) -> Float[Array, "batch 1"]:
    k = min(k, logits.shape[-1])
    return jax.lax.top_k(logits, k)[0][:, k - 1 :]


# --- the per-row processors: one setting per row, the one implementation -------------------
# The factories below and the serving engine's sampler (sample_rows) both call these.


def seen_mask(tokens: Tokens, valid: Valid, vocab: int) -> Bool[Array, "batch vocab"]:
    """Which vocab ids occur at a ``valid`` position of each row (ids outside
    ``[0, vocab)`` are ignored)."""
    batch = tokens.shape[0]
    ids = jnp.where(valid & (tokens >= 0) & (tokens < vocab), tokens, vocab)  # vocab: dropped
    rows = jnp.broadcast_to(jnp.arange(batch).reshape(-1, 1), ids.shape)
    return jnp.zeros((batch, vocab + 1), jnp.bool_).at[rows, ids].set(True)[:, :vocab]


def temperature_rows(logits: Logits, t: Float[Array, " batch"]) -> Logits:
    """``logits / t`` per row; rows with ``t == 0`` (greedy) are left unscaled."""
    return logits / jnp.where(t > 0, t, 1.0)[:, None]


def top_k_rows(logits: Logits, k: Int[Array, " batch"]) -> Logits:
    """Keep logits ``>=`` each row's k-th largest (ties kept, as HF); ``k <= 0``: off,
    ``k >= vocab``: everything kept."""
    vocab = logits.shape[-1]
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, jnp.clip(k - 1, 0, vocab - 1)[:, None], axis=-1)
    return jnp.where((k[:, None] > 0) & (logits < kth), -jnp.inf, logits)


def top_p_rows(logits: Logits, threshold: Float[Array, " batch"], keep: int = 1) -> Logits:
    """Nucleus filtering per row, HF's rule: ``threshold`` is ``1 - top_p`` (computed on the
    host in double precision, as HF does; 0: only zero-probability tokens go); sort
    ascending, drop tokens whose cumulative softmax is ``<= threshold`` but never the
    ``keep`` largest; tokens tied with the smallest kept logit are kept."""
    vocab = logits.shape[-1]
    ascending = jnp.sort(logits, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    rank = jnp.arange(vocab).reshape(1, -1)
    remove = (cumulative <= threshold[:, None]) & (rank < vocab - keep)
    cutoff = jnp.min(jnp.where(remove, jnp.inf, ascending), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def min_p_rows(logits: Logits, p: Float[Array, " batch"], keep: int = 1) -> Logits:
    """Drop tokens with probability ``< p * max probability`` per row (0: off); the ``keep``
    highest logits (and ties) always survive."""
    probs = jax.nn.softmax(logits, axis=-1)
    remove = probs < p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    remove = remove & (logits < _kth_largest(logits, keep))
    return jnp.where(remove, -jnp.inf, logits)


def repetition_rows(
    logits: Logits, penalty: Float[Array, " batch"], seen: Bool[Array, "batch vocab"]
) -> Logits:
    """CTRL's penalty on the ``seen`` ids (1: off): negative logits times ``penalty``,
    others divided by it (HF ``RepetitionPenaltyLogitsProcessor``, vLLM's rule too)."""
    penalty = penalty[:, None]
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def presence_frequency_rows(
    logits: Logits,
    presence: Float[Array, " batch"],
    frequency: Float[Array, " batch"],
    counts: Int[Array, "batch vocab"],
) -> Logits:
    """OpenAI's / vLLM's additive penalties over ``counts`` (how often each id was generated):
    ``logits - frequency * counts - presence * (counts > 0)``."""
    counts = counts.astype(logits.dtype)
    present = (counts > 0).astype(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * present


def bias_rows(
    logits: Logits, ids: Int[Array, "batch slots"], values: Float[Array, "batch slots"]
) -> Logits:
    """OpenAI's ``logit_bias``: ``values[b, j]`` added to id ``ids[b, j]`` (ids outside
    ``[0, vocab)``, e.g. -1 padding, are ignored)."""
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], ids.shape)
    ids = jnp.where(ids < 0, logits.shape[-1], ids)  # negative ids would wrap: dropped
    return logits.at[rows, ids].add(values.astype(logits.dtype), mode="drop")


def temperature(t: float) -> LogitsProcessor:
    """``logits / t`` (HF ``TemperatureLogitsWarper``); ``t`` must be finite and > 0."""
    t = _real(
        "temperature",
        t,
        lambda v: 0 < v < math.inf,
        "a finite float > 0 (for greedy decoding use greedy())",
    )

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        return temperature_rows(logits, _full(logits, t, jnp.float32))

    return apply


def top_k(k: int, min_tokens_to_keep: int = 1) -> LogitsProcessor:
    """Keep logits ``>=`` the ``max(k, min_tokens_to_keep)``-th largest (HF ``TopKLogitsWarper``).

    Like HF (``scores < topk(scores, k).values[..., -1]``), every logit tied with the k-th
    largest is kept, so more than k tokens may survive. ``k`` above the vocab keeps everything.
    """
    k = max(_positive_int("top_k", k), _positive_int("min_tokens_to_keep", min_tokens_to_keep))

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        return top_k_rows(logits, _full(logits, k, jnp.int32))

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
        return top_p_rows(logits, _full(logits, threshold, jnp.float32), keep)

    return apply


def min_p(p: float, min_tokens_to_keep: int = 1) -> LogitsProcessor:
    """Drop tokens with probability ``< p * max probability`` (HF ``MinPLogitsWarper``).

    ``p`` in [0, 1]; the ``min_tokens_to_keep`` highest logits (and any tied with them) always
    survive.
    """
    p = _real("min_p", p, lambda v: 0 <= v <= 1, "a float in [0, 1]")
    keep = _positive_int("min_tokens_to_keep", min_tokens_to_keep)

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        return min_p_rows(logits, _full(logits, p, jnp.float32), keep)

    return apply


def repetition_penalty(penalty: float) -> LogitsProcessor:
    """CTRL's penalty (HF ``RepetitionPenaltyLogitsProcessor``) on every token seen so far.

    For each vocab id occurring at a ``valid`` position of ``tokens`` (once, however often it
    occurs): negative logits are multiplied by ``penalty``, others divided by it. Unlike HF,
    invalid positions (padding, unfilled slots) are never penalised, whatever id they hold.
    """
    penalty = _real("repetition_penalty", penalty, lambda v: 0 < v < math.inf, "a float > 0")

    def apply(logits: Logits, tokens: Tokens, valid: Valid) -> Logits:
        seen = seen_mask(tokens, valid, logits.shape[-1])
        return repetition_rows(logits, _full(logits, penalty, jnp.float32), seen)

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
    """The highest-scoring token per row; the first such index on ties, as ``torch.argmax``.

    As a max and a min over the first index holding it: XLA:CPU's ``argmax`` (a reduction
    over value / index pairs) took 5 ms on a (16, 32000) block where these two take well
    under one."""
    vocab = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.arange(vocab, dtype=jnp.int32).reshape(1, -1)
    return jnp.min(jnp.where(logits == best, index, vocab), axis=-1).clip(0, vocab - 1)


# --- the per-row sampler: every row its own settings (the serving engine's) ---------------


class RowSampling(NamedTuple):
    """Per-row sampling settings, ``(batch,)`` arrays unless stated; each field's "off"
    value is what :meth:`off` fills in. OpenAI / vLLM semantics:

    * ``temperature``: 0 is greedy (the argmax of the processed logits: bias and penalties
      apply to greedy rows too, as in vLLM; the filters below keep the argmax).
    * ``top_k`` (0: off), ``top_p`` as ``top_p_threshold = 1 - top_p`` computed on the
      host (0: off), ``min_p`` (0: off): HF's warpers, HF's order (top-k, top-p, min-p;
      vLLM applies min-p before top-k / top-p).
    * ``repetition_penalty`` (1: off): HF's / vLLM's rule over the prompt *and* the
      generated tokens (``seen | counts > 0``).
    * ``presence_penalty`` / ``frequency_penalty`` (0: off): OpenAI's, over generated
      tokens only (``counts``), as vLLM.
    * ``bias_ids`` / ``bias_values``: ``(batch, slots)``, OpenAI's ``logit_bias`` as id /
      value pairs padded with id -1, added first (vLLM's order).
    * ``seed`` (uint32) and ``counter`` (tokens generated so far): the row's key is
      ``fold_in(key(seed), counter)``, so a draw does not depend on the batch it runs in.
    """

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p_threshold: Float[Array, " batch"]
    min_p: Float[Array, " batch"]
    repetition_penalty: Float[Array, " batch"]
    presence_penalty: Float[Array, " batch"]
    frequency_penalty: Float[Array, " batch"]
    bias_ids: Int[Array, "batch slots"]
    bias_values: Float[Array, "batch slots"]
    seed: UInt[Array, " batch"]
    counter: Int[Array, " batch"]

    @classmethod
    def off(cls, rows: int, bias_slots: int) -> RowSampling:
        """Host (numpy) arrays of ``rows`` rows with every processor off, greedy, seed 0:
        fill in the rows that carry requests, then ``jax.tree.map(jnp.asarray, ...)``."""
        f32 = lambda v: np.full(rows, v, np.float32)
        return cls(
            temperature=f32(0.0),
            top_k=np.zeros(rows, np.int32),
            top_p_threshold=f32(0.0),
            min_p=f32(0.0),
            repetition_penalty=f32(1.0),
            presence_penalty=f32(0.0),
            frequency_penalty=f32(0.0),
            bias_ids=np.full((rows, bias_slots), -1, np.int32),
            bias_values=np.zeros((rows, bias_slots), np.float32),
            seed=np.zeros(rows, np.uint32),
            counter=np.zeros(rows, np.int32),
        )


def process_rows(
    logits: Logits,
    s: RowSampling,
    counts: Int[Array, "batch vocab"] | None = None,
    seen: Bool[Array, "batch vocab"] | None = None,
) -> Logits:
    """Every row's logits after its processors: logit bias; with penalty state (``counts``
    of generated ids, ``seen`` ids of the prompt; None: the penalties are skipped, and must
    be off) repetition, then frequency and presence penalties; temperature, top-k, top-p,
    min-p. Filtered logits are ``-inf``."""
    logits = bias_rows(logits, s.bias_ids, s.bias_values)
    if counts is not None and seen is not None:
        logits = repetition_rows(logits, s.repetition_penalty, seen | (counts > 0))
        logits = presence_frequency_rows(logits, s.presence_penalty, s.frequency_penalty, counts)
    logits = temperature_rows(logits, s.temperature)
    # Each filter runs only when some row uses it: XLA:CPU sorts a (16, 32000) block in
    # ~0.2 s, so a batch of greedy rows must not pay for a top-k / top-p it does not use.
    logits = _when(jnp.any(s.top_k > 0), top_k_rows, logits, s.top_k)
    logits = _when(jnp.any(s.top_p_threshold > 0), top_p_rows, logits, s.top_p_threshold)
    return _when(jnp.any(s.min_p > 0), min_p_rows, logits, s.min_p)


def _when(pred: Bool[Array, ""], f: Callable[..., Logits], logits: Logits, arg: Array) -> Logits:
    """``f(logits, arg)`` if ``pred`` else ``logits``, computing ``f`` only when needed. Off
    rows are left alone by ``f`` itself (``top_p_rows`` with threshold 0 drops only
    zero-probability tokens, which neither a draw nor the argmax can pick)."""
    return jax.lax.cond(pred, f, lambda x, _: x, logits, arg)


def sample_rows(
    logits: Logits,
    s: RowSampling,
    counts: Int[Array, "batch vocab"] | None = None,
    seen: Bool[Array, "batch vocab"] | None = None,
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """Each row's next token under its own settings (:func:`process_rows`): a draw with its
    key, or the argmax of the processed logits at temperature 0; and that token's log-prob
    under the model's own distribution (``log_softmax`` of the raw float32 ``logits``,
    before any processor, as OpenAI and vLLM report it)."""
    logits = logits.astype(jnp.float32)
    processed = process_rows(logits, s, counts, seen)
    keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, s.counter)
    best = greedy(processed)
    # Drawing costs Gumbel noise over the whole vocabulary: only when some row samples.
    drawn = jax.lax.cond(
        jnp.any(s.temperature > 0),
        lambda: jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32),
        lambda: best,
    )
    tokens = jnp.where(s.temperature > 0, drawn, best)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
