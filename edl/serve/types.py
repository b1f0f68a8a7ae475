"""The engine interface the server drives: ``SamplingParams``, ``RequestOutput``, ``QueueFull``
and ``Engine`` (a protocol). Plain dataclasses, no jax: the HTTP layer and its tests import
them without a model.

``edl.serve.engine.Engine`` implements the protocol with these classes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Engine", "QueueFull", "RequestOutput", "SamplingParams"]


def is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature=0`` is greedy; ``top_k=None`` and
    ``top_p=1`` are off; ``seed=None`` draws a fresh one; ``stop_token_ids`` end the
    request like the engine's EOS ids; ``grammar`` (an llguidance grammar,
    ``edl.serve.grammar``) constrains the tokens and ends the request where it is
    complete."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    grammar: str | None = None  # structured output (edl.serve.grammar)

    def __post_init__(self):
        problems = []
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 <= t < math.inf:
            problems.append(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, numbers.Real) or isinstance(p, bool) or not 0 <= p <= 1:
            problems.append(f"top_p must be in [0, 1], got {p!r}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            problems.append(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**32):
            problems.append(f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, tuple) or not all(is_int(i) and i >= 0 for i in stop):
            problems.append(f"stop_token_ids must be a tuple of ids >= 0, got {stop!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            problems.append(f"grammar must be None or a string, got {type(self.grammar)}")
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What ``Engine.step`` produced for one request."""

    request_id: int
    new_token_ids: tuple[int, ...]  # tokens produced by this step for this request
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop token), "length", "abort"


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
