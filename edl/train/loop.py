"""``train``: the loop core (``edl.train.core``) composed with the standard callbacks.

The loop owns no maths: it feeds batches to the user's jitted ``step(state, batch)`` and
hands every step to callbacks, one per concern (``edl.train.callbacks``): progress bar,
``metrics.jsonl`` / TensorBoard, evaluation, checkpoints with the data position, the
non-finite policy, a wall-clock limit, SIGTERM, ``loss.png`` and ``run.md``. The run
directory (``edl.train.run_dir``) is never shared by two runs: an earlier run is resumed
(exactly: state, optimizer, data position, metrics log) or deleted on request, never mixed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from jaxtyping import PyTree

from edl import module as edl_module
from edl.io.formats.base_ref import BaseReference
from edl.state import TrainState
from edl.text.tokenizer import Tokenizer
from edl.train import run_dir
from edl.train.callbacks import (
    Checkpoint,
    Evaluate,
    LossPlot,
    MetricsLog,
    NonFiniteLossError,
    NonFinitePolicy,
    ParamNorm,
    Profile,
    ProgressBar,
    RunReport,
    StopOnSignal,
    TensorBoardLog,
    Throughput,
    TimeLimit,
    WandbLog,
)
from edl.train.callbacks.progress import console
from edl.train.callbacks.run_report import summarize
from edl.train.callbacks.tensorboard import tensorboard_available
from edl.train.core import Callback, RunEnd, StepFn, run_loop
from edl.train.run_config import RunConfig

__all__ = ["NonFiniteLossError", "RunContext", "standard_callbacks", "train"]

Batch = PyTree
"""A batch: whatever pytree the step takes (``TokenBatches`` yields dicts of arrays)."""

logger = logging.getLogger("edl.train")


def _check_arguments(run: RunConfig, has_eval: bool, callbacks: Sequence[Callback]) -> None:
    """What ``run`` cannot check alone, before any work: evaluation needs its step and
    data, and the user's callbacks must be callbacks."""
    if run.eval.every and not has_eval:
        raise ValueError("train: eval_every > 0 needs eval_step and eval_data")
    bad = [c for c in callbacks if not isinstance(c, Callback)]
    if bad:
        raise TypeError(
            f"train: callbacks must be edl.train.Callback instances (wrap a function with "
            f"edl.train.callback(fn, every=n)), got {bad[0]!r}"
        )


def _echo(progress: bool) -> Callable[[str], None]:
    """Where the run's messages go: the console above the bar, or the ``edl.train`` log."""
    return console if progress else logger.info


def train(
    state: TrainState,
    step_fn: StepFn,
    data: Iterator[Batch],
    run: RunConfig,
    callbacks: Sequence[Callback] = (),
    *,
    eval_step: Callable[[TrainState, Batch], Mapping[str, Any]] | None = None,
    eval_data: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None,
    tokenizer: Tokenizer | None = None,
    record: Mapping[str, object] | None = None,
    base: BaseReference | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """Run ``step_fn`` until ``state.step == run.steps``; returns ``(state, summary)``.

    Args:
        state: the initial state (its structure is the template when resuming).
        step_fn: ``step(state, batch) -> (state, metrics)``, normally ``make_train_step``'s
            jitted function; compiled ahead of time on the first batch.
        data: an iterator of batches; a ``Resumable`` one (``TokenBatches``) has its
            position saved in every checkpoint and restored on resume. Running out ends
            the run early (``stop_reason`` ``"data exhausted"``).
        run: the run's length, directory and each standard callback's options
            (``RunConfig``: checkpoints, evaluation, logging and trackers, throughput, the
            non-finite policy, time limit, profile). A resumed run continues to
            ``run.steps``; skipped steps count.
        callbacks: the user's own (``edl.train.Callback``, or ``edl.train.callback(fn,
            every=n)``), run after the standard ones.
        eval_step, eval_data: what ``run.eval`` evaluates: ``eval_step(state, batch) ->
            metrics`` over ``eval_data`` (an iterable, or a callable returning a fresh one).
        tokenizer: written into every checkpoint when it has files (``edl.text.HFTokenizer``;
            the byte tokenizer has none), so each checkpoint is a model directory that
            transformers' ``AutoTokenizer`` and ``AutoModelForCausalLM`` load as is.
        record: the configuration recorded in ``run.md`` and sent to the trackers (default:
            ``run.to_options()``; ``edl train`` records all its options).
        base: for a LoRA run, the reference to the base model ``state`` was built from
            (``edl.io.formats.base_ref.reference``, hashed once when it was loaded): the
            checkpoints then hold the adapters alone and point at the base
            (``edl.io.checkpoint.adapter_only``), unless ``run.checkpoint.save_base``; a
            resumed adapter-only checkpoint must have been trained on the same base.

    In a multi-process run (``jax.distributed``) only process 0 writes ``metrics.jsonl``,
    the trackers, ``run.md``, ``loss.png`` and the profile; every process keeps the
    metrics history for its summary.

    The summary: ``start_step``, ``end_step``, ``stop_reason``, ``resumed_from``,
    ``compile_seconds``, ``seconds`` (the whole run), ``parameters``, ``first_loss`` /
    ``final_loss``, ``skipped_steps``, ``tokens_per_s`` (median), ``final_eval`` /
    ``final_eval_step``, ``loss_png``.
    """
    _check_arguments(run, eval_step is not None and eval_data is not None, callbacks)
    echo = _echo(run.log.progress)
    out = None if run.output_dir is None else Path(run.output_dir)
    prepared = run_dir.Prepared(state, [], 0.0, None)
    if out is not None:
        prepared = run_dir.prepare(
            out, state, data, resume=run.resume, overwrite=run.overwrite, echo=echo, base=base
        )
    context = RunContext(
        out,
        prepared,
        data,
        echo,
        eval_step=eval_step,
        eval_data=eval_data,
        tokenizer=tokenizer,
        record=run.to_options() if record is None else record,
        base=base,
    )
    standard, summary = standard_callbacks(run, context)
    state, end = run_loop(
        prepared.state,
        step_fn,
        data,
        steps=run.steps,
        callbacks=[*standard, *callbacks],
        elapsed=prepared.elapsed,
        echo=echo,
    )
    return state, summary(end)


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What the standard callbacks need besides ``RunConfig``: the run directory (``None``
    for a run that writes nothing), its prepared (maybe resumed) state, the data, where
    messages go, the evaluation, the tokenizer and the recorded configuration."""

    out: Path | None
    prepared: run_dir.Prepared
    data: Iterator[Batch]
    echo: Callable[[str], None]
    eval_step: Callable[[TrainState, Batch], Mapping[str, Any]] | None = None
    eval_data: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None
    tokenizer: Tokenizer | None = None
    record: Mapping[str, object] | None = None
    base: BaseReference | None = None


def standard_callbacks(
    run: RunConfig, context: RunContext
) -> tuple[list[Callback], Callable[[RunEnd], dict[str, Any]]]:
    """``train``'s callbacks for ``run``, in the order they run, and the function that
    turns the run's end into its summary."""
    out, echo = context.out, context.echo
    lead = out if jax.process_index() == 0 else None  # where process 0 alone writes
    metrics_log = MetricsLog(
        None if lead is None else lead / run_dir.METRICS_FILE,
        interval=run.log.every,
        history=context.prepared.history,
    )
    checkpoints = None if out is None else _checkpoints(run, context, out)
    plot = None if lead is None else LossPlot(lead / "loss.png", metrics_log)
    summary = _summary(context.prepared, metrics_log, plot)
    evaluates = context.eval_step is not None and context.eval_data is not None
    profile = run.profile.steps
    standard: list[Callback | None] = [
        ParamNorm(every=run.log.stats_every) if run.log.stats_every else None,
        Throughput(
            every=run.log.every,
            flops_per_token=run.throughput.flops_per_token or None,
            peak_flops=run.throughput.peak_flops or None,
        ),
        Evaluate(
            context.eval_step,
            context.eval_data,
            every=run.eval.every,
            max_batches=run.eval.batches,
            echo=echo,
        )
        if run.eval.every and evaluates
        else None,
        metrics_log,
        *_trackers(lead, run.log.trackers, run.log.every, context.record),
        Profile(lead / "profile", *profile, echo=echo)
        if lead is not None and profile is not None
        else None,
        NonFinitePolicy(
            run.nonfinite.policy,
            max_consecutive_skips=run.nonfinite.max_consecutive_skips,
            newest_checkpoint=checkpoints.newest if checkpoints else lambda: None,
        ),
        ProgressBar() if run.log.progress else None,
        checkpoints,
        TimeLimit(run.time_limit.seconds, echo=echo) if run.time_limit.seconds else None,
        StopOnSignal(echo=echo),
        plot,
        RunReport(lead / "run.md", summary, config=context.record) if lead is not None else None,
    ]
    return [c for c in standard if c is not None], summary


def _checkpoints(run: RunConfig, context: RunContext, out: Path) -> Checkpoint:
    """``run.checkpoint``'s callback, saving the data position and the tokenizer too, and
    for a LoRA run with a base reference, adapter-only (unless ``save_base``)."""
    return Checkpoint(
        out / run_dir.CHECKPOINTS,
        every=run.checkpoint.every,
        keep=run.checkpoint.keep or None,
        data=context.data,
        tokenizer=context.tokenizer,
        base=None if run.checkpoint.save_base else context.base,
        echo=context.echo,
        asynchronous=run.checkpoint.asynchronous,
    )


def _summary(
    prepared: run_dir.Prepared, metrics_log: MetricsLog, plot: LossPlot | None
) -> Callable[[RunEnd], dict[str, Any]]:
    """The function that turns the run's end into ``train``'s summary."""
    state = prepared.state
    parameters = edl_module.count_params(edl_module.merge(state.params, state.other))

    def summary(end: RunEnd) -> dict[str, Any]:
        return summarize(
            metrics_log.history,
            end,
            resumed_from=prepared.resumed_from,
            parameters=parameters,
            loss_png=None if plot is None or plot.written is None else str(plot.written),
        )

    return summary


def _trackers(
    lead: Path | None,
    names: Sequence[str] | None,
    interval: int,
    config: Mapping[str, Any] | None,
) -> list[Callback]:
    """The trackers ``names`` chose (``None``: TensorBoard if installed), writing under the
    run directory ``lead`` (``None``: this process writes nothing)."""
    if lead is None:
        return []
    if names is None:
        names = ("tensorboard",) if tensorboard_available() else ()
    made: dict[str, Callable[[], Callback]] = {
        "tensorboard": lambda: TensorBoardLog(
            lead / "tensorboard", interval=interval, config=config
        ),
        "wandb": lambda: WandbLog(lead, interval=interval, config=config),
    }
    return [made[name]() for name in dict.fromkeys(names)]
