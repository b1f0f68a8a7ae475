"""``ProgressBar``: a tqdm bar over the schedule, with held-out evaluations printed above it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm.auto import tqdm

from edl.train.core import Callback, RunEnd, RunStart, StepInfo

__all__ = ["ProgressBar", "console"]


def console(message: str) -> None:
    """Print ``message`` to stderr above any progress bar (``tqdm.write``)."""
    tqdm.write(message, file=sys.stderr)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


SHOWN = (
    "reward_mean",
    "rewards/margins",
    "rewards/accuracies",
    "loss",
    "tokens_per_s",
    "mfu",
)
"""The bar's metrics, those a step reports, in this order: each method's main number first
(GRPO's mean reward, DPO's reward margin and accuracy; their losses are near zero or
constant by construction), then the loss, tokens/s and MFU."""


class ProgressBar(Callback):
    """The steps done out of the schedule, with ``shown`` metrics (``SHOWN``) as the bar's
    postfix; after an evaluation, a line with its ``eval_*`` metrics."""

    every = 1

    def __init__(self, shown: Sequence[str] = SHOWN) -> None:
        self.shown = tuple(shown)
        self._bar: tqdm | None = None

    def on_start(self, run: RunStart) -> None:
        self._bar = tqdm(
            total=run.steps, initial=run.start_step, dynamic_ncols=True, file=sys.stderr
        )

    def on_step(self, info: StepInfo) -> None:
        assert self._bar is not None
        self._bar.update(info.step - self._bar.n)
        postfix = {k: _fmt(info.metrics[k]) for k in self.shown if k in info.metrics}
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        evals = {k: v for k, v in info.metrics.items() if k.startswith("eval_")}
        if evals:
            shown = ", ".join(f"{k} {_fmt(v)}" for k, v in evals.items())
            console(f"step {info.step}/{info.steps}: {shown}")

    def on_end(self, end: RunEnd) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
