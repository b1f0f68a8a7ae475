"""The training loop's core: run a step function, hand each step to callbacks.

The core owns no policy (Levanter's trainer is the model: a loop that yields step
information, plus hooks called with an interval). It compiles the step ahead of time on the
first batch, runs it until ``state.step == steps``, and after every step builds an immutable
:class:`StepInfo` that it passes to the callbacks due at that step. Everything a real run
needs around the step (progress bar, metrics log, evaluation, checkpoints, the non-finite
policy, time limit, SIGTERM, plots, ``run.md``) is a :class:`Callback` in
``edl.train.callbacks``; ``edl.train.train`` composes them from its options.

Hooks at both ends of a step (the seed's trainer protocol): ``before_step`` sees the state a
step is about to take; ``replace_state`` may return a state to continue from instead of the
step's (EMA weights, a schedule of frozen layers, pruning masks). A replacement must have the
step's own structure, shapes and dtypes, so the step compiled ahead of time still applies
(checked, naming the callback and the array); it is placed as the step's state is. After
the replacements, a callback may add metrics to the step (``metrics``) and may ask the loop
to stop (``on_step`` returns :class:`Stop`); raising an exception ends the run at once.
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from edl.compile_cache import announce_compile
from edl.state import TrainState
from edl.train.jitted import Step

__all__ = [
    "Callback",
    "RunEnd",
    "RunStart",
    "StepFn",
    "StepInfo",
    "StepStart",
    "Stop",
    "callback",
    "run_loop",
]

StepFn = Callable[[TrainState, Any], tuple[TrainState, Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the loop knows after a step; callbacks get it read-only.

    Attributes:
        step: the steps done, ``state.step`` after this one (1 after the first step).
        steps: the run's total.
        state: the state after the step. With a donating step (the default) its buffers
            are consumed by the next step: read it (or copy it with ``jax.device_get``)
            inside the callback, never keep it for later.
        metrics: the step's metrics as host numbers (a read-only mapping), plus those that
            callbacks added for this step.
        seconds: this step's wall time (its batch and the step), without callbacks' time.
        train_seconds: the sum of ``seconds`` over this process's steps so far.
        elapsed: seconds since the run began, compile and callbacks included; a resumed run
            continues the count of the run it resumes.
    """

    step: int
    steps: int
    state: TrainState
    metrics: Mapping[str, Any]
    seconds: float
    train_seconds: float
    elapsed: float

    @property
    def final(self) -> bool:
        """Whether this is the last step of the schedule (``step == steps``)."""
        return self.step == self.steps

    def with_metrics(self, extra: Mapping[str, Any]) -> StepInfo:
        """A copy whose metrics also hold ``extra``."""
        merged = types.MappingProxyType({**self.metrics, **extra})
        return dataclasses.replace(self, metrics=merged)


@dataclasses.dataclass(frozen=True)
class RunStart:
    """Given to ``Callback.on_start`` before the first step (and before compiling)."""

    state: TrainState
    start_step: int
    steps: int


@dataclasses.dataclass(frozen=True)
class StepStart:
    """Given to ``Callback.before_step`` before a step runs.

    ``step`` is the step about to run (``state.step + 1``: 1 for the first); ``state`` the
    state it takes. With a donating step its buffers are consumed by the step: read them in
    the hook, never keep them.
    """

    step: int
    steps: int
    state: TrainState


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """Given to ``Callback.on_end`` when the loop ends without an exception.

    ``reason``: ``"steps"`` (the schedule is done), ``"already done"`` (it was done before
    the loop started), ``"data exhausted"``, or a callback's :class:`Stop` reason.
    ``last`` is the last step's information (``None`` if no step ran).
    """

    state: TrainState
    reason: str
    start_step: int
    steps: int
    elapsed: float
    compile_seconds: float | None
    last: StepInfo | None


@dataclasses.dataclass(frozen=True)
class Stop:
    """Returned by ``Callback.on_step`` to end the run after this step (the remaining
    callbacks still see the step, then every callback's ``on_end`` runs)."""

    reason: str


class Callback:
    """Base class of the loop's callbacks; every method is optional.

    ``every``: ``before_step``, ``replace_state``, ``metrics`` and ``on_step`` run around
    steps that are multiples of ``every`` and the schedule's last step; ``0`` never
    (``on_start`` / ``on_end`` only). Callbacks run in the order given; each phase
    (``replace_state``, ``metrics``, then ``on_step``) visits all due callbacks before the
    next: a ``replace_state`` gets the state the callbacks before it returned, and a
    callback's ``metrics`` sees those the callbacks before it added.
    """

    every: int = 1

    def on_start(self, run: RunStart) -> None:
        """Before the first step."""

    def before_step(self, start: StepStart) -> None:
        """Before a due step runs, with the state it takes (after its batch is read)."""

    def replace_state(self, info: StepInfo) -> TrainState | None:
        """A state to continue from instead of ``info.state``, or ``None`` to keep it.

        It must match ``info.state``'s structure, shapes and dtypes (the compiled step takes
        it next); arrays placed otherwise (e.g. computed on the host) are moved to the
        state's placement. What later callbacks, checkpoints included, see is the
        replacement. ``info.metrics`` are the step's own.
        """
        return None

    def metrics(self, info: StepInfo) -> Mapping[str, Any] | None:
        """Extra metrics for this step (evaluation, norms, speed), seen by every ``on_step``."""
        return None

    def on_step(self, info: StepInfo) -> Stop | None:
        """Act on the step; return :class:`Stop` to end the run after it."""
        return None

    def on_end(self, end: RunEnd) -> None:
        """After the loop ended normally (not on an exception)."""

    def close(self) -> None:
        """Release resources; runs however the loop ended."""

    def due(self, step: int, steps: int) -> bool:
        """Whether ``metrics`` / ``on_step`` run after ``step``."""
        return self.every > 0 and (step % self.every == 0 or step == steps)


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable[[StepInfo], Stop | None], every: int) -> None:
        self.fn, self.every = fn, every

    def on_step(self, info: StepInfo) -> Stop | None:
        return self.fn(info)

    def __repr__(self) -> str:
        return f"callback({getattr(self.fn, '__name__', self.fn)!r}, every={self.every})"


def callback(fn: Callable[[StepInfo], Stop | None], *, every: int = 1) -> Callback:
    """A callback that calls ``fn(info)`` every ``every`` steps (and after the last);
    ``fn`` may return :class:`Stop` to end the run."""
    _check_every("callback", every)
    return _FunctionCallback(fn, every)


def _check_every(where: str, every: int) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"{where}: every must be an int >= 0, got {every!r}")


def to_host(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Device metrics as Python numbers (scalars) or nested lists, in one transfer."""
    out = {}
    for key, value in jax.device_get(dict(metrics)).items():
        value = np.asarray(value)
        out[key] = value.item() if value.size == 1 else value.tolist()
    return out


def run_loop(
    state: TrainState,
    step_fn: StepFn,
    data: Iterator[Any],
    *,
    steps: int,
    callbacks: Sequence[Callback] = (),
    elapsed: float = 0.0,
    echo: Callable[[str], None] | None = None,
) -> tuple[TrainState, RunEnd]:
    """Run ``step_fn`` until ``state.step == steps`` or a callback stops the run.

    Args:
        state: the state to start from (``state.step`` steps are already done).
        step_fn: ``step(state, batch) -> (state, metrics)``; compiled ahead of time on the
            first batch when it is a :class:`~edl.train.jitted.Step` (``make_train_step``'s)
            or a ``jax.jit`` function.
            It must advance ``state.step`` by one.
        data: an iterator of batches; running out ends the run (reason ``"data exhausted"``).
        steps: the schedule's total number of steps.
        callbacks: run in this order (see :class:`Callback`).
        elapsed: seconds already spent by the run being resumed (``StepInfo.elapsed``
            continues from it).
        echo: where to say that the first step compiles and how long that took
            (``edl.compile_cache.announce_compile``; None: say nothing).

    Returns ``(state, end)``: the state after the last step and how the run ended.
    """
    begin = time.perf_counter()
    clock = lambda: elapsed + time.perf_counter() - begin
    start = int(state.step)
    try:
        for cb in callbacks:
            cb.on_start(RunStart(state=state, start_step=start, steps=steps))
        compile_seconds, last, reason = None, None, "already done"
        if start < steps:
            state, compile_seconds, last, reason = _steps(
                state, step_fn, data, start, steps, callbacks, clock, echo
            )
        end = RunEnd(
            state=state,
            reason=reason,
            start_step=start,
            steps=steps,
            elapsed=clock(),
            compile_seconds=compile_seconds,
            last=last,
        )
        for cb in callbacks:
            cb.on_end(end)
        return state, end
    finally:
        for cb in callbacks:
            cb.close()


def _compile(step_fn: StepFn, state: TrainState, batch: Any) -> tuple[TrainState, StepFn]:
    """The state placed for the step, and the step compiled ahead of time where it can be
    (an edl :class:`~edl.train.jitted.Step`, or a ``jax.jit`` function)."""
    if isinstance(step_fn, Step):
        state = step_fn.place(state)  # a (loaded) state onto the step's mesh
        return state, step_fn.lower(state, batch).compile()
    if isinstance(step_fn, jax.stages.Wrapped):
        return state, step_fn.lower(state, batch).compile()
    return state, step_fn


def _steps(state, step_fn, data, start, steps, callbacks, clock, echo):
    """The step loop proper; returns ``(state, compile_seconds, last_info, reason)``."""
    try:
        batch = next(data)
    except StopIteration:
        return state, None, None, "data exhausted"
    t0 = time.perf_counter()
    # Only a step compiled ahead of time is announced: any other (GRPO's, which samples and
    # compiles inside its first call) would read "ready in 0.0 s".
    if echo is None or not isinstance(step_fn, Step | jax.stages.Wrapped):
        state, compiled = _compile(step_fn, state, batch)
    else:
        with announce_compile("the train step", echo):
            state, compiled = _compile(step_fn, state, batch)
    compile_seconds = time.perf_counter() - t0
    train_seconds, info = 0.0, None
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        if batch is None:
            try:
                batch = next(data)
            except StopIteration:
                return state, compile_seconds, info, "data exhausted"
        due = [cb for cb in callbacks if cb.due(step, steps)]
        hooks = time.perf_counter()
        for cb in due:
            cb.before_step(StepStart(step=step, steps=steps, state=state))
        t0 += time.perf_counter() - hooks  # a step's seconds leave its callbacks' time out
        state, metrics = compiled(state, batch)
        batch = None
        host = to_host(metrics)  # waits for the step: the time below is the step's
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        if step == start + 1 and int(state.step) != step:
            raise ValueError(
                f"train: step_fn took state.step from {start} to {int(state.step)}; a step "
                "must advance it by one (edl.apply_gradients does)"
            )
        info = StepInfo(
            step=step,
            steps=steps,
            state=state,
            metrics=types.MappingProxyType(host),
            seconds=seconds,
            train_seconds=train_seconds,
            elapsed=clock(),
        )
        state = _replaced(info, due)
        info = dataclasses.replace(info, state=state)
        for cb in due:  # each sees the metrics the earlier ones added
            extra = cb.metrics(info)
            if extra:
                info = info.with_metrics(extra)
        stops = [s for s in (cb.on_step(info) for cb in due) if s is not None]
        if stops:
            return state, compile_seconds, info, stops[0].reason
    return state, compile_seconds, info, "steps"


def _replaced(info: StepInfo, due: Sequence[Callback]) -> TrainState:
    """The state after every due callback's ``replace_state``, each checked to fit the
    compiled step and placed as the step's state is."""
    state = info.state
    for cb in due:
        new = cb.replace_state(dataclasses.replace(info, state=state))
        if new is not None:
            state = _fitted(cb, state, new)
    return state


def _fitted(cb: Callback, old: TrainState, new: Any) -> TrainState:
    """``new``, with ``old``'s structure and each array's shape and dtype (else
    ``ValueError`` naming the callback and the first array that differs), moved to
    ``old``'s placement where it differs (a no-op for arrays computed from ``old``'s)."""
    where = f"train: {type(cb).__name__}.replace_state"
    if not isinstance(new, TrainState):
        raise ValueError(f"{where} must return a TrainState or None, got {type(new).__name__}")
    old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(old)
    new_leaves, new_tree = jax.tree_util.tree_flatten(new)
    if old_tree != new_tree:
        raise ValueError(
            f"{where} returned a state of another structure than the step's (the compiled "
            f"step cannot take it): {new_tree} != {old_tree}"
        )
    placed = []
    for (path, a), b in zip(old_leaves, new_leaves, strict=True):
        got, want = (np.shape(b), _dtype(b)), (np.shape(a), _dtype(a))
        if got != want:
            raise ValueError(
                f"{where}: {jax.tree_util.keystr(path)} has shape {got[0]} and dtype "
                f"{got[1]}, the step's state {want[0]} and {want[1]} (the compiled step "
                "takes only those)"
            )
        sharding = getattr(a, "sharding", None)
        same = sharding is None or (
            hasattr(b, "sharding") and b.sharding.is_equivalent_to(sharding, np.ndim(a))
        )
        placed.append(b if same else jax.device_put(b, sharding))
    return jax.tree_util.tree_unflatten(new_tree, placed)


def _dtype(x: Any) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)
