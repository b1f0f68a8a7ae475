"""``LMEval``: lm-eval tasks on a training run's live parameters every so many steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edl.eval.lm import EdlLM
from edl.eval.run import evaluate, task_manager, task_metrics
from edl.module import merge
from edl.train.core import Callback, StepInfo

__all__ = ["LMEval"]


class LMEval(Callback):
    """lm-eval's metrics of ``tasks`` every ``every`` steps (and after the last), added to
    the step's metrics as ``lm_eval/{task}/{metric}`` (``acc``, ``acc_norm``, perplexities,
    ``exact_match``, ...), so ``metrics.jsonl``, the trackers and the summary get them.

    The model scored is ``edl.merge(state.params, state.other)``, the step's own arrays
    (LoRA adapters and frozen weights as they are): nothing is copied, and the compiled
    scoring programs take the model as an argument, so each evaluation after the first
    reuses them. The task index is built once.

    Args:
        tokenizer: the model's Hugging Face tokenizer (``edl.text.load_tokenizer``).
        tasks: lm-eval task names.
        every: evaluate after steps that are multiples of it and after the last.
        include_path: directories of task YAMLs besides lm-eval's own.
        limit: documents per task at most (an int), or a fraction of them.
        batch_size, max_length: as ``EdlLM``'s.
        echo: hears each evaluation's metrics (None: silent).
    """

    def __init__(
        self,
        tokenizer: Any,
        tasks: Sequence[str],
        *,
        every: int,
        include_path: str | Path | Sequence[str | Path] | None = None,
        limit: int | float | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        if every < 0:
            raise ValueError(f"LMEval: every must be >= 0, got {every}")
        if not tasks:
            raise ValueError("LMEval: no tasks given")
        self.tokenizer, self.tasks, self.every = tokenizer, list(tasks), every
        self.include_path, self.limit, self.echo = include_path, limit, echo
        self.batch_size, self.max_length = batch_size, max_length
        self._manager = None
        self._lm: EdlLM | None = None

    def on_start(self, run: Any) -> None:
        """Index the tasks (and fail on an unknown one) before the first step."""
        self._manager = task_manager(self.include_path, self.tasks)
        unknown = [t for t in self.tasks if t not in self._manager.all_tasks]
        if unknown:
            raise ValueError(f"LMEval: unknown task(s) {unknown}; add their include_path")

    def metrics(self, info: StepInfo) -> dict[str, float]:
        model = merge(info.state.params, info.state.other)
        if self._lm is None:
            self._lm = EdlLM(
                model=model,
                tokenizer=self.tokenizer,
                batch_size=self.batch_size,
                max_length=self.max_length,
            )
        else:
            self._lm.set_model(model)
        if self._manager is None:
            self._manager = task_manager(self.include_path, self.tasks)
        results = evaluate(self._lm, self.tasks, manager=self._manager, limit=self.limit)
        self._lm.set_model(None)  # keep no reference to buffers the next step donates
        out = task_metrics(results, prefix="lm_eval/")
        if self.echo is not None:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(out.items()))
            self.echo(f"step {info.step}: {shown}")
        return out
