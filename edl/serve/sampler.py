"""The engine's sampling side (issue 47): each call's per-row settings, and the penalty state.

``Engine`` hands every call's rows to :class:`Sampler`, which builds their
``edl.ops.sampling.RowSampling`` and runs one of two small jitted programs on the model
step's logits (``edl.serve.step``): ``sample_step`` when no row of the call has a
repetition / presence / frequency penalty (no penalty code, no penalty state: such requests
pay nothing for penalties), else ``sample_step_penalized``, which reads and updates the
penalty state of the batch places its rows hold.

Penalty state: ``counts`` (``(max_batch, vocab)`` int32, how often each id was generated)
and ``seen`` (``(max_batch, vocab)`` bool, the prompt's ids), one row per batch place
(``slot``), allocated on first need (a penalized request or ``warmup``). A request takes a
free place when admitted; a penalized one resets its row from its whole prompt
(``reset_penalty_slot``: the prompt padded with -1 to ``max_model_len``, one program, so a
prompt whose pages came from the prefix cache is still seen whole); each penalized call adds
the tokens its rows emit (decode rows, and prefill rows whose prompt ends in the call). A
request without penalties may run in a penalized call: its place's counts then change, which
nothing reads until a penalized request resets that place.

Programs: the sampler compiles per row bucket (its shapes are ``(rows, vocab)``), so
penalties add one program per row bucket (``Engine.row_buckets``) and one reset program;
``warmup`` compiles them all, so a running engine never compiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from edl.ops.sampling import RowSampling
from edl.serve.step import reset_penalty_slot, sample_step, sample_step_penalized
from edl.serve.types import MAX_LOGIT_BIAS, SamplingParams

__all__ = ["Sampler"]


def row_settings(rows: int, settings: Sequence[tuple[SamplingParams, int, int]]) -> RowSampling:
    """The host arrays of a call of ``rows`` rows whose first rows are ``settings``'
    ``(params, seed, tokens generated so far)``; padding rows have everything off."""
    s = RowSampling.off(rows, MAX_LOGIT_BIAS)
    for i, (p, seed, counter) in enumerate(settings):
        s.temperature[i], s.top_k[i] = p.temperature, p.top_k or 0
        s.top_p_threshold[i] = 1.0 - p.top_p  # in double precision, as HF computes it
        s.min_p[i], s.repetition_penalty[i] = p.min_p, p.repetition_penalty
        s.presence_penalty[i], s.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
        for j, (token, bias) in enumerate(p.logit_bias):
            s.bias_ids[i, j], s.bias_values[i, j] = token, bias
        s.seed[i], s.counter[i] = seed, counter
    return s


class Sampler:
    """Batch places and penalty state of an engine of ``max_batch`` places (module
    docstring)."""

    def __init__(self, max_batch: int, vocab_size: int, max_model_len: int) -> None:
        self.max_batch, self.vocab_size, self.max_model_len = max_batch, vocab_size, max_model_len
        self._free = list(range(max_batch - 1, -1, -1))  # pop() hands out place 0 first
        self._counts: Array | None = None
        self._seen: Array | None = None

    def _state(self) -> tuple[Array, Array]:
        if self._counts is None or self._seen is None:
            shape = (self.max_batch, self.vocab_size)
            self._counts, self._seen = jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.bool_)
        return self._counts, self._seen

    def admit(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """A free batch place for a request admitted now; a penalized request's penalty
        state starts there (nothing generated, its prompt seen)."""
        slot = self._free.pop()
        if params.has_penalty:
            self._reset(slot, prompt)
        return slot

    def _reset(self, slot: int, prompt: Sequence[int]) -> None:
        padded = np.full(self.max_model_len, -1, np.int32)
        padded[: len(prompt)] = prompt
        counts, seen = self._state()
        self._counts, self._seen = reset_penalty_slot(
            counts, seen, jnp.int32(slot), jnp.asarray(padded)
        )

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def sample(
        self,
        logits: Float[Array, "rows vocab"],
        settings: Sequence[tuple[SamplingParams, int, int]],
        slots: Sequence[int],
        emit: Sequence[bool],
        allowed: Array | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's token and its log-prob (host arrays) for a call whose first rows are
        ``settings`` at batch places ``slots``; the rows that ``emit`` their token count it
        in their penalty state (penalized calls only). ``allowed``: the rows' grammar
        bitmasks (``edl.serve.grammar``), or None (the unmasked programs)."""
        rows = logits.shape[0]
        # Host arrays straight into the jitted call: cheaper than putting each one first.
        sampling = row_settings(rows, settings)
        if not any(p.has_penalty for p, _, _ in settings):
            tokens, logprobs = sample_step(logits, sampling, allowed)
            return np.asarray(tokens), np.asarray(logprobs)
        places = np.full(rows, self.max_batch, np.int32)  # out of range: padding rows
        places[: len(slots)] = slots
        flags = np.zeros(rows, bool)
        flags[: len(emit)] = emit
        counts, seen = self._state()
        tokens, logprobs, self._counts = sample_step_penalized(
            logits, sampling, counts, seen, places, flags, allowed
        )
        return np.asarray(tokens), np.asarray(logprobs)

    def warmup(self, row_buckets: Sequence[int], mask_words: int | None = None) -> None:
        """Compile both samplers for every row bucket (and, given the grammar bitmasks'
        ``mask_words`` per row, their masked programs) and the reset program now (the calls
        change no state: no row emits, the reset's place is out of range)."""
        for rows in row_buckets:
            logits = jnp.zeros((rows, self.vocab_size), jnp.float32)
            masks: list[Array | None] = [None]
            if mask_words is not None:
                masks.append(jnp.full((rows, mask_words), -1, jnp.int32))
            for allowed in masks:
                self.sample(logits, [], [], [], allowed)
                counts, seen = self._state()
                places = np.full(rows, self.max_batch, np.int32)
                _, _, self._counts = sample_step_penalized(
                    logits,
                    row_settings(rows, []),
                    counts,
                    seen,
                    places,
                    np.zeros(rows, bool),
                    allowed,
                )
        self._reset(self.max_batch, [])  # a place out of range: no state changes
