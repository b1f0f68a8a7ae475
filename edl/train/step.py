"""Composable train / eval steps: pure ``step(state, batch) -> (state, metrics)`` functions.

``loss_fn(model, batch) -> (loss, metrics)`` is the one thing a user writes (every edl task
head's ``compute_loss`` already has that shape). ``make_train_step`` adds gradient
accumulation (``lax.scan`` over micro-batches, weighted by token counts so the accumulated
gradient equals the full-batch one), global-norm clipping, the optimizer update, optional
skipping of non-finite steps, and the standard metrics. Optimizers and schedules are optax's,
built from a small ``OptimizerConfig`` (``edl.train.optimizers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.typing import DTypeLike
from jaxtyping import PyTree

from edl import module as edl_module
from edl import state as edl_state
from edl.sharding import Rules
from edl.state import TrainState
from edl.train.jitted import StepProgram
from edl.train.optimizers import OptimizerConfig, make_optimizer, make_schedule

__all__ = ["global_norm", "make_eval_step", "make_train_step"]

# The optimizers moved to edl.train.optimizers; importable from here as before.
_MOVED = (OptimizerConfig, make_optimizer, make_schedule)

LossFn = Callable[[Any, Any], tuple[jax.Array, Mapping[str, jax.Array]]]
Batch = Mapping[str, jax.Array]


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every inexact array leaf is finite (a boolean scalar)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return (
        jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
        if leaves
        else jnp.asarray(True)
    )


def global_norm(tree: PyTree) -> jax.Array:
    """sqrt of the sum of squares of every inexact array leaf, in float32.

    Not ``optax.global_norm``: that sums in each leaf's own dtype (bfloat16 gradients would
    sum in bfloat16) and takes every leaf, integer ones included.
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def _micro_batches(batch: Batch, steps: int) -> Batch:
    def split(path, x):
        if x.shape[0] % steps:
            raise ValueError(
                f"make_train_step: batch{jax.tree_util.keystr(path)} has leading size "
                f"{x.shape[0]}, not divisible by grad_accum_steps={steps}"
            )
        return x.reshape(steps, x.shape[0] // steps, *x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, batch)


SUMMED_METRICS = ("count", "tokens")
"""Metrics that are totals over the batch (summed over micro-batches): ``count``, what the
loss averages over (target tokens, or pairs), and ``tokens``, the tokens the model ran over
where that differs (preference pairs; what tokens/s counts)."""


ACCUMULATION_WEIGHT = "accumulation_weight"
"""A loss's metric naming its micro-batch's share under accumulation where that is not its
``count`` (GRPO's losses that TRL averages over micro-batches: each weighs the same); read
for the weights, never reported."""


def _weight(metrics: Mapping[str, jax.Array]) -> jax.Array:
    """A micro-batch's share: ``ACCUMULATION_WEIGHT`` when the loss reports one, else its
    token (or example) count when it reports one."""
    if ACCUMULATION_WEIGHT in metrics:
        return jnp.asarray(metrics[ACCUMULATION_WEIGHT], jnp.float32)
    if "count" in metrics:
        return jnp.asarray(metrics["count"], jnp.float32)
    return jnp.ones((), jnp.float32)


def _combine(metrics: Mapping[str, jax.Array], weights: jax.Array) -> dict[str, jax.Array]:
    """Per-micro-batch metrics ``(steps, ...)`` -> one: counts (``SUMMED_METRICS``) sum, the
    rest are means weighted by ``count``."""
    total = jnp.sum(weights)
    safe_total = jnp.where(total > 0, total, 1.0)
    out = {}
    for key, value in metrics.items():
        if key == ACCUMULATION_WEIGHT:
            continue
        value = jnp.asarray(value)
        if key in SUMMED_METRICS:
            out[key] = jnp.sum(value, axis=0)
        else:
            out[key] = jnp.sum(value.astype(jnp.float32) * weights, axis=0) / safe_total
    return out


def _gradients(
    grad_fn: Callable, state: TrainState, batch: Batch, accum_steps: int
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """``(loss, grads, metrics)`` of the batch: with ``accum_steps > 1``, of its micro-batches
    (``lax.scan``), combined by their ``count`` weights into the full batch's (exact)."""
    if accum_steps == 1:
        (loss, metrics), grads = grad_fn(state, batch)
        return loss, grads, {k: v for k, v in metrics.items() if k != ACCUMULATION_WEIGHT}

    def micro(carry, micro_batch):
        (loss, metrics), grads = grad_fn(state, micro_batch)
        w = _weight(metrics)
        carry = jax.tree.map(lambda acc, g: acc + w * g.astype(jnp.float32), carry, grads)
        return carry, (metrics, w, loss)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    total, (metrics, weights, losses) = jax.lax.scan(
        micro, zeros, _micro_batches(batch, accum_steps)
    )
    denom = jnp.sum(weights)
    denom = jnp.where(denom > 0, denom, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), total, state.params)
    loss = jnp.sum(losses.astype(jnp.float32) * weights) / denom
    return loss, grads, _combine(metrics, weights)


def _in_precision(loss_fn: LossFn, compute_dtype: Any) -> LossFn:
    """``loss_fn`` on the model cast to ``compute_dtype`` (None: as it is), its loss and
    floating metrics reported in at least float32."""

    def loss_in_precision(model: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        if compute_dtype is not None:
            model = edl_module.to_dtype(model, compute_dtype)
        loss, metrics = loss_fn(model, batch)
        return _at_least_float32(loss), {k: _at_least_float32(v) for k, v in metrics.items()}

    return loss_in_precision


def _at_least_float32(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    # Not promote_types: strict promotion has no bfloat16 -> float32 path.
    return x if jnp.finfo(x.dtype).bits >= 32 else x.astype(jnp.float32)


def _step_fn(
    grad_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    grad_accum_steps: int,
    clip_norm: float | None,
    schedule: optax.Schedule | None,
    skip_nonfinite: bool,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure step :func:`make_train_step` wraps: gradients (accumulated), clipping, the
    optimizer update, the non-finite check and, with ``skip_nonfinite``, the skip."""

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads, metrics = _gradients(grad_fn, state, batch, grad_accum_steps)
        norm = global_norm(grads)
        if clip_norm is not None:
            # optax.clip_by_global_norm would compute the norm a second time, in each leaf's
            # dtype; this reuses the float32 one the metrics report.
            factor = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-12))
            grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        new_state = edl_state.apply_gradients(state, grads, tx)
        metrics["grad_norm"] = norm
        if schedule is not None:
            with jax.numpy_dtype_promotion("standard"):  # optax mixes int steps and floats
                metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        # The parameters were finite, so non-finite ones now mean a non-finite update.
        # (optax.apply_if_finite checks only the updates, not the loss, and keeps a counter
        # in the optimizer state; this check also catches a NaN loss with finite gradients.)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm) & all_finite(new_state.params)
        metrics["nonfinite"] = (~finite).astype(jnp.int32)
        if skip_nonfinite:  # the step still counts; ``other`` is untouched either way
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
            new_state = edl_state.replace(
                new_state,
                params=keep(new_state.params, state.params),
                opt_state=keep(new_state.opt_state, state.opt_state),
            )
            metrics["skipped"] = metrics["nonfinite"]
        return new_state, metrics

    return step


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    grad_accum_steps: int = 1,
    clip_norm: float | None = None,
    schedule: optax.Schedule | None = None,
    skip_nonfinite: bool = False,
    compute_dtype: DTypeLike | None = None,
    donate: bool = True,
    jit: bool = True,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Build ``step(state, batch) -> (state, metrics)``.

    Precision: the parameters (and the optimizer state that follows them) keep the dtype
    they have in the state, and so do their gradients; ``compute_dtype`` is the dtype the
    model computes in. fp32 master weights with bf16 compute:
    ``make_train_step(loss_fn, tx, compute_dtype=jnp.bfloat16)`` on a float32 state; bf16
    weights: ``edl.create_state(edl.module.to_bfloat16(model), tx)``. edl's attention softmax and
    losses compute in float32 whatever the model's dtype. On CPU, bf16 holds activations
    in bf16 (``edl.nn.packed_scan``): a 135M-shape Llama's LoRA step plans 0.62x the
    float32 step's memory with bf16 weights and compute (``benchmarks/memory.py``).

    Args:
        loss_fn: ``loss_fn(model, batch) -> (scalar loss, metrics dict)``; a ``"count"``
            metric (targets in the mean: tokens, or examples) weights micro-batches (exact
            full-batch gradients).
        tx: the optimizer (``make_optimizer``, or any optax transformation).
        grad_accum_steps: split every batch array's leading axis into this many micro-batches,
            run by ``lax.scan`` (activation memory of one micro-batch).
        clip_norm: clip the global gradient norm to this value (None: no clipping).
        schedule: the learning-rate schedule, only to report ``learning_rate``.
        skip_nonfinite: a non-finite step (see ``nonfinite`` below) leaves the parameters
            and optimizer state unchanged (``metrics["skipped"] == 1``) instead of poisoning
            them; it still counts as a step (``state.step`` advances, the batch is consumed),
            so a run of ``n`` steps ends at ``state.step == n``.
        compute_dtype: cast the model's floating arrays (``edl.to_dtype``) to this dtype
            inside the differentiated function, so the loss sees e.g. a bfloat16 model
            while the gradients come back in each parameter's own dtype (the cast is
            differentiable). None: the state's dtypes as they are. The loss and every
            floating metric are reported in at least float32.
        donate: donate the buffers the step replaces (``step``, ``params``, ``opt_state``;
            jit only): after a call, the input state's parameters and optimizer state are
            deleted. ``other`` (frozen weights, which the model the state was created from
            still shares: a LoRA base) is never donated, and the returned state holds the
            same ``other`` arrays (see ``edl.train.jitted``). False: nothing is donated.
        jit: return the step jitted (a :class:`~edl.train.jitted.StepProgram`); False
            returns the pure function.
        mesh, rules: run SPMD on ``mesh`` (``edl.sharding.make_mesh``): the state is placed by
            ``edl.sharding.state_shardings(state, rules, mesh)`` (``rules=None``: the model's
            own ``partition_rules``, replicated where it has none; optimizer state following
            its parameters), every batch array split over ``dp``/``fsdp`` on its leading
            axis, metrics replicated; traced under ``jax.set_mesh(mesh)`` so the models'
            activation constraints apply (``StepProgram``'s ``mesh``).

    Metrics: the loss function's (``loss``, ``accuracy``, ``count``, ...), ``grad_norm``
    (before clipping), ``learning_rate`` (with ``schedule``), ``nonfinite`` (1 when the loss,
    the gradient norm or any updated parameter is NaN/Inf, so a non-finite update is caught
    even when the loss is finite) and, with ``skip_nonfinite``, ``skipped``.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"make_train_step: grad_accum_steps must be >= 1, got {grad_accum_steps}")
    if compute_dtype is not None:
        compute_dtype = edl_module.require_float_dtype(
            compute_dtype, "make_train_step: compute_dtype"
        )
    grad_fn = edl_state.value_and_grad(_in_precision(loss_fn, compute_dtype), has_aux=True)
    step = _step_fn(grad_fn, tx, grad_accum_steps, clip_norm, schedule, skip_nonfinite)
    if not jit:
        if mesh is not None:
            raise ValueError("make_train_step: mesh= needs jit=True")
        return step
    return StepProgram(
        lambda state, batch, _: step(state, batch), mesh=mesh, rules=rules, donate=donate
    )


def make_eval_step(
    loss_fn: LossFn, *, jit: bool = True, mesh: Mesh | None = None
) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """``eval_step(state, batch) -> metrics`` of ``loss_fn`` on the state's model (with
    ``mesh``: traced under ``jax.set_mesh``, inputs used where they are)."""

    def eval_step(state: TrainState, batch: PyTree) -> dict[str, jax.Array]:
        _, metrics = loss_fn(edl_state.model(state), batch)
        return dict(metrics)

    if not jit:
        return eval_step
    jitted = jax.jit(eval_step)
    if mesh is None:
        return jitted

    def on_mesh(state: TrainState, batch: PyTree) -> dict[str, jax.Array]:
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    return on_mesh
