"""``Evaluate``: held-out metrics every so many steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from edl.compile_cache import announce_compile
from edl.state import TrainState
from edl.train.core import Callback, StepInfo, to_host

__all__ = ["Evaluate", "evaluate"]

EvalStep = Callable[[TrainState, Any], Mapping[str, Any]]


def evaluate(
    state: TrainState,
    eval_step: EvalStep,
    batches: Iterable[Any],
    *,
    max_batches: int | None = None,
) -> dict[str, float]:
    """``eval_step`` over at most ``max_batches`` of ``batches``, combined into ``eval_*``
    metrics: ``count`` summed, every other number averaged with the batches'
    ``count`` (else 1) as weights, so the result is the mean over all counted targets.
    """
    totals: dict[str, float] = {}
    weight_sum, n = 0.0, 0
    for batch in batches:
        if max_batches is not None and n >= max_batches:
            break
        metrics = to_host(eval_step(state, batch))
        weight = float(metrics.get("count", 1.0))
        for key, value in metrics.items():
            if key == "count":
                totals[key] = totals.get(key, 0.0) + value
            elif isinstance(value, float | int):
                totals[key] = totals.get(key, 0.0) + value * weight
        weight_sum += weight
        n += 1
    if n == 0:
        raise ValueError("evaluate: the evaluation data yielded no batches")
    return {
        f"eval_{k}": v if k == "count" else v / max(weight_sum, 1e-12) for k, v in totals.items()
    }


class Evaluate(Callback):
    """``eval_*`` metrics (see :func:`evaluate`) every ``every`` steps and after the last.

    ``data``: an iterable of batches, re-iterated at each evaluation (a list), or a
    callable returning a fresh iterable. ``echo`` (None: silent) hears that the first
    evaluation compiles the eval step, and how long that evaluation took.
    """

    def __init__(
        self,
        eval_step: EvalStep,
        data: Iterable[Any] | Callable[[], Iterable[Any]],
        *,
        every: int,
        max_batches: int | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.eval_step, self.data, self.every, self.max_batches = (
            eval_step,
            data,
            every,
            max_batches,
        )
        self.echo, self._compiled = echo, False

    def metrics(self, info: StepInfo) -> dict[str, float]:
        batches = self.data() if callable(self.data) else self.data
        if self._compiled or self.echo is None:
            return evaluate(info.state, self.eval_step, batches, max_batches=self.max_batches)
        with announce_compile("the eval step (and the first evaluation)", self.echo):
            out = evaluate(info.state, self.eval_step, batches, max_batches=self.max_batches)
        self._compiled = True
        return out
