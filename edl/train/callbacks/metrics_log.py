"""``MetricsLog``: the run's metrics history, and ``metrics.jsonl`` with one line per
logged step."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from edl.train.core import Callback, StepInfo

__all__ = ["METRICS_FILE", "MetricsLog", "logged", "scalars"]

METRICS_FILE = "metrics.jsonl"


def logged(info: StepInfo, interval: int) -> bool:
    """Whether a metrics log writes this step: every ``interval`` steps, the schedule's last
    step, and every step that was evaluated or skipped (never lost between intervals)."""
    metrics = info.metrics
    return (
        info.step % interval == 0
        or info.final
        or bool(metrics.get("skipped"))
        or any(k.startswith("eval_") for k in metrics)
    )


def scalars(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The numeric scalar metrics (what trackers plot), booleans left out."""
    return {
        k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


class MetricsLog(Callback):
    """Records ``{**metrics, "step", "time"}`` every ``interval`` steps (see :func:`logged`)
    in :attr:`history` and, with a ``path``, as a JSON line appended to that file (flushed
    per line). ``history`` starts with the lines of the run being resumed, so summaries and
    plots cover the whole run. ``time`` is ``StepInfo.elapsed``.
    """

    every = 1

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        interval: int = 1,
        history: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        if interval < 1:
            raise ValueError(f"MetricsLog: interval must be >= 1, got {interval}")
        self.path = None if path is None else Path(path)
        self.interval = interval
        self.history: list[dict[str, Any]] = [dict(m) for m in history]
        self._file: IO[str] | None = None

    def on_step(self, info: StepInfo) -> None:
        if not logged(info, self.interval):
            return
        record = {**info.metrics, "step": info.step, "time": info.elapsed}
        self.history.append(record)
        if self.path is not None:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
