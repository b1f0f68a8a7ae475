"""``WandbLog``: scalar metrics and the run's config to Weights & Biases (the optional
``wandb`` extra).

W&B's own environment variables choose the rest: ``WANDB_MODE=offline`` writes the run under
the run directory without network (``wandb sync`` uploads it later), ``WANDB_PROJECT`` /
``WANDB_ENTITY`` name where it goes. The W&B run id is kept in the run directory
(``wandb/run_id.json``), so a resumed edl run continues the same W&B run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edl.io.formats.files import write_text_atomic
from edl.train.callbacks.metrics_log import logged, scalars
from edl.train.core import Callback, RunStart, StepInfo

__all__ = ["WandbLog", "wandb_available"]

RUN_ID_FILE = Path("wandb", "run_id.json")  # beside the run files W&B writes under wandb/


def wandb_available() -> bool:
    """Whether ``wandb`` is installed."""
    return importlib.util.find_spec("wandb") is not None


def _run_id(directory: Path) -> str:
    """The W&B run id of the edl run in ``directory``: read back on resume, else new."""
    path = directory / RUN_ID_FILE
    if path.exists():
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["id"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}: not a W&B run id record ({e}); delete it to start a new W&B run"
            ) from None
    run_id = uuid.uuid4().hex[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"id": run_id}) + "\n")
    return run_id


class WandbLog(Callback):
    """Every numeric metric at its step, on the steps a ``MetricsLog`` with the same
    ``interval`` writes, and ``config`` as the W&B run's config; W&B writes its files under
    ``directory/wandb/`` (``directory``: the edl run directory). A resumed run logs again
    from its checkpoint's step: W&B keeps the first value it got for a step it has seen (it
    warns and drops the repeat)."""

    every = 1

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        interval: int = 1,
        config: Mapping[str, Any] | None = None,
        project: str | None = None,
    ) -> None:
        if not wandb_available():
            raise ImportError("WandbLog needs wandb: pip install 'edl-jax[wandb]'")
        self.directory, self.interval = Path(directory), interval
        self.config, self.project = dict(config or {}), project
        self._run: Any = None

    def on_start(self, run: RunStart) -> None:
        import wandb

        run_id = _run_id(self.directory)
        self._run = wandb.init(
            project=self.project,
            id=run_id,
            resume="allow",
            dir=str(self.directory),
            config=self.config,
        )

    def on_step(self, info: StepInfo) -> None:
        if self._run is None or not logged(info, self.interval):
            return
        self._run.log(scalars(info.metrics), step=info.step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
