"""``RunConfig``: every option of ``edl.train.train``, nested by the callback that owns it.

Each built-in callback with options has a frozen config here (``CheckpointConfig`` for
``Checkpoint``, ``EvalConfig`` for ``Evaluate``, ``LogConfig`` for the metrics log, trackers,
parameter norm and progress bar, ``ThroughputConfig``, ``NonFiniteConfig``,
``TimeLimitConfig``, ``ProfileConfig``); ``RunConfig`` nests them and checks itself when made,
naming the option. Each option's name, help, range and default are declared once, in its
field (``edl._settings.option``): the ``edl train`` flags and TOML keys are derived from them,
and ``to_options`` / ``from_options`` round-trip the configuration ``run.md`` records.

The configs import no jax (the ``edl`` command reads them for ``--help``); the callbacks
they configure are built by ``edl.train.loop``. Adding a callback with an option: its
module in ``edl.train.callbacks``, its config here with a field in ``RunConfig``, and its
line in ``loop.standard_callbacks``.
"""

from __future__ import annotations

import dataclasses
import os

from edl._settings import ConfigError, check_options, from_options, option, to_options
from edl.train.options import NAN_POLICIES, TRACKERS

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "LogConfig",
    "NonFiniteConfig",
    "ProfileConfig",
    "RunConfig",
    "ThroughputConfig",
    "TimeLimitConfig",
]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """``Checkpoint``: when checkpoints are written into ``output_dir/checkpoints``, how
    many are kept, and whether a LoRA run's checkpoints hold its base model. The last step
    is always saved."""

    every: int = option(
        0, "checkpoint every this many steps (0: only at the end)", name="save_every", low=0
    )
    keep: int = option(3, "checkpoints to keep (0: all)", low=0)
    asynchronous: bool = option(
        False,
        "write checkpoints in the background while training goes on (one at a time)",
        name="save_async",
    )
    save_base: bool = option(
        False,
        "LoRA / QLoRA runs: also save the base model in every checkpoint (the full Hugging "
        "Face layout); without it a checkpoint holds the adapters and a reference to the "
        "base (its path or hub repo id and the sha256 of its weights)",
    )

    def __post_init__(self) -> None:
        check_options(self)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """``Evaluate``: every ``every`` steps (and after the last) on at most ``batches``
    batches of ``train``'s ``eval_data``."""

    every: int = option(
        0, "held-out evaluation every this many steps (0: never)", name="eval_every", low=0
    )
    batches: int = option(8, "batches per held-out evaluation", name="eval_batches", low=1)

    def __post_init__(self) -> None:
        check_options(self)


def _tracker_names(text: str) -> tuple[str, ...] | None:
    """``--trackers`` text: ``auto`` (``None``), ``none`` (``()``), or a comma list."""
    if text == "auto":
        return None
    if text == "none":
        return ()
    return tuple(n.strip() for n in text.split(","))


def _tracker_text(names: tuple[str, ...] | None) -> str:
    return "auto" if names is None else ",".join(names) or "none"


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """``MetricsLog`` (``metrics.jsonl``), the trackers, ``ParamNorm`` and ``ProgressBar``."""

    every: int = option(1, "metrics.jsonl interval in steps", name="log_every", low=1)
    stats_every: int = option(
        0, "log the global parameter norm every this many steps (0: never)", low=0
    )
    trackers: tuple[str, ...] | None = option(
        None,
        "where metrics and the config also go: a comma list of tensorboard, wandb (W&B's "
        "WANDB_MODE / WANDB_PROJECT apply), or none; auto: tensorboard when installed",
        parse=_tracker_names,
        text=_tracker_text,
    )
    progress: bool = option(
        True, "a progress bar on stderr (without: messages go to the edl.train logger)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        unknown = [n for n in self.trackers or () if n not in TRACKERS]
        if unknown:
            raise ConfigError(
                f"trackers: {unknown[0]!r} is not one of {', '.join(TRACKERS)} "
                f"(or auto / none); got {_tracker_text(self.trackers)!r}"
            )


@dataclasses.dataclass(frozen=True)
class ThroughputConfig:
    """``Throughput``: MFU is ``tokens/s * flops_per_token / peak_flops`` when both are
    known (0: unknown)."""

    flops_per_token: float = option(
        0.0, "the model's FLOPs per token, for MFU (0: unknown; edl train computes it)", low=0
    )
    peak_flops: float = option(0.0, "the machine's peak FLOP/s, for MFU (0: unknown)", low=0)

    def __post_init__(self) -> None:
        check_options(self)


@dataclasses.dataclass(frozen=True)
class NonFiniteConfig:
    """``NonFinitePolicy``: ``stop`` raises ``NonFiniteLossError`` at a non-finite step
    before it is saved; ``skip`` goes on past the steps the step function skipped
    (``make_train_step(..., skip_nonfinite=True)``) and raises after
    ``max_consecutive_skips`` in a row."""

    policy: str = option(
        "stop",
        "at a non-finite step: stop, or skip it and go on",
        name="nan_policy",
        choices=NAN_POLICIES,
    )
    max_consecutive_skips: int = option(
        10, "with nan_policy skip: raise after this many skipped steps in a row", low=1
    )

    def __post_init__(self) -> None:
        check_options(self)


@dataclasses.dataclass(frozen=True)
class TimeLimitConfig:
    """``TimeLimit``: save and return once ``seconds`` of wall clock have passed (a safety
    net: size runs by ``steps``)."""

    seconds: float = option(
        0.0,
        "safety net: stop (and save) after this many seconds (0: none)",
        name="time_limit",
        low=0,
    )

    def __post_init__(self) -> None:
        check_options(self)


def _profile_steps(text: str) -> tuple[int, int] | None:
    """``--profile`` text: ``START:COUNT`` (empty: none)."""
    if not text:
        return None
    start, sep, count = text.partition(":")
    if not (sep and start.isdigit() and count.isdigit()):
        raise ConfigError(f"profile must be START:COUNT, two ints >= 1 (e.g. 10:3), got {text!r}")
    return int(start), int(count)


def _profile_text(steps: tuple[int, int] | None) -> str:
    return "" if steps is None else f"{steps[0]}:{steps[1]}"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """``Profile``: a ``jax.profiler`` trace of steps ``start`` to ``start + count - 1``
    into ``output_dir/profile``."""

    steps: tuple[int, int] | None = option(
        None,
        "START:COUNT: a jax.profiler trace of steps START to START+COUNT-1 into "
        "OUTPUT_DIR/profile (empty: none)",
        name="profile",
        parse=_profile_steps,
        text=_profile_text,
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.steps is not None and min(self.steps) < 1:
            raise ConfigError(
                f"profile must be START:COUNT, two ints >= 1 (e.g. 10:3), got "
                f"{_profile_text(self.steps)!r}"
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How ``edl.train.train`` runs: its length, run directory, and each standard
    callback's options.

    ``output_dir`` holds ``metrics.jsonl``, checkpoints, ``run.md``, ``loss.png``,
    ``tensorboard/`` and ``profile/``; a directory holding an earlier run is resumed
    (``resume``, exactly: state, optimizer, data position, metrics), deleted first
    (``overwrite``, with ``resume=False``), or refused. Without one the run writes nothing.
    Checked when made: ranges and choices name the option; options that write need
    ``output_dir``.

    Flat options (``edl train``'s flags and TOML keys) build one too:
    ``RunConfig.from_options({"steps": 100, "save_every": 20, "output_dir": "run"})``.
    """

    steps: int = option(
        dataclasses.MISSING,
        "optimizer steps of the run (the schedule's length); a resumed run continues to it",
        low=0,
    )
    output_dir: str | os.PathLike[str] | None = option(
        None, "directory for metrics, checkpoints, run.md (None: the run writes nothing)"
    )
    resume: bool = option(True, "continue the run in --output-dir from its newest checkpoint")
    overwrite: bool = option(False, "delete an earlier run in --output-dir first")
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    throughput: ThroughputConfig = ThroughputConfig()
    nonfinite: NonFiniteConfig = NonFiniteConfig()
    time_limit: TimeLimitConfig = TimeLimitConfig()
    profile: ProfileConfig = ProfileConfig()

    def __post_init__(self) -> None:
        if isinstance(self.output_dir, os.PathLike):  # stored as text: JSON / TOML-ready
            object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
        check_options(self)
        if self.output_dir == "":  # Path("") is the working directory: say so instead
            raise ConfigError("output_dir is empty: give a directory, or None to write nothing")
        if self.resume and self.overwrite:
            raise ConfigError("resume and overwrite exclude each other; choose one")
        if self.output_dir is None:
            writes = {
                "save_every > 0": "the checkpoints",
                "trackers": "their files",
                "profile": "its trace (output_dir/profile)",
            }
            asked = {
                "save_every > 0": self.checkpoint.every > 0,
                "trackers": bool(self.log.trackers),
                "profile": self.profile.steps is not None,
            }
            for what, on in asked.items():
                if on:
                    raise ConfigError(f"{what} needs an output_dir for {writes[what]}")

    @classmethod
    def from_options(cls, values: dict[str, object], *, base: RunConfig | None = None) -> RunConfig:
        """A ``RunConfig`` from flat options (``edl train``'s names: ``save_every``,
        ``eval_every``, ``nan_policy``, ...) over ``base`` (default: the defaults above)."""
        return from_options(cls, values, base=base)

    def to_options(self) -> dict[str, object]:
        """The flat options (JSON / TOML-ready); ``from_options`` reads them back."""
        return to_options(self)
