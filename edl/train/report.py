"""Run artefacts: ``run.md``, the loss-curve PNG and optional TensorBoard events.

matplotlib and tensorboardX are optional extras (``pip install edl[plot,tensorboard]``);
without them the corresponding artefact is skipped, never an error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["loss_curve_png", "tensorboard_writer", "write_run_summary"]


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)


def write_run_summary(
    path: Path, summary: Mapping[str, Any], config: Mapping[str, Any] | None
) -> None:
    """``run.md``: the summary as a table, then the run's configuration as JSON."""
    lines = ["# edl run", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {_fmt(value)} |" for key, value in summary.items()]
    if config:
        lines += ["", "## Configuration", "", "```json", json.dumps(config, indent=2, default=str),
                  "```"]  # fmt: skip
    _write_text_atomic(path, "\n".join(lines) + "\n")


def loss_curve_png(directory: Path, history: Sequence[Mapping[str, Any]]) -> str | None:
    """``loss.png`` (train and eval loss against step); None without matplotlib or data."""
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
    path = directory / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def tensorboard_writer(directory: Path) -> Callable[[Mapping[str, Any]], None] | None:
    """A function logging scalar metrics as TensorBoard events; None without tensorboardX."""
    if importlib.util.find_spec("tensorboardX") is None:
        return None
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(directory / "tensorboard"))

    def log(metrics: Mapping[str, Any]) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, int | float):
                writer.add_scalar(key, value, metrics["step"])
        writer.flush()

    return log
