"""``train``: the loop core (``edl.train.core``) composed with the standard callbacks.

The loop owns no maths: it feeds batches to the user's jitted ``step(state, batch)`` and
hands every step to callbacks, one per concern (``edl.train.callbacks``): progress bar,
``metrics.jsonl`` / TensorBoard, evaluation, checkpoints with the data position, the
non-finite policy, a wall-clock limit, SIGTERM, ``loss.png`` and ``run.md``. The run
directory (``edl.train.run_dir``) is never shared by two runs: an earlier run is resumed
(exactly: state, optimizer, data position, metrics log) or deleted on request, never mixed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax

from edl import module as edl_module
from edl.state import TrainState
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
from edl.train.options import NAN_POLICIES, TRACKERS

__all__ = ["NonFiniteLossError", "train"]

logger = logging.getLogger("edl.train")


def _check_options(
    *,
    steps: int,
    nan_policy: str,
    eval_every: int,
    eval_batches: int,
    save_every: int,
    log_every: int,
    stats_every: int,
    keep: int | None,
    time_limit: float | None,
    max_consecutive_skips: int,
    has_eval: bool,
    has_output: bool,
    callbacks: Sequence[Any],
    trackers: Sequence[str] | None,
    profile: tuple[int, int] | None,
) -> None:
    """Every option checked before any work, naming the option and what it allows."""
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"train: nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
    minimum = {
        "steps": (steps, 0),
        "eval_every": (eval_every, 0),
        "eval_batches": (eval_batches, 1),
        "save_every": (save_every, 0),
        "log_every": (log_every, 1),
        "stats_every": (stats_every, 0),
        "max_consecutive_skips": (max_consecutive_skips, 1),
    }
    for name, (value, low) in minimum.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"train: {name} must be an int >= {low}, got {value!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"train: keep must be an int >= 1 or None, got {keep!r}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"train: time_limit must be > 0 seconds or None, got {time_limit!r}")
    if eval_every and not has_eval:
        raise ValueError("train: eval_every > 0 needs eval_step and eval_data")
    if save_every and not has_output:
        raise ValueError("train: save_every > 0 needs an output_dir for the checkpoints")
    if trackers is not None:
        unknown = [t for t in trackers if t not in TRACKERS]
        if isinstance(trackers, str) or unknown:
            raise ValueError(f"train: trackers must be a sequence of {TRACKERS}, got {trackers!r}")
        if trackers and not has_output:
            raise ValueError(
                "train: trackers write into the run directory: they need an output_dir"
            )
    if profile is not None:
        if not has_output:
            raise ValueError(
                "train: profile writes its trace into output_dir/profile: it needs an output_dir"
            )
        ok = isinstance(profile, tuple) and len(profile) == 2
        if not ok or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in profile):
            raise ValueError(
                f"train: profile must be (start_step, count), ints >= 1, got {profile!r}"
            )
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
    data: Iterator[Any],
    *,
    steps: int,
    eval_step: Callable[[TrainState, Any], Mapping[str, Any]] | None = None,
    eval_data: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
    eval_every: int = 0,
    eval_batches: int = 8,
    save_every: int = 0,
    output_dir: str | os.PathLike[str] | None = None,
    resume: bool = True,
    overwrite: bool = False,
    nan_policy: Literal["stop", "skip"] = "stop",
    max_consecutive_skips: int = 10,
    time_limit: float | None = None,
    log_every: int = 1,
    stats_every: int = 0,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    keep: int | None = 3,
    config: Mapping[str, Any] | None = None,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    tokenizer: Any = None,
    trackers: Sequence[str] | None = None,
    profile: tuple[int, int] | None = None,
    save_async: bool = False,
) -> tuple[TrainState, dict[str, Any]]:
    """Run ``step_fn`` until ``state.step == steps``; returns ``(state, summary)``.

    Args:
        state: the initial state (its structure is the template when resuming).
        step_fn: ``step(state, batch) -> (state, metrics)``, normally ``make_train_step``'s
            jitted function; compiled ahead of time on the first batch.
        data: an iterator of batches; if it has ``position``/``restore`` (``TokenBatches``),
            its position is saved in every checkpoint and restored on resume. Running out
            ends the run early (``stop_reason`` ``"data exhausted"``).
        steps: the total number of steps (a resumed run continues to it); skipped steps
            count.
        eval_step, eval_data, eval_every, eval_batches: evaluate every ``eval_every`` steps
            and after the last, on at most ``eval_batches`` batches of ``eval_data`` (an
            iterable, or a callable returning a fresh one).
        save_every: checkpoint every ``save_every`` steps (and always at the end) into
            ``output_dir/checkpoints``, keeping the newest ``keep``.
        output_dir: where ``metrics.jsonl``, checkpoints, ``run.md``, ``loss.png`` and
            ``tensorboard/`` go. A directory holding an earlier run is resumed (``resume``),
            deleted first (``overwrite``), or refused (neither).
        resume: continue the run in ``output_dir`` from its newest checkpoint that is whole
            (newer corrupt ones are moved aside, saying why); ``metrics.jsonl`` is cut back to
            that step and the summary, ``run.md`` and ``loss.png`` cover the whole run.
        overwrite: delete the earlier run's files in ``output_dir`` first.
        nan_policy: ``"stop"`` raises :class:`NonFiniteLossError` at a step whose loss,
            gradients or updates are NaN/Inf, before it is saved (the newest checkpoint is
            the last good state); ``"skip"`` goes on past steps the step function skipped
            (build it with ``make_train_step(..., skip_nonfinite=True)``), and raises after
            ``max_consecutive_skips`` in a row.
        time_limit: seconds of wall clock; the loop saves and returns when it is exceeded,
            saying so (a safety net: size runs by ``steps``).
        log_every: the ``metrics.jsonl`` / TensorBoard / throughput interval in steps
            (evaluated and skipped steps are always logged).
        stats_every: log the global parameter norm every this many steps (0: never).
        flops_per_token, peak_flops: for MFU (``tokens/s * flops_per_token / peak_flops``).
        config: recorded in ``run.md``.
        progress: a progress bar, with evaluations and messages printed on stderr; without
            it, messages go to the ``edl.train`` logger.
        callbacks: the user's own (``edl.train.Callback``, or ``edl.train.callback(fn,
            every=n)``), run after the standard ones.
        tokenizer: written into every checkpoint when it has files (``edl.text.HFTokenizer``;
            the byte tokenizer has none), so each checkpoint is a model directory that
            transformers' ``AutoTokenizer`` and ``AutoModelForCausalLM`` load as is.
        trackers: where metrics (and ``config``) also go, besides ``metrics.jsonl``:
            ``"tensorboard"`` (``tensorboard/``, the ``tensorboard`` extra) and ``"wandb"``
            (Weights & Biases, the ``wandb`` extra; ``WANDB_MODE=offline`` keeps it local,
            ``WANDB_PROJECT`` names the project). ``None``: TensorBoard when installed.
        profile: ``(start, count)``: a ``jax.profiler`` trace of steps ``start`` to
            ``start + count - 1`` into ``output_dir/profile``.
        save_async: write checkpoints in a background thread while the steps go on (one
            at a time, from a copy of the state on its devices; ``Checkpoint``'s
            ``asynchronous``); the run returns once the last one is on disk.

    In a multi-process run (``jax.distributed``) only process 0 writes ``metrics.jsonl``,
    the trackers, ``run.md``, ``loss.png`` and the profile; every process keeps the
    metrics history for its summary.

    The summary: ``start_step``, ``end_step``, ``stop_reason``, ``resumed_from``,
    ``compile_seconds``, ``seconds`` (the whole run), ``parameters``, ``first_loss`` /
    ``final_loss``, ``skipped_steps``, ``tokens_per_s`` (median), ``final_eval`` /
    ``final_eval_step``, ``loss_png``.
    """
    _check_options(
        steps=steps,
        nan_policy=nan_policy,
        eval_every=eval_every,
        eval_batches=eval_batches,
        save_every=save_every,
        log_every=log_every,
        stats_every=stats_every,
        keep=keep,
        time_limit=time_limit,
        max_consecutive_skips=max_consecutive_skips,
        has_eval=eval_step is not None and eval_data is not None,
        has_output=output_dir is not None,
        callbacks=callbacks,
        trackers=trackers,
        profile=profile,
    )
    echo = _echo(progress)
    out = None if output_dir is None else Path(output_dir)
    prepared = run_dir.Prepared(state, [], 0.0, None)
    if out is not None:
        prepared = run_dir.prepare(out, state, data, resume=resume, overwrite=overwrite, echo=echo)
    standard, summary = _standard_callbacks(
        out,
        prepared,
        data,
        echo,
        eval_step=eval_step,
        eval_data=eval_data,
        eval_every=eval_every,
        eval_batches=eval_batches,
        save_every=save_every,
        keep=keep,
        nan_policy=nan_policy,
        max_consecutive_skips=max_consecutive_skips,
        time_limit=time_limit,
        log_every=log_every,
        stats_every=stats_every,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops,
        config=config,
        progress=progress,
        tokenizer=tokenizer,
        trackers=trackers,
        profile=profile,
        save_async=save_async,
    )
    state, end = run_loop(
        prepared.state,
        step_fn,
        data,
        steps=steps,
        callbacks=[*standard, *callbacks],
        elapsed=prepared.elapsed,
    )
    return state, summary(end)


def _standard_callbacks(
    out: Path | None,
    prepared: run_dir.Prepared,
    data: Iterator[Any],
    echo: Callable[[str], None],
    *,
    eval_step: Callable[..., Any] | None,
    eval_data: Any,
    eval_every: int,
    eval_batches: int,
    save_every: int,
    keep: int | None,
    nan_policy: str,
    max_consecutive_skips: int,
    time_limit: float | None,
    log_every: int,
    stats_every: int,
    flops_per_token: float | None,
    peak_flops: float | None,
    config: Mapping[str, Any] | None,
    progress: bool,
    tokenizer: Any = None,
    trackers: Sequence[str] | None = None,
    profile: tuple[int, int] | None = None,
    save_async: bool = False,
) -> tuple[list[Callback], Callable[[RunEnd], dict[str, Any]]]:
    """``train``'s callbacks, in the order they run, for its options (``out`` is the run
    directory, ``None`` for a run that writes nothing), and the function that turns the
    run's end into its summary."""
    lead = out if jax.process_index() == 0 else None  # where process 0 alone writes
    metrics_log = MetricsLog(
        None if lead is None else lead / run_dir.METRICS_FILE,
        interval=log_every,
        history=prepared.history,
    )
    checkpoints = None
    if out is not None:
        checkpoints = Checkpoint(
            out / run_dir.CHECKPOINTS,
            every=save_every,
            keep=keep,
            data=data,
            tokenizer=tokenizer,
            echo=echo,
            asynchronous=save_async,
        )
    plot = None if lead is None else LossPlot(lead / "loss.png", metrics_log)
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

    evaluates = eval_every and eval_step is not None and eval_data is not None
    standard: list[Callback | None] = [
        ParamNorm(every=stats_every) if stats_every else None,
        Throughput(every=log_every, flops_per_token=flops_per_token, peak_flops=peak_flops),
        Evaluate(eval_step, eval_data, every=eval_every, max_batches=eval_batches)
        if evaluates
        else None,
        metrics_log,
        *_trackers(lead, trackers, log_every, config),
        Profile(lead / "profile", *profile, echo=echo)
        if lead is not None and profile is not None
        else None,
        NonFinitePolicy(
            nan_policy,
            max_consecutive_skips=max_consecutive_skips,
            newest_checkpoint=checkpoints.newest if checkpoints else lambda: None,
        ),
        ProgressBar() if progress else None,
        checkpoints,
        TimeLimit(time_limit, echo=echo) if time_limit is not None else None,
        StopOnSignal(echo=echo),
        plot,
        RunReport(lead / "run.md", summary, config=config) if lead is not None else None,
    ]
    return [c for c in standard if c is not None], summary


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
