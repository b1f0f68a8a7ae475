"""``Checkpoint``: save the state (and the data position) every so many steps and at the end."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edl.io.checkpoint import latest_checkpoint, save_state
from edl.train.core import Callback, RunEnd, StepInfo

__all__ = ["Checkpoint"]


class Checkpoint(Callback):
    """``edl.io.checkpoint.save_state`` into ``directory`` every ``every`` steps and when
    the run ends (schedule done, time limit, SIGTERM, data exhausted), keeping the newest
    ``keep``. Each checkpoint's metadata holds ``data.position`` (when ``data`` has one) and
    ``elapsed``, the run's seconds so far, which a resumed run continues from; each holds
    ``tokenizer``'s files when it has any (``edl.text.HFTokenizer``). ``every=0``
    saves only at the end. Not reached when the run raises: the newest checkpoint then stays
    the last one saved."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 0,
        keep: int | None = 3,
        data: Any = None,
        tokenizer: Any = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.data, self.tokenizer, self.echo = data, tokenizer, echo
        self._saved_step: int | None = None

    def newest(self) -> str | None:
        """The newest complete checkpoint's name, or None."""
        path = latest_checkpoint(self.directory)
        return None if path is None else path.name

    def _save(self, state: Any, step: int, elapsed: float) -> None:
        metadata: dict[str, Any] = {"elapsed": elapsed}
        if hasattr(self.data, "position"):
            metadata["data"] = self.data.position
        path = save_state(state, self.directory, metadata=metadata, keep=self.keep,
                          tokenizer=self.tokenizer)  # fmt: skip
        self._saved_step = step
        self.echo(f"saved {path.name} (step {step})")

    def on_step(self, info: StepInfo) -> None:
        if not info.final:  # the end saves the final state once
            self._save(info.state, info.step, info.elapsed)

    def on_end(self, end: RunEnd) -> None:
        step = end.last.step if end.last is not None else end.start_step
        if end.last is not None and self._saved_step != step:
            self._save(end.state, step, end.elapsed)
