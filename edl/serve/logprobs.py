"""The engine's host side of log-probs: which calls need them, the prompt tokens each prefill
position predicts, and the step's log-prob arrays turned into ``Logprob`` entries.

A step call computes log-probs (``model_step(..., logprobs=True)``, its own compiled variant
of each shape) only when one of its requests asks: ``SamplingParams.logprobs`` for generated
tokens, ``prompt_logprobs`` while the request prefills. The device always returns the top
``MAX_TOP_LOGPROBS``; each request keeps its own first ``k``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from edl.serve.types import Logprob, SamplingParams

__all__ = ["host_arrays", "needs_logprobs", "prompt_entries", "prompt_targets", "sampled_entry"]


@runtime_checkable
class _Request(Protocol):  # the fields of edl.serve.requests.Request read here
    prompt: tuple[int, ...]
    params: SamplingParams
    computed: int

    @property
    def prefilling(self) -> bool: ...


def needs_logprobs(requests: Sequence[_Request]) -> bool:
    """Whether a call over ``requests`` must run the log-prob variant of its step."""
    return any(
        r.params.logprobs is not None or (r.prefilling and r.params.prompt_logprobs is not None)
        for r in requests
    )


def prompt_targets(requests: Sequence[_Request], rows: int, width: int) -> np.ndarray:
    """``(rows, width)``: at a prefilling row's column ``j`` the prompt token after its new
    token ``j`` (0 past the prompt: that position's prediction is the sampled token)."""
    targets = np.zeros((rows, width), np.int32)
    for i, r in enumerate(requests):
        if r.prefilling:
            following = r.prompt[r.computed + 1 : r.computed + 1 + width]
            targets[i, : len(following)] = following
    return targets


def host_arrays(
    prompt: object | None, sampled: Mapping[str, object] | None
) -> dict[str, np.ndarray] | None:
    """A call's log-prob arrays as numpy by name: ``sampled`` (``step.sampled_logprobs``:
    ``sampled``, ``sampled_top_ids``, ``sampled_top``) and, in a prefill call, ``prompt``'s
    (``step.PromptLogprobs``: ``prompt``, ``prompt_top_ids``, ``prompt_top``); None in a call
    without log-probs."""
    if sampled is None:
        return None
    arrays = {k: np.asarray(v) for k, v in sampled.items()}
    if prompt is not None:
        arrays |= {k: np.asarray(v) for k, v in vars(prompt).items()}
    return arrays


def _entry(token: int, logprob: object, ids: np.ndarray, top: np.ndarray, k: int) -> Logprob:
    pairs = tuple((int(i), float(p)) for i, p in zip(ids[:k], top[:k], strict=True))
    return Logprob(int(token), float(logprob), pairs)


def sampled_entry(step: dict[str, np.ndarray], row: int, token: int, k: int) -> Logprob:
    """Row ``row``'s sampled ``token`` and its top ``k``, from a call's log-prob arrays
    (``host_arrays``)."""
    return _entry(
        token, step["sampled"][row], step["sampled_top_ids"][row], step["sampled_top"][row], k
    )


def prompt_entries(
    step: dict[str, np.ndarray], row: int, request: _Request, new: int
) -> list[Logprob]:
    """The ``Logprob`` of each prompt token that the request's ``new`` positions of this
    call predict (those before the last prompt token; ``request.computed`` not yet
    advanced)."""
    k, entries = request.params.prompt_logprobs or 0, []
    for j in range(new):
        t = request.computed + j + 1
        if t >= len(request.prompt):
            break
        ids, top = step["prompt_top_ids"][row, j], step["prompt_top"][row, j]
        entries.append(_entry(request.prompt[t], step["prompt"][row, j], ids, top, k))
    return entries
