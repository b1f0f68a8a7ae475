"""``Profile``: a ``jax.profiler`` trace of a few chosen steps, for TensorBoard's profile
plugin or Perfetto (``*.trace.json.gz``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import jax

from edl.train.core import Callback, RunEnd, RunStart, StepInfo

__all__ = ["Profile"]


class Profile(Callback):
    """Traces steps ``start`` to ``start + count - 1`` (step ``n`` is the one after which
    ``state.step == n``) into ``directory``. The trace starts after step ``start - 1`` (or
    before the run's first step, compilation included, when that is ``start``) and stops
    after step ``start + count - 1`` has finished on the device, or when the run ends
    first. Steps a resumed run has already done are not traced again (``echo`` says so)."""

    every = 1

    def __init__(
        self,
        directory: str | os.PathLike[str],
        start: int,
        count: int,
        *,
        echo: Callable[[str], None] = print,
    ) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise ValueError(f"Profile: start must be an int >= 1, got {start!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"Profile: count must be an int >= 1, got {count!r}")
        self.directory, self.start, self.count, self.echo = Path(directory), start, count, echo
        self._tracing = False

    @property
    def last(self) -> int:
        return self.start + self.count - 1

    def _begin(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))
        self._tracing = True

    def _finish(self) -> None:
        if self._tracing:
            self._tracing = False
            jax.profiler.stop_trace()
            self.echo(f"profile of steps {self.start}-{self.last} written to {self.directory}")

    def on_start(self, run: RunStart) -> None:
        if run.start_step >= self.start:
            self.echo(
                f"profile: step {self.start} was done before this run (it starts at "
                f"step {run.start_step + 1}); nothing traced"
            )
        elif run.start_step == self.start - 1:
            self._begin()

    def on_step(self, info: StepInfo) -> None:
        if info.step == self.start - 1 and not self._tracing:
            self._begin()
        elif info.step == self.last:
            jax.block_until_ready(info.state)
            self._finish()

    def on_end(self, end: RunEnd) -> None:
        self._finish()

    def close(self) -> None:
        self._finish()
