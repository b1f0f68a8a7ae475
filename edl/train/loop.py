"""A thin training loop around a user's ``step(state, batch)``: logging, checkpoints, resume.

The loop owns no maths: it feeds batches to the jitted step, logs what the step returns,
and handles what a real run needs around it (ahead-of-time compile, progress bar,
``metrics.jsonl``, evaluation, checkpoints with the data position, exact resume, NaN
policies, a wall-clock limit and SIGTERM that both save before leaving, ``run.md``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from tqdm.auto import tqdm

from edl import module as edl_module
from edl.io.checkpoint import latest_checkpoint, load_state, save_state
from edl.state import TrainState
from edl.train.report import loss_curve_png, tensorboard_writer, write_run_summary
from edl.train.step import global_norm

__all__ = ["Hooks", "NonFiniteLossError", "train"]

StepFn = Callable[[TrainState, Any], tuple[TrainState, Mapping[str, Any]]]
Hook = Callable[[TrainState, dict[str, Any]], tuple[TrainState, dict[str, Any]]]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN/Inf and the policy was ``"stop"``."""


@dataclasses.dataclass(frozen=True)
class Hooks:
    """User hooks, pure: ``(state, metrics) -> (state, metrics)``.

    ``on_step_start`` gets ``{"step": n}`` before step ``n``; ``on_step_end`` the step's
    metrics (host floats) after it. Either may return a changed state or metrics.
    """

    on_step_start: Hook | None = None
    on_step_end: Hook | None = None


def _to_host(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    out = {}
    for key, value in jax.device_get(dict(metrics)).items():
        value = np.asarray(value)
        out[key] = value.item() if value.size == 1 else value.tolist()
    return out


def _device_memory() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_in_use")


def _evaluate(state, eval_step, eval_data, max_batches: int) -> dict[str, float]:
    batches = eval_data() if callable(eval_data) else eval_data
    totals: dict[str, float] = {}
    weight_sum, n = 0.0, 0
    for batch in batches:
        if n >= max_batches:
            break
        metrics = _to_host(eval_step(state, batch))
        weight = float(metrics.get("tokens", metrics.get("count", 1.0)))
        for key, value in metrics.items():
            if key in ("tokens", "count"):
                totals[key] = totals.get(key, 0.0) + value
            elif isinstance(value, float | int):
                totals[key] = totals.get(key, 0.0) + value * weight
        weight_sum += weight
        n += 1
    if n == 0:
        raise ValueError("train: eval_data yielded no batches")
    return {
        f"eval_{k}": v if k in ("tokens", "count") else v / max(weight_sum, 1e-12)
        for k, v in totals.items()
    }


class _Stop:
    """SIGTERM flag: the handler only records; the loop saves at the next step boundary."""

    def __init__(self):
        self.reason: str | None = None
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling
            self._previous = None
        return self

    def _handle(self, signum, frame):
        del signum, frame
        self.reason = "sigterm"

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


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
    hooks: Hooks | None = None,
    nan_policy: Literal["stop", "skip"] = "stop",
    time_limit: float | None = None,
    log_every: int = 1,
    stats_every: int = 0,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    keep: int | None = 3,
    config: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> tuple[TrainState, dict[str, Any]]:
    """Run ``step_fn`` until ``state.step == steps``; returns ``(state, summary)``.

    Args:
        state: the initial state (its structure is the template when resuming).
        step_fn: ``step(state, batch) -> (state, metrics)``, normally ``make_train_step``'s
            jitted function; compiled ahead of time on the first batch.
        data: an iterator of batches; if it has ``position``/``restore`` (``TokenBatches``),
            its position is saved in every checkpoint and restored on resume.
        steps: the total number of optimizer steps (a resumed run continues to it).
        eval_step, eval_data, eval_every, eval_batches: evaluate every ``eval_every`` steps
            on at most ``eval_batches`` batches of ``eval_data`` (an iterable, or a callable
            returning a fresh one).
        save_every: checkpoint every ``save_every`` steps (and always at the end) into
            ``output_dir/checkpoints``, keeping the newest ``keep``.
        output_dir: where ``metrics.jsonl``, checkpoints, ``run.md`` and ``loss.png`` go.
        resume: continue from the newest complete checkpoint in ``output_dir`` if any.
        hooks: :class:`Hooks`.
        nan_policy: ``"stop"`` raises :class:`NonFiniteLossError` naming the step (the last
            checkpoint stays the newest); ``"skip"`` counts steps the step function skipped
            (build it with ``make_train_step(..., skip_nonfinite=True)``).
        time_limit: seconds of wall clock; the loop saves and returns when it is exceeded.
        log_every: metrics.jsonl / progress-bar interval in steps.
        stats_every: log the global parameter norm every this many steps (0: never).
        flops_per_token, peak_flops: for MFU (``tokens/s * flops_per_token / peak_flops``).
        config: recorded in ``run.md``.
    """
    hooks = hooks or Hooks()
    out = Path(output_dir) if output_dir is not None else None
    ckpt_dir = out / "checkpoints" if out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    resumed_from = None
    if resume and ckpt_dir is not None and latest_checkpoint(ckpt_dir) is not None:
        state, meta = load_state(ckpt_dir, like=state)
        resumed_from = int(state.step)
        if "data" in meta and hasattr(data, "restore"):
            data.restore(meta["data"])

    def save(state):
        if ckpt_dir is None:
            return None
        meta = {"data": data.position} if hasattr(data, "position") else {}
        return save_state(state, ckpt_dir, metadata=meta, keep=keep)

    start = int(state.step)
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"start_step": start, "resumed_from": resumed_from,
                               "skipped_steps": 0, "stop_reason": "steps"}  # fmt: skip
    metrics_file = open(out / "metrics.jsonl", "a") if out is not None else None  # noqa: SIM115
    board = tensorboard_writer(out) if out is not None else None
    t_begin = time.perf_counter()
    try:
        if start >= steps:
            summary["stop_reason"] = "already done"
            return state, _finish(state, summary, history, out, config, t_begin)
        first = next(data)
        t0 = time.perf_counter()
        if hasattr(step_fn, "place"):  # a ShardedStep: put the (loaded) state on its mesh
            state = step_fn.place(state)
        compiled = step_fn.lower(state, first).compile() if hasattr(step_fn, "lower") else step_fn
        summary["compile_seconds"] = time.perf_counter() - t0
        bar = tqdm(total=steps, initial=start, disable=not progress, dynamic_ncols=True)
        batch, last_time, last_step = first, time.perf_counter(), start
        with _Stop() as stop:
            for step in range(start, steps):
                if batch is None:
                    batch = next(data)
                pre: dict[str, Any] = {}
                if hooks.on_step_start:
                    state, pre = hooks.on_step_start(state, {"step": step})
                state, metrics = compiled(state, batch)
                batch = None
                metrics = {**pre, **_to_host(metrics), "step": step + 1}
                if stats_every and (step + 1) % stats_every == 0:
                    metrics["param_norm"] = float(global_norm(state.params))
                loss = metrics.get("loss", 0.0)
                if not math.isfinite(loss):
                    if nan_policy == "stop":
                        raise NonFiniteLossError(
                            f"train: loss is {loss} at step {step + 1}; stopping (nan_policy="
                            f"'stop'); the newest checkpoint in {ckpt_dir} is the last good state"
                        )
                    if not metrics.get("skipped"):
                        raise NonFiniteLossError(
                            f"train: loss is {loss} at step {step + 1} with nan_policy='skip', "
                            "but the step did not skip it: build it with "
                            "make_train_step(..., skip_nonfinite=True)"
                        )
                summary["skipped_steps"] += int(metrics.get("skipped", 0))
                if hooks.on_step_end:
                    state, metrics = hooks.on_step_end(state, metrics)
                now = time.perf_counter()
                if (step + 1) % log_every == 0 or step + 1 == steps:
                    metrics.update(_throughput(metrics, now - last_time, step + 1 - last_step,
                                               flops_per_token, peak_flops))  # fmt: skip
                    memory = _device_memory()
                    if memory is not None:
                        metrics["memory_bytes"] = memory
                    last_time, last_step = now, step + 1
                    bar.set_postfix({k: f"{metrics[k]:.4g}" for k in ("loss", "tokens_per_s", "mfu")
                                     if k in metrics})  # fmt: skip
                if eval_step is not None and eval_every and (step + 1) % eval_every == 0:
                    t_eval = time.perf_counter()
                    metrics.update(_evaluate(state, eval_step, eval_data, eval_batches))
                    last_time += time.perf_counter() - t_eval
                metrics["time"] = now - t_begin
                history.append(metrics)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(metrics) + "\n")
                    metrics_file.flush()
                if board is not None:
                    board(metrics)
                bar.update(1)
                if time_limit is not None and now - t_begin > time_limit:
                    stop.reason = stop.reason or "time_limit"
                if stop.reason is not None:
                    summary["stop_reason"] = stop.reason
                    break
                if save_every and (step + 1) % save_every == 0 and step + 1 != steps:
                    t_save = time.perf_counter()
                    save(state)
                    last_time += time.perf_counter() - t_save  # throughput: training time only
        bar.close()
        save(state)
        return state, _finish(state, summary, history, out, config, t_begin)
    finally:
        if metrics_file is not None:
            metrics_file.close()


def _throughput(metrics, seconds, steps, flops_per_token, peak_flops) -> dict[str, float]:
    tokens = metrics.get("tokens")
    if tokens is None or seconds <= 0:
        return {}
    rate = tokens * steps / seconds
    out = {"tokens_per_s": rate}
    if flops_per_token and peak_flops:
        out["mfu"] = rate * flops_per_token / peak_flops
    return out


def _finish(state, summary, history, out, config, t_begin) -> dict[str, Any]:
    summary.update(
        end_step=int(state.step),
        seconds=time.perf_counter() - t_begin,
        parameters=edl_module.count_params(edl_module.merge(state.params, state.other)),
        first_loss=history[0]["loss"] if history else None,
        final_loss=history[-1]["loss"] if history else None,
    )
    rates = [m["tokens_per_s"] for m in history if "tokens_per_s" in m]
    if rates:
        summary["tokens_per_s"] = float(np.median(rates))
    evals = [m for m in history if any(k.startswith("eval_") for k in m)]
    if evals:
        summary["final_eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
        summary["final_eval_step"] = evals[-1]["step"]
    if out is not None:
        summary["loss_png"] = loss_curve_png(out, history)
        write_run_summary(out / "run.md", summary, config)
    return summary
