"""``LossPlot``: ``loss.png``, train and held-out loss against step (the optional ``plot``
extra, matplotlib)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edl.train.callbacks.metrics_log import MetricsLog
from edl.train.core import Callback, RunEnd

__all__ = ["LossPlot", "loss_curve_png"]


def loss_curve_png(path: Path, history: Sequence[Mapping[str, Any]]) -> Path | None:
    """Plot ``loss`` (and ``eval_loss``) of ``history`` against ``step`` into ``path``;
    ``None`` (nothing written) without matplotlib or without a loss."""
    points = [(m["step"], m["loss"]) for m in history if "loss" in m]
    if not points or importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points, strict=True), label="train")
    evals = [(m["step"], m["eval_loss"]) for m in history if "eval_loss" in m]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


class LossPlot(Callback):
    """Writes ``path`` from ``log.history`` (the whole run's) when the run ends."""

    every = 0

    def __init__(self, path: str | os.PathLike[str], log: MetricsLog) -> None:
        self.path, self.log = Path(path), log
        self.written: Path | None = None

    def on_end(self, end: RunEnd) -> None:
        self.written = loss_curve_png(self.path, self.log.history)
