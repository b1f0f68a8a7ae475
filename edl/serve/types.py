"""The engine interface the server drives: ``SamplingParams``, ``RequestOutput``, ``QueueFull``
and ``Engine`` (a protocol). Plain dataclasses, no jax: the HTTP layer and its tests import
them without a model.

``edl.serve.engine.Engine`` implements the protocol with these classes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["MAX_LOGIT_BIAS", "Engine", "Logprob", "QueueFull", "RequestOutput", "SamplingParams"]

MAX_LOGPROBS = 20  # edl.ops.logprobs.MAX_TOP_LOGPROBS (this module imports no jax)
# logit_bias entries per request, at most: the sampler's fixed (rows, MAX_LOGIT_BIAS) pairs.
MAX_LOGIT_BIAS = 64

SEED_END = 2**32
"""Seeds are in ``[0, SEED_END)``: the engine keeps them as uint32."""
TOP_K_END = 2**31
"""``top_k`` is below ``TOP_K_END``: the engine keeps it as int32 (a larger one would fail
in the engine's thread, not in ``add_request``)."""


def is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real_in(value: object, low: float, high: float) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and low <= value <= high


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (``edl.ops.sampling.RowSampling`` says how each setting
    matches OpenAI / vLLM). ``temperature=0`` is greedy; ``top_k=None``, ``top_p=1``,
    ``min_p=0``, ``repetition_penalty=1``, ``presence_penalty=0``, ``frequency_penalty=0``
    and no ``logit_bias`` are off; ``seed=None`` draws a fresh one; ``stop_token_ids`` end
    the request like the engine's EOS ids. ``logit_bias`` takes a mapping or pairs of
    ``token id -> bias`` (at most ``MAX_LOGIT_BIAS``, bias in [-100, 100]) and holds them as
    sorted pairs; the engine checks the ids against its vocabulary.

    ``logprobs``: each generated token's log-prob and its ``logprobs`` most likely
    alternatives (0: the token's only; None: off); ``prompt_logprobs``: the same for every
    prompt token given its prefix (the first has none), computed while prefilling. Both at
    most 20, from the model's distribution before any processor.
    ``max_tokens=0`` (prefill only) is allowed when ``prompt_logprobs`` is set.
    ``grammar`` (an llguidance grammar, ``edl.serve.grammar``) constrains the tokens and ends
    the request where it is complete."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None  # structured output (edl.serve.grammar)

    # -- issue 47: the other processors (edl.ops.sampling.process_rows) --
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # prompt + generated tokens (HF's rule)
    presence_penalty: float = 0.0  # generated tokens only (OpenAI's)
    frequency_penalty: float = 0.0  # generated tokens only (OpenAI's)
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = ()  # held as pairs

    @property
    def has_penalty(self) -> bool:
        """Whether decoding needs the penalty state (the engine's penalized sampler)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _penalty_problems(self) -> list[str]:
        problems = []
        if not _real_in(self.min_p, 0.0, 1.0):
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        r = self.repetition_penalty
        if not _real_in(r, 0.0, math.inf) or r == 0 or r == math.inf:
            problems.append(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _real_in(getattr(self, name), -2.0, 2.0):
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(bias.items())
        ok = isinstance(bias, tuple | list) and all(
            isinstance(pair, tuple | list)
            and len(pair) == 2
            and is_int(pair[0])
            and pair[0] >= 0
            and _real_in(pair[1], -100.0, 100.0)
            for pair in bias
        )
        if not ok:
            problems.append(
                "logit_bias must map token ids >= 0 to numbers in [-100, 100], "
                f"got {self.logit_bias!r}"[:300]
            )
        elif len({i for i, _ in bias}) > MAX_LOGIT_BIAS or len(bias) > MAX_LOGIT_BIAS:
            problems.append(f"logit_bias takes at most {MAX_LOGIT_BIAS} ids, got {len(bias)}")
        else:
            pairs = tuple(sorted((int(i), float(v)) for i, v in dict(bias).items()))
            object.__setattr__(self, "logit_bias", pairs)
        return problems

    def __post_init__(self):
        problems = self._penalty_problems()
        least = 0 if self.prompt_logprobs is not None else 1
        if not is_int(self.max_tokens) or self.max_tokens < least:
            problems.append(
                f"max_tokens must be an integer >= {least}"
                f"{' (0 only with prompt_logprobs)' if least else ''}, got {self.max_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                problems.append(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}"
                )
        t = self.temperature
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 <= t < math.inf:
            problems.append(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, numbers.Real) or isinstance(p, bool) or not 0 <= p <= 1:
            problems.append(f"top_p must be in [0, 1], got {p!r}")
        if self.top_k is not None and (not is_int(self.top_k) or not 1 <= self.top_k < TOP_K_END):
            problems.append(f"top_k must be None or an integer in [1, 2**31), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_END):
            problems.append(f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, tuple) or not all(is_int(i) and i >= 0 for i in stop):
            problems.append(f"stop_token_ids must be a tuple of ids >= 0, got {stop!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            problems.append(f"grammar must be None or a string, got {type(self.grammar)}")
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-prob under the model (float32 ``log_softmax`` of its raw logits) and
    the ``k`` most likely tokens at its position as ``(id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What ``Engine.step`` produced for one request. ``logprobs``: one ``Logprob`` per
    new token when the request asked (``SamplingParams.logprobs``), else None.
    ``prompt_logprobs``: with the request's first output when it asked, one entry per prompt
    token (None for the first, which has no prefix)."""

    request_id: int
    # tokens produced by this step for this request (several with speculative decoding)
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop token), "length", "abort"
    logprobs: tuple[Logprob, ...] | None = None
    prompt_logprobs: tuple[Logprob | None, ...] | None = None
    # The sum of the request's sampled tokens' log-probs so far (raw model distribution):
    # how the server's best_of ranks choices. Engines that do not compute it leave 0.
    cumulative_logprob: float = 0.0


class QueueFull(Exception):
    """``Engine.add_request`` when ``max_queue`` requests are waiting already."""


@runtime_checkable
class Engine(Protocol):
    """A continuous-batching engine. Not thread-safe: one thread makes every call.

    ``add_request`` raises ``ValueError`` for a bad prompt or params and ``QueueFull`` when
    full; ``step`` runs one iteration (blocking compute) and returns the outputs of the
    requests it advanced; ``abort`` drops a request and frees its pages."""

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int: ...

    def abort(self, request_id: int) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_free_pages(self) -> int: ...

    @property
    def num_total_pages(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...
