"""What every ``edl train`` run shares, the embedded byte-level job and fine-tuning alike: the
causal-LM loss over a batch, the output-directory check, and the optimizer, step and loop
built from a ``TrainConfig``."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

import edl
from edl.cli.config import CommandError, TrainConfig
from edl.cli.distributed import GlobalBatches, mesh_of
from edl.io.checkpoint import STATE_NAME, latest_checkpoint
from edl.io.checkpoint.adapter_only import check_same_base, stored_base
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.files import read_json
from edl.models import configure, flops_per_token
from edl.module import Trainable
from edl.ops.checks import check_ids
from edl.sharding import shard_batch
from edl.state import TrainState
from edl.text.tokenizer import Tokenizer
from edl.train import (
    Callback,
    OptimizerConfig,
    make_eval_step,
    make_optimizer,
    make_train_step,
    run_dir,
    train,
)
from edl.train.callbacks.evaluation import EvalStep
from edl.train.core import StepFn
from edl.train.jitted import StepProgram
from edl.train.loop import Batch
from edl.train.run_config import RunConfig, TimeLimitConfig

__all__ = [
    "HostCheckedBatches",
    "check_output_dir",
    "loss_fn",
    "optimizer",
    "step_options",
    "train_model",
]


def loss_fn(
    model: eqx.Module, batch: Mapping[str, np.ndarray | jax.Array]
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The model's causal-LM loss on a ``TokenBatches`` batch (labels, packed segments and
    their positions)."""
    return model.compute_loss(
        jnp.asarray(batch["input_ids"]),
        labels=jnp.asarray(batch["labels"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
        position_ids=jnp.asarray(batch["position_ids"]),
    )


def _checked(batch: Batch, vocab_size: int) -> Batch:
    """``batch`` after its token ids were checked against ``vocab_size`` on the host
    (``edl.ops.checks.check_ids``: ``ValueError`` naming the array and the bad value): every
    ``input_ids`` / ``*_input_ids`` array, and every ``labels`` / ``*_labels`` one (``-100``
    is ignored), so causal-LM and preference batches (``chosen_*`` / ``rejected_*``) alike."""
    for key, value in batch.items():
        if key == "input_ids" or key.endswith("_input_ids"):
            check_ids(np.asarray(value), vocab_size, name=key)
        elif key == "labels" or key.endswith("_labels"):
            check_ids(np.asarray(value), vocab_size, name=key, ignore=-100)
    return batch


class HostCheckedBatches:
    """``data``'s batches, each checked on the host as it is drawn (``_checked``), so the
    compiled train and eval steps need not check their ids (``check_inputs=False``): the
    in-program check is a host callback, and jax never writes a program holding one to its
    persistent compilation cache, so every restart would compile the step again.
    ``position`` / ``restore`` / ``documents`` are ``data``'s (checkpoints keep the data
    position)."""

    def __init__(self, data: Iterator[Batch], vocab_size: int) -> None:
        self.data, self.vocab_size = data, vocab_size

    def __iter__(self) -> HostCheckedBatches:
        return self

    def __next__(self) -> Batch:
        return _checked(next(self.data), self.vocab_size)

    def __getattr__(self, name: str) -> Any:
        if name in ("position", "restore", "documents"):
            return getattr(self.data, name)
        raise AttributeError(name)


def check_output_dir(config: TrainConfig) -> None:
    """Refuse, before any work, an output directory holding another run (unless
    ``--resume`` or ``--overwrite``)."""
    run = config.run
    try:
        run_dir.check(Path(run.output_dir), resume=run.resume, overwrite=run.overwrite)
    except (FileExistsError, NotADirectoryError) as e:
        raise CommandError(str(e)) from None


def optimizer(
    config: TrainConfig, *, updates: int | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)`` of ``config`` over ``updates`` optimizer updates (default
    ``config.run.steps``)."""
    updates = config.run.steps if updates is None else updates
    return make_optimizer(
        OptimizerConfig(
            name=config.optimizer,
            schedule=config.schedule,
            learning_rate=config.peak_learning_rate,
            warmup_steps=min(config.warmup_steps, updates),
            total_steps=updates,
            weight_decay=config.weight_decay,
            muon=config.muon,
        )
    )


def step_options(config: TrainConfig) -> dict[str, Any]:
    """``make_train_step``'s options from ``config`` (clipping, accumulation, precision)."""
    compute = None if config.compute_dtype == config.param_dtype else config.compute_dtype
    return {
        "grad_accum_steps": config.grad_accum_steps,
        "clip_norm": config.clip_norm or None,
        "skip_nonfinite": config.run.nonfinite.policy == "skip",
        "compute_dtype": compute,
    }


def recorded(config: TrainConfig, mesh: jax.sharding.Mesh | None) -> dict[str, object]:
    """What ``run.md`` (and the trackers) record of a run: ``options``, every option that
    shaped it as it took effect (``TrainConfig.in_effect``: ``TrainConfig.from_options`` of
    it makes the same run), and ``environment``: the devices, the mesh and the versions."""
    device = jax.devices()[0]
    environment = {
        "devices": f"{jax.device_count()} x {device.platform} ({device.device_kind})",
        "processes": jax.process_count(),
        "mesh": None if mesh is None else dict(mesh.shape),
        "versions": {
            "edl": edl.__version__,
            "jax": jax.__version__,
            "python": sys.version.split()[0],
        },
    }
    return {"options": config.in_effect(), "environment": environment}


def _run_as_asked(config: TrainConfig, model: eqx.Module, *, evaluates: bool) -> RunConfig:
    """``config.run`` as this run can carry it out: no time limit with several processes
    (said on stderr), no evaluation without held-out batches, and the model's FLOPs per
    token (for MFU) unless given."""
    run = config.run
    if jax.process_count() > 1 and run.time_limit.seconds:
        print(
            "edl train: --time-limit is off with several processes (each would stop at "
            "its own step); size the run by --steps",
            file=sys.stderr,
        )
        run = dataclasses.replace(run, time_limit=TimeLimitConfig())
    if not evaluates:
        run = dataclasses.replace(run, eval=dataclasses.replace(run.eval, every=0))
    if not run.throughput.flops_per_token:
        measured = flops_per_token(model.config, config.seq_len)
        run = dataclasses.replace(
            run, throughput=dataclasses.replace(run.throughput, flops_per_token=measured)
        )
    return run


def check_resumed_base(output_dir: Path, base: BaseReference | None) -> None:
    """Refuse, before the run starts, to resume an adapter-only checkpoint in
    ``output_dir`` from another base than the one it was trained on (``load_state``
    checks it again when it reads the checkpoint): one line naming both hashes."""
    checkpoint = latest_checkpoint(output_dir / run_dir.CHECKPOINTS)
    if checkpoint is None:
        return
    try:
        info = read_json(checkpoint / STATE_NAME, what="checkpoint state")
        stored = stored_base(info, checkpoint)
        if stored is not None:
            check_same_base(stored, base, checkpoint)
    except (OSError, ValueError) as e:
        raise CommandError(f"--resume: {e}") from None


def train_model(
    config: TrainConfig,
    model: eqx.Module,
    data: Iterator[Batch],
    eval_batches: Sequence[Batch] | None,
    *,
    trainable: Trainable = None,
    tokenizer: Tokenizer | None = None,
    callbacks: Sequence[Callback] = (),
    step: StepFn | None = None,
    tx: optax.GradientTransformation | None = None,
    base: BaseReference | None = None,
    eval_step: EvalStep | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """Train ``model`` on ``data`` as ``config`` says (optimizer, schedule, clipping,
    accumulation, precision, checkpoints, evaluation on ``eval_batches`` when given);
    ``trainable`` is ``edl.create_state``'s, ``tokenizer`` is saved in every checkpoint.
    ``step`` (with its optimizer ``tx``) replaces the causal-LM train step (post-training),
    and ``eval_step`` the causal-LM one on ``eval_batches``.
    With ``--mesh`` (or several processes) the state, batches and evaluation live on the
    mesh (``edl.cli.distributed``). ``base``: a LoRA run's base reference, for adapter-only
    checkpoints (``edl.train.train``). Returns ``edl.train.train``'s ``(state, summary)``."""
    mesh = mesh_of(config)
    if step is None:
        tx, schedule = optimizer(config)
        step = make_train_step(loss_fn, tx, schedule=schedule, mesh=mesh, **step_options(config))
        eval_step = make_eval_step(loss_fn, mesh=mesh)
        # Ids checked on the host instead of in the steps: see HostCheckedBatches.
        vocab = model.config.vocab_size
        model, data = configure(model, check_inputs=False), HostCheckedBatches(data, vocab)
        eval_batches = [_checked(b, vocab) for b in eval_batches] if eval_batches else None
    state = edl.create_state(model, tx, trainable=trainable)
    if mesh is not None:
        if not (isinstance(step, StepProgram) and step.mesh is mesh):
            raise CommandError(f"--mesh is for --method sft, not {config.method}")
        state = step.place(state)  # a resumed checkpoint is read straight onto the mesh
        data = GlobalBatches(data, mesh)
        eval_batches = [shard_batch(b, mesh) for b in eval_batches or ()] or None
    run = _run_as_asked(config, model, evaluates=bool(eval_batches))
    return train(
        state,
        step,
        data,
        run,
        callbacks,
        eval_step=eval_step if eval_batches else None,
        eval_data=eval_batches,
        tokenizer=tokenizer,
        record=recorded(dataclasses.replace(config, run=run), mesh),
        base=base,
    )
