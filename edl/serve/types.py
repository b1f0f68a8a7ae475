"""The engine interface the server drives: ``SamplingParams``, ``RequestOutput``, ``QueueFull``
and ``Engine`` (a protocol). Plain dataclasses, no jax: the HTTP layer and its tests import
them without a model.

The engine (``edl.serve.engine``) defines the same four names; this module is the shared
contract, and the engine's classes are expected to be these (or compatible with them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Engine", "QueueFull", "RequestOutput", "SamplingParams"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples: at most ``max_tokens`` new tokens; ``temperature`` 0 is
    greedy; nucleus ``top_p`` and ``top_k`` (None: all tokens) filter before sampling;
    ``seed`` makes a sampled request reproducible; generation ends after any of
    ``stop_token_ids`` (the EOS ids), which is counted among the new tokens."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request: the tokens new since its last output
    (maybe none), and whether it is finished, with why: ``"stop"`` (a stop token),
    ``"length"`` (``max_tokens`` or the model length) or ``"abort"``."""

    request_id: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


class QueueFull(Exception):
    """``Engine.add_request`` cannot take another request now (the server answers 429)."""


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
