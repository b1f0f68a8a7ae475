"""Held-out evaluation for the post-training methods: ``eval_step(state, batch) ->
metrics`` of DPO (and its loss family), KTO and reward-model training, for
``edl.train.train``'s ``eval_step`` / ``eval_data`` and ``edl train --method dpo|kto|reward
--eval-data``.

Each evaluates the same loss and metrics as the method's train step (same arguments, same
checks), without a gradient; ``edl.train.train`` reports them as ``eval_*``, the batches'
means weighted by their ``count`` (pairs or examples). A reference model is an argument of
the compiled program, as in the train steps::

    eval_step = make_dpo_eval_step(beta=0.1, reference="lora")
    state, summary = train(state, step, batches, run, eval_step=eval_step, eval_data=held_out)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
from jaxtyping import Array

from edl import state as edl_state
from edl.generate.steps import CausalLM
from edl.train.kto import _kto_loss
from edl.train.preference_step import _dpo_loss, _reward_loss_fn

__all__ = ["loss_eval_step", "make_dpo_eval_step", "make_kto_eval_step", "make_reward_eval_step"]

Batch = Mapping[str, Array]
EvalStep = Callable[[Any, Batch], dict[str, Array]]
PostLoss = Callable[[Any, Batch, Any], tuple[Array, dict[str, Array]]]


def loss_eval_step(loss_fn: PostLoss, reference_model: CausalLM | None) -> EvalStep:
    """A compiled ``eval_step(state, batch) -> metrics`` of a post-training
    ``loss_fn(model, batch, reference_model)``; the reference model's arrays are an argument
    of the program (a closure would bake them into it as constants)."""
    arrays, static = eqx.partition(reference_model, eqx.is_array)

    @jax.jit
    def run(state: Any, batch: Batch, ref_arrays: Any) -> dict[str, Array]:
        ref = None if reference_model is None else eqx.combine(ref_arrays, static)
        _, metrics = loss_fn(edl_state.model(state), batch, ref)
        return dict(metrics)

    return lambda state, batch: run(state, batch, arrays)


def make_dpo_eval_step(
    *,
    loss_type: str = "sigmoid",
    beta: float | None = None,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    reference: Literal["lora", "model", "batch"] = "lora",
    reference_model: CausalLM | None = None,
    chunk_size: int | None = None,
) -> EvalStep:
    """``edl.train.make_dpo_step``'s loss and metrics (same arguments, the optimizer and
    step options aside) on held-out preference pairs."""
    loss_fn = _dpo_loss(
        "make_dpo_eval_step",
        loss_type,
        (beta, label_smoothing, gamma),
        reference,
        reference_model,
        chunk_size,
    )
    return loss_eval_step(loss_fn, reference_model)


def make_kto_eval_step(
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    reference: Literal["lora", "model", "batch"] = "lora",
    reference_model: CausalLM | None = None,
    chunk_size: int | None = None,
) -> EvalStep:
    """``edl.train.kto.make_kto_step``'s loss and metrics (same arguments, the optimizer and
    step options aside) on held-out unpaired examples (with their mismatched KL rows)."""
    loss_fn = _kto_loss(
        "make_kto_eval_step",
        (beta, desirable_weight, undesirable_weight),
        reference,
        reference_model,
        chunk_size,
    )
    return loss_eval_step(loss_fn, reference_model)


def make_reward_eval_step(*, center_rewards_coefficient: float | None = None) -> EvalStep:
    """``edl.train.make_reward_step``'s loss and metrics on held-out pairs (``accuracy``:
    how often the chosen completion scores higher)."""
    loss_fn = _reward_loss_fn(center_rewards_coefficient)
    return loss_eval_step(lambda model, batch, _: loss_fn(model, batch), None)
