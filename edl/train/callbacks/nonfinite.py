"""``NonFinitePolicy``: what a run does with a step whose loss, gradients or updates are
NaN or infinite."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from edl.train.core import Callback, RunStart, StepInfo
from edl.train.options import NAN_POLICIES

__all__ = ["NonFiniteLossError", "NonFinitePolicy", "is_nonfinite"]

NanPolicy = Literal["stop", "skip"]


class NonFiniteLossError(FloatingPointError):
    """A step was non-finite under ``nan_policy="stop"``, or too many were in a row under
    ``"skip"``. ``step`` is the offending step (1-based)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def is_nonfinite(metrics: Mapping[str, Any]) -> bool:
    """Whether a step's metrics say it was non-finite: ``make_train_step``'s ``nonfinite``
    flag (loss, gradients or updates), else a non-finite ``loss`` or ``grad_norm``."""
    if "nonfinite" in metrics:
        return bool(metrics["nonfinite"])
    return any(not math.isfinite(metrics.get(k, 0.0)) for k in ("loss", "grad_norm"))


def _describe(metrics: Mapping[str, Any]) -> str:
    shown = [f"{k} {metrics[k]:.4g}" for k in ("loss", "grad_norm") if k in metrics]
    return ", ".join(shown) or "no loss reported"


class NonFinitePolicy(Callback):
    """``"stop"``: a non-finite step raises :class:`NonFiniteLossError` before any later
    callback (a checkpoint) sees it, so the newest checkpoint is the last good state.
    ``"skip"``: the step function must have left the state unchanged (build it with
    ``make_train_step(..., skip_nonfinite=True)``, checked at the first step); the run goes
    on, and ``max_consecutive_skips`` skipped steps in a row raise.

    ``newest_checkpoint``: a function naming the newest checkpoint, for the message.
    """

    every = 1

    def __init__(
        self,
        policy: NanPolicy = "stop",
        *,
        max_consecutive_skips: int = 10,
        newest_checkpoint: Callable[[], str | None] = lambda: None,
    ) -> None:
        if policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {policy!r}")
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.policy, self.max_consecutive_skips = policy, max_consecutive_skips
        self.newest_checkpoint = newest_checkpoint
        self._start, self._run = 0, 0

    def on_start(self, run: RunStart) -> None:
        self._start, self._run = run.start_step, 0

    def _last_good(self) -> str:
        newest = self.newest_checkpoint()
        return (
            f"the newest checkpoint, {newest}, is the last good state"
            if newest
            else "no checkpoint was saved"
        )

    def on_step(self, info: StepInfo) -> None:
        metrics, step = info.metrics, info.step
        bad = is_nonfinite(metrics)
        if self.policy == "stop":
            if bad:
                raise NonFiniteLossError(
                    f"train: step {step} is non-finite ({_describe(metrics)}); stopping "
                    f"(nan_policy='stop') without applying or saving it: {self._last_good()}",
                    step,
                )
            return
        if step == self._start + 1 and "skipped" not in metrics:
            raise ValueError(
                "train: nan_policy='skip' needs a step that skips non-finite updates and says "
                "so: build it with make_train_step(..., skip_nonfinite=True)"
            )
        if bad and not metrics.get("skipped"):
            raise NonFiniteLossError(
                f"train: step {step} is non-finite ({_describe(metrics)}) with "
                "nan_policy='skip', but the step applied it: build it with "
                "make_train_step(..., skip_nonfinite=True)",
                step,
            )
        self._run = self._run + 1 if bad else 0
        if self._run >= self.max_consecutive_skips:
            first = step - self._run + 1
            raise NonFiniteLossError(
                f"train: {self._run} steps in a row ({first}-{step}) were non-finite and "
                f"skipped (max_consecutive_skips={self.max_consecutive_skips}); stopping: the "
                f"parameters are unchanged since step {first - 1}, and {self._last_good()}",
                step,
            )
