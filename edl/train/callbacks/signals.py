"""``StopOnSignal``: SIGTERM ends the run at the next step boundary, after a save."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from edl.train.core import Callback, RunStart, StepInfo, Stop

__all__ = ["StopOnSignal"]


class StopOnSignal(Callback):
    """On SIGTERM (a scheduler's pre-emption notice) the handler only records the signal;
    the loop stops (reason ``"sigterm"``) after the step in flight, and the run's callbacks
    end as at any stop (the checkpoint callback saves). The previous handler is restored
    when the loop ends. Outside the main thread, signals cannot be caught: a no-op."""

    every = 1

    def __init__(self, *, echo: Callable[[str], None] = print) -> None:
        self.echo = echo
        self._received: int | None = None
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        self._received = signum

    def on_start(self, run: RunStart) -> None:
        self._received = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def on_step(self, info: StepInfo) -> Stop | None:
        if self._received is None:
            return None
        self.echo(f"SIGTERM received: stopping after step {info.step} of {info.steps}")
        return Stop("sigterm")

    def close(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
