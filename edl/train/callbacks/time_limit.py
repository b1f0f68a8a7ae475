"""``TimeLimit``: end the run after so many seconds of wall clock, saying so."""

from __future__ import annotations

import time
from collections.abc import Callable

from edl.train.core import Callback, RunStart, StepInfo, Stop

__all__ = ["TimeLimit"]


class TimeLimit(Callback):
    """Stop (reason ``"time_limit"``) after the first step that ends more than ``seconds``
    after the loop started in this process (compile included); ``echo`` says that the
    schedule is unfinished. The run's checkpoint callback then saves as at any end."""

    every = 1

    def __init__(self, seconds: float, *, echo: Callable[[str], None] = print) -> None:
        if not seconds > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {seconds}")
        self.seconds, self.echo = seconds, echo
        self._begin = 0.0

    def on_start(self, run: RunStart) -> None:
        self._begin = time.perf_counter()

    def on_step(self, info: StepInfo) -> Stop | None:
        if time.perf_counter() - self._begin <= self.seconds or info.final:
            return None
        self.echo(
            f"time limit of {self.seconds:g} s reached at step {info.step} of {info.steps}: "
            "stopping before the schedule's end (the learning-rate schedule is unfinished; "
            "resume to continue, or raise the time limit)"
        )
        return Stop("time_limit")
