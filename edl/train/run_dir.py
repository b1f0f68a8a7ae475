"""A run's output directory: never mixing two runs, and resuming from the newest checkpoint
that loads.

A run directory holds ``metrics.jsonl``, ``checkpoints/``, ``run.md``, ``loss.png`` and,
as chosen, ``tensorboard/``, ``wandb/`` and ``profile/``. :func:`prepare` decides what a
new call of ``edl.train.train`` does with what is there: refuse (an earlier run, neither
``resume`` nor ``overwrite``), delete it (``overwrite``), or continue it (``resume``): the
newest checkpoint whose files are whole is loaded (newer, corrupt ones are moved aside as
``checkpoint-N.corrupt``, saying why), the data position restored, and ``metrics.jsonl``
cut back to the checkpoint's step, so the log holds one line per step whatever was killed
when.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from edl.io.checkpoint import list_checkpoints, load_state, verify_checkpoint
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.files import write_text_atomic
from edl.io.formats.safetensors import CheckpointError
from edl.sharding import sync_processes
from edl.state import TrainState
from edl.train.callbacks.metrics_log import METRICS_FILE
from edl.train.data import Resumable

__all__ = [
    "Prepared",
    "check",
    "prepare",
    "read_history",
]

CHECKPOINTS = "checkpoints"
RUN_ARTEFACTS = (METRICS_FILE, CHECKPOINTS, "run.md", "loss.png", "tensorboard", "wandb", "profile")
"""What a run writes into its directory (and ``overwrite`` deletes; nothing else is touched)."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The state to start from and what the resumed run had done: its metrics ``history``
    (up to the checkpoint), ``elapsed`` seconds and the checkpoint's step (``None``: a new
    run)."""

    state: TrainState
    history: list[dict[str, Any]]
    elapsed: float
    resumed_from: int | None


def earlier_run(directory: Path) -> list[str]:
    """The run artefacts in ``directory`` (an empty ``checkpoints/`` does not count)."""
    found = []
    for name in RUN_ARTEFACTS:
        path = directory / name
        if path.is_dir() and name == CHECKPOINTS and not any(path.iterdir()):
            continue
        if path.exists():
            found.append(name)
    return found


TRASH_PREFIX = ".edl-overwritten-"


def _remove_run(directory: Path, names: list[str]) -> None:
    """Delete the artefacts ``names``: first moved into one hidden folder (so a kill midway
    leaves no half-deleted run behind), then that folder."""
    trash = directory / f"{TRASH_PREFIX}{uuid.uuid4().hex[:8]}"
    trash.mkdir()
    for name in names:
        os.replace(directory / name, trash / name)
    shutil.rmtree(trash)


def read_history(path: Path) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl`` (``[]`` when it does not exist), in order; a
    partial last line (a kill mid-write) is left out, any other bad line raises, naming it."""
    return _read_history(path, sys.maxsize, rewrite=False)


def _read_history(path: Path, upto: int, *, rewrite: bool = True) -> list[dict[str, Any]]:
    """The lines of ``metrics.jsonl`` with ``step <= upto``; with ``rewrite`` the file is
    rewritten (atomically) to hold exactly those."""
    if not path.exists():
        return []
    kept, lines = [], []
    text = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(text):  # a kill mid-write leaves a partial last line
                continue
            raise ValueError(f"{path}: line {number} is not JSON: {line[:80]!r}") from None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and step <= upto:
            kept.append(record)
            lines.append(line)
    if rewrite:
        write_text_atomic(path, "".join(f"{line}\n" for line in lines))
    return kept


def _newest_loadable(
    checkpoints: Path, echo: Callable[[str], None]
) -> tuple[Path | None, dict[str, Any]]:
    """The newest checkpoint whose files are whole, after moving newer corrupt ones aside;
    with checkpoints present but none whole, an error naming each and why."""
    found = list_checkpoints(checkpoints)
    problems: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            info = verify_checkpoint(path)
        except CheckpointError as e:
            problems.append((path, str(e)))
            continue
        _set_aside(problems, echo)
        return path, info
    if problems:
        listed = "\n".join(f"  {p.name}: {why}" for p, why in problems)
        raise CheckpointError(
            f"resume: no checkpoint in {checkpoints} is whole:\n{listed}\nRepair or remove "
            "them, or start again with overwrite=True (--overwrite)"
        )
    return None, {}


def _set_aside(problems: list[tuple[Path, str]], echo: Callable[[str], None]) -> None:
    """Rename corrupt checkpoints so no reader takes them for the newest again."""
    for path, why in problems:
        aside = path.with_name(f"{path.name}.corrupt")
        if aside.exists():
            aside = path.with_name(f"{path.name}.corrupt-{uuid.uuid4().hex[:6]}")
        os.replace(path, aside)
        echo(f"skipping {path.name}: {why}; moved it to {aside.name}")


def check(directory: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """The earlier run's artefacts in ``directory``; raises what :func:`prepare` would
    refuse (cheap: callers check before any other work)."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other; choose one")
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"output directory {directory} is a file")
    found = earlier_run(directory) if directory.is_dir() else []
    if found and not (resume or overwrite):
        raise FileExistsError(
            f"{directory} holds an earlier run ({', '.join(found)}): continue it "
            "(resume=True; edl train --resume) or delete it first (overwrite=True; "
            "edl train --overwrite), or choose another output directory"
        )
    return found


def prepare(
    directory: str | os.PathLike[str],
    state: TrainState,
    data: Any,
    *,
    resume: bool,
    overwrite: bool,
    echo: Callable[[str], None],
    base: BaseReference | None = None,
) -> Prepared:
    """Get ``directory`` ready for a run starting from ``state`` (see the module docstring).

    In a multi-process run every process calls it; process 0 alone changes the directory
    (deletes, sets corrupt checkpoints aside, cuts ``metrics.jsonl``), the others wait
    for it, then read the same checkpoint.

    ``base``: the reference to the base model ``state`` was built from, which an
    adapter-only checkpoint must have been trained on (``edl.io.checkpoint.load_state``).

    Raises ``FileExistsError`` for an earlier run without ``resume`` or ``overwrite``,
    ``CheckpointError`` when checkpoints exist but none is whole, and ``ValueError`` when
    ``resume`` and ``overwrite`` are both set.
    """
    out = Path(directory)
    found = check(out, resume=resume, overwrite=overwrite)
    lead = jax.process_index() == 0  # the one process that changes the directory
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(f"{TRASH_PREFIX}*"):  # an earlier overwrite killed mid-delete
            shutil.rmtree(stale)
        if found and overwrite:
            _remove_run(out, found)
            echo(f"overwrite: deleted the earlier run in {out} ({', '.join(found)})")
    if not resume:
        sync_processes("edl-run-dir-ready")
        return Prepared(state, [], 0.0, None)
    if lead:
        checkpoint, info = _newest_loadable(out / CHECKPOINTS, echo)
    sync_processes("edl-run-dir-ready")  # corrupt checkpoints are set aside by now
    if not lead:
        checkpoint, info = _newest_loadable(out / CHECKPOINTS, echo)
    if checkpoint is None:
        # A run killed before its first save.
        history = _read_history(out / METRICS_FILE, 0, rewrite=lead)
        return Prepared(state, history, 0.0, None)
    state, meta = load_state(checkpoint, like=state, base=base)
    step = int(info["step"])
    resumable = isinstance(data, Resumable)
    if "data" in meta and resumable:
        data.restore(meta["data"])
    elif not resumable:
        echo(
            "resume: the data iterator has no position/restore, so it starts from its "
            "beginning (use TokenBatches for exact resumption)"
        )
    history = _read_history(out / METRICS_FILE, step, rewrite=lead)
    elapsed = float(meta.get("elapsed", history[-1]["time"] if history else 0.0))
    echo(f"resuming from {checkpoint.name} (step {step})")
    return Prepared(state, history, elapsed, step)
