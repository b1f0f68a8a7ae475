"""``RunReport``: ``run.md``, the run's summary as a table and its configuration as JSON;
and :func:`summarize`, the summary ``edl.train.train`` returns."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edl.io.formats.files import write_text_atomic
from edl.train.core import Callback, RunEnd

__all__ = ["RunReport", "read_run_record", "summarize", "write_run_summary"]

_RECORD_START, _RECORD_END = "## Configuration\n\n```json\n", "\n```\n"


def summarize(history: Sequence[Mapping[str, Any]], end: RunEnd, **extra: Any) -> dict[str, Any]:
    """The run's summary from the whole run's metrics ``history`` (a resumed run's included)
    and how the loop ``end``-ed: start/end step, stop reason, compile and total seconds, first
    and final loss, skipped steps, median tokens/s, the last evaluation; then ``extra``."""
    summary: dict[str, Any] = {
        "start_step": end.start_step,
        "end_step": end.last.step if end.last is not None else end.start_step,
        "stop_reason": end.reason,
        "compile_seconds": end.compile_seconds,
        "seconds": end.elapsed,
        "first_loss": history[0].get("loss") if history else None,
        "final_loss": history[-1].get("loss") if history else None,
        "skipped_steps": int(sum(m.get("skipped", 0) for m in history)),
    }
    rates = [m["tokens_per_s"] for m in history if "tokens_per_s" in m]
    if rates:
        summary["tokens_per_s"] = float(np.median(rates))
    evals = [m for m in history if any(k.startswith("eval_") for k in m)]
    if evals:
        summary["final_eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
        summary["final_eval_step"] = evals[-1]["step"]
    summary.update(extra)
    return summary


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)


def write_run_summary(
    path: str | os.PathLike[str], summary: Mapping[str, Any], config: Mapping[str, Any] | None
) -> None:
    """``run.md``: the summary as a table, then the run's configuration as JSON (atomic)."""
    lines = ["# edl run", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {_fmt(value)} |" for key, value in summary.items()]
    text = "\n".join(lines) + "\n"
    if config:
        text += f"\n{_RECORD_START}{json.dumps(config, indent=2, default=str)}{_RECORD_END}"
    write_text_atomic(Path(path), text)


def read_run_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The configuration ``write_run_summary`` put in ``path`` (``run.md``): ``None`` when the
    file or the section is absent; a section that is not a JSON object raises, naming it."""
    path = Path(path)
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    start = text.find(_RECORD_START)
    if start < 0:
        return None
    body = text[start + len(_RECORD_START) :]
    end = body.find(_RECORD_END)
    try:
        record = json.loads(body if end < 0 else body[:end])
    except ValueError as e:
        raise ValueError(f"{path}: its Configuration section is not JSON: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(
            f"{path}: its Configuration section is {type(record).__name__}, not an object"
        )
    return record


class RunReport(Callback):
    """Writes ``path`` (``run.md``) when the run ends, from ``summary(end)``."""

    every = 0

    def __init__(
        self,
        path: str | os.PathLike[str],
        summary: Callable[[RunEnd], Mapping[str, Any]],
        *,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.path, self.summary, self.config = Path(path), summary, config

    def on_end(self, end: RunEnd) -> None:
        write_run_summary(self.path, self.summary(end), self.config)
