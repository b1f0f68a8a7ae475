"""``Checkpoint``: save the state (and the data position) every so many steps and at the end."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from edl.io.checkpoint import latest_checkpoint, save_state
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.files import write_share
from edl.state import TrainState
from edl.text.tokenizer import Tokenizer
from edl.train.core import Callback, RunEnd, StepInfo
from edl.train.data import Resumable

__all__ = ["Checkpoint"]


def _lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: a thread's own nice value),
    so the scheduler favours the training step's threads over a background save's
    (``benchmarks/RESULTS.md``, "train: checkpoints written in the background")."""
    if hasattr(os, "setpriority") and sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Checkpoint(Callback):
    """``edl.io.checkpoint.save_state`` into ``directory`` every ``every`` steps and when
    the run ends (schedule done, time limit, SIGTERM, data exhausted), keeping the newest
    ``keep``. Each checkpoint's metadata holds ``data.position`` (when ``data`` has one) and
    ``elapsed``, the run's seconds so far, which a resumed run continues from; each holds
    ``tokenizer``'s files when it has any (``edl.text.HFTokenizer``). With ``base`` (the
    reference to a LoRA model's base, ``edl.io.formats.base_ref``) each holds the adapters
    alone (``save_state(..., base=)``). ``every=0`` saves only at the end. Not reached
    when the run raises: the newest checkpoint then stays
    the last one saved.

    ``asynchronous``: the loop goes on while a checkpoint is written. The save copies the
    state on its devices (the next step donates the state's buffers) and a background thread
    writes that copy (device to host one tensor at a time, as ``save_state`` always does):
    one save at a time (the next waits for the previous), at most one extra copy of the
    state, and the run's end waits for the last save. The writer runs at the lowest CPU
    priority and writes tensor data for at most ``write_share`` of its time (sleeping in
    between, ``edl.io.formats.files.write_share``), so the steps it overlaps barely slow down; a
    save then takes about ``1 / write_share`` times as long. A failed background save
    raises at the next save or at the end. A kill during a save leaves the previous checkpoint the
    newest complete one, as for a synchronous save."""

    _copy = staticmethod(jax.jit(lambda tree: jax.tree.map(jnp.copy, tree)))

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 0,
        keep: int | None = 3,
        data: Iterator[PyTree] | None = None,
        tokenizer: Tokenizer | None = None,
        echo: Callable[[str], None] = print,
        asynchronous: bool = False,
        write_share: float = 0.25,
        base: BaseReference | None = None,
    ) -> None:
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.base = base
        self.data, self.tokenizer, self.echo = data, tokenizer, echo
        if not 0.0 < write_share <= 1.0:
            raise ValueError(f"Checkpoint: write_share must be in (0, 1], got {write_share!r}")
        self.asynchronous, self.write_share = asynchronous, write_share
        self._saved_step: int | None = None
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def newest(self) -> str | None:
        """The newest complete checkpoint's name, or None."""
        path = latest_checkpoint(self.directory)
        return None if path is None else path.name

    def _save(self, state: TrainState, step: int, elapsed: float) -> None:
        metadata: dict[str, Any] = {"elapsed": elapsed}
        if isinstance(self.data, Resumable):
            metadata["data"] = self.data.position
        self._saved_step = step
        if not self.asynchronous:
            self._write(state, step, metadata)
            return
        self.wait()  # one save at a time
        arrays, rest = eqx.partition(state, eqx.is_array)
        snapshot = eqx.combine(self._copy(arrays), rest)
        self._writer = threading.Thread(
            target=self._write_in_background,
            name=f"edl-save-{step}",
            args=(snapshot, step, metadata),
        )
        self._writer.start()

    def _write(self, state: TrainState, step: int, metadata: dict[str, Any]) -> None:
        path = save_state(
            state,
            self.directory,
            metadata=metadata,
            keep=self.keep,
            tokenizer=self.tokenizer,
            base=self.base,
        )
        self.echo(f"saved {path.name} (step {step})")

    def _write_in_background(self, state: TrainState, step: int, metadata: dict[str, Any]) -> None:
        _lower_priority()
        try:
            with write_share(self.write_share):
                self._write(state, step, metadata)
        except BaseException as e:  # handed to the loop's thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the save in progress (if any) is on disk; raise its error if it
        failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def on_step(self, info: StepInfo) -> None:
        if not info.final:  # the end saves the final state once
            self._save(info.state, info.step, info.elapsed)

    def on_end(self, end: RunEnd) -> None:
        step = end.last.step if end.last is not None else end.start_step
        if end.last is not None and self._saved_step != step:
            self._save(end.state, step, end.elapsed)
        self.wait()

    def close(self) -> None:
        self.wait()
