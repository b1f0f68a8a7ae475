"""Running lm-eval tasks on an ``EdlLM``: ``evaluate`` (lm-eval's ``simple_evaluate``),
``task_metrics`` (its results as flat numbers), ``write_results`` (JSON, atomic)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from edl.eval.lm import EdlLM
from edl.io.formats.files import write_text_atomic

__all__ = ["evaluate", "task_manager", "task_metrics", "write_results"]


def task_manager(
    include_path: str | Path | Sequence[str | Path] | None = None,
    tasks: Sequence[str] = (),
) -> TaskManager:
    """lm-eval's task index, with the task YAMLs under ``include_path`` (a directory or
    several) added. When every one of ``tasks`` is found there, lm-eval's own ~15k task
    YAMLs are not indexed (that takes ~17 s on a 2-core machine)."""
    if include_path is None:
        return TaskManager()
    paths = [include_path] if isinstance(include_path, str | Path) else list(include_path)
    for path in paths:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"include_path: {path} is not a directory of task YAMLs")
    names = [str(p) for p in paths]
    local = TaskManager(include_path=names, include_defaults=False)
    if tasks and all(t in local.all_tasks for t in tasks):
        return local
    return TaskManager(include_path=names)


def evaluate(
    lm: EdlLM,
    tasks: Sequence[str],
    *,
    manager: TaskManager | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on ``lm`` (no request cache, no
    trackers): its results dictionary (``"results"``: per task ``"acc,none"``, ...)."""
    if not tasks:
        raise ValueError("evaluate: no tasks given")
    manager = task_manager() if manager is None else manager
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"evaluate: unknown task(s) {unknown} (a task YAML's `task:` name; add its "
            "directory with include_path)"
        )
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        batch_size=lm.batch_size,
    )
    if results is None:  # only on ranks other than 0 of a distributed lm-eval
        raise RuntimeError("evaluate: lm-eval returned no results")
    return results


def task_metrics(results: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every finite number of ``results["results"]`` but the standard errors, flat:
    ``{prefix}{task}/{metric}`` (``/{filter}`` after a filter other than ``none``), e.g.
    ``hellaswag/acc_norm``."""
    out: dict[str, float] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filtered = key.partition(",")
            if not filtered or "_stderr" in metric or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                name = metric if filtered == "none" else f"{metric}/{filtered}"
                out[f"{prefix}{task}/{name}"] = float(value)
    return out


def write_results(path: str | Path, results: Mapping[str, Any]) -> None:
    """``results`` as JSON at ``path``, written atomically (values JSON cannot hold as
    lm-eval writes them)."""
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    write_text_atomic(path, text + "\n")
