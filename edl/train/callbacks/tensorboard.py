"""``TensorBoardLog``: scalar metrics as TensorBoard events (the optional ``tensorboard``
extra: ``tensorboardX`` writes them, ``tensorboard`` views them)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edl.train.callbacks.metrics_log import logged, scalars
from edl.train.core import Callback, StepInfo

__all__ = ["TensorBoardLog", "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether ``tensorboardX`` is installed."""
    return importlib.util.find_spec("tensorboardX") is not None


class TensorBoardLog(Callback):
    """Every numeric metric as a scalar at the step, on the steps a ``MetricsLog`` with
    the same ``interval`` writes, into ``directory`` (created on the first write); the
    run's ``config``, when given, as the text ``config`` (JSON) with the first write, which
    also says on stderr how to view them (``tensorboard --logdir DIRECTORY``)."""

    every = 1

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        interval: int = 1,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if not tensorboard_available():
            raise ImportError(
                "TensorBoardLog needs tensorboardX: pip install 'edl-jax[tensorboard]'"
            )
        self.directory, self.interval = Path(directory), interval
        self.config = None if config is None else dict(config)
        self._writer: Any = None

    def on_step(self, info: StepInfo) -> None:
        if not logged(info, self.interval):
            return
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(self.directory))
            print(
                f"TensorBoard events in {self.directory}; view them with: "
                f"tensorboard --logdir {self.directory}",
                file=sys.stderr,
            )
            if self.config is not None:
                text = json.dumps(self.config, indent=2, default=str)
                self._writer.add_text("config", f"```\n{text}\n```", info.step)
        for key, value in scalars(info.metrics).items():
            self._writer.add_scalar(key, value, info.step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
