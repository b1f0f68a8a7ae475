"""Train steps for preference data: ``make_dpo_step`` (any loss of
``edl.train.preference.PREFERENCE_LOSSES``: DPO / IPO / hinge against a reference, SimPO and
ORPO without one) and ``make_reward_step`` (a Bradley-Terry reward
model), both built on ``make_train_step`` and usable with ``edl.train.train``.

The batch (what the preference data pipeline yields): a dict of int32 ``(batch, seq)``
arrays ``chosen_input_ids``, ``chosen_labels``, ``chosen_attention_mask`` and the same three
``rejected_*`` (labels HF-aligned, i.e. unshifted, -100 on the prompt and padding; chosen and
rejected may have different ``seq``), plus, for ``reference="batch"``, float32 ``(batch,)``
``ref_chosen_logps`` / ``ref_rejected_logps``: the reference's summed completion log-probs
(TRL's precomputed columns; :func:`reference_logps` makes them). Chosen and rejected run
through one forward pass, concatenated along the batch (right-padded to a common length).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from edl import lora as edl_lora
from edl.generate.steps import CausalLM
from edl.models.heads import router_losses
from edl.nn.lora import LoraLinear
from edl.ops.moe import RouterStats
from edl.train.jitted import StepProgram
from edl.train.preference import (
    PREFERENCE_LOSSES,
    LossOptions,
    Pairs,
    PreferenceLoss,
    forward_logps,
    preference_loss,
)
from edl.train.step import make_train_step
from edl.tree import find

__all__ = [
    "REFERENCES",
    "add_router_losses",
    "make_dpo_step",
    "make_reward_step",
    "preference_logps",
    "reference_logps",
    "reference_model_for",
    "reward_loss",
    "with_router_losses",
]

REFERENCES = ("lora", "model", "batch")
PAIR_KEYS = tuple(
    f"{side}_{k}"
    for side in ("chosen", "rejected")
    for k in ("input_ids", "labels", "attention_mask")
)
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
Batch = Mapping[str, Array]
Step = Callable[[Any, Batch], tuple[Any, dict[str, Array]]]


def _check_batch(who: str, batch: Batch, keys: tuple[str, ...]) -> None:
    """Every key present, and each side's arrays of one ``(batch, seq)`` shape."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(
            f"{who}: the batch lacks {', '.join(missing)} (it has {', '.join(sorted(batch))})"
        )
    sizes = set()
    for side in ("chosen", "rejected"):
        shapes = {k: batch[k].shape for k in keys if k.startswith(side)}
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
            raise ValueError(
                f"{who}: the {side}_* arrays must share one (batch, seq), got {shapes}"
            )
        sizes.add(next(iter(shapes.values()))[0])
    for k in (k for k in REF_KEYS if k in keys):
        sizes.add(batch[k].shape[0] if batch[k].ndim == 1 else -1)
    if len(sizes) != 1:
        shapes = {k: batch[k].shape for k in keys}
        raise ValueError(f"{who}: chosen and rejected need the same batch size, got {shapes}")


def _concatenated(batch: Batch, names: tuple[str, ...], pads: tuple[int, ...]) -> list[Array]:
    """``chosen_<name>`` over ``rejected_<name>`` for each name, right-padded with ``pad`` to
    their common length: ``(2 * batch, seq)``."""
    seq = max(batch["chosen_" + names[0]].shape[1], batch["rejected_" + names[0]].shape[1])
    out = []
    for name, pad in zip(names, pads, strict=True):
        sides = [batch[f"{side}_{name}"] for side in ("chosen", "rejected")]
        widths = [((0, 0), (0, seq - x.shape[1])) for x in sides]
        out.append(
            jnp.concatenate(
                [jnp.pad(x, w, constant_values=pad) for x, w in zip(sides, widths, strict=True)]
            )
        )
    return out


def preference_logps(
    model: CausalLM, batch: Batch, *, chunk_size: int | None = None, sft_nll: bool = False
) -> dict[str, Float[Array, " ..."]]:
    """Chosen and rejected in one forward pass of a causal LM: float32 ``(batch,)``
    ``chosen_logps`` / ``rejected_logps`` (summed over counted completion tokens, as
    ``sequence_logps``) and ``chosen_lengths`` / ``rejected_lengths`` (those token counts).

    ``sft_nll``: also ``chosen_nll``, the chosen sequences' mean token NLL over every
    attended token, prompt included (TRL's ORPO SFT term), from the same pass: each position
    predicts its label where there is one, else the next input id. For a MoE model also the
    pass's scalar ``router_loss``, ``aux_loss`` and ``z_loss`` (:func:`with_router_losses`).
    """
    _check_batch("preference_logps", batch, PAIR_KEYS)
    ids, labels, mask = _concatenated(
        batch, ("input_ids", "labels", "attention_mask"), (0, -100, 0)
    )
    targets = jnp.where(labels != -100, labels, ids) if sft_nll else labels
    logps, counted, stats = forward_logps(
        model, ids, targets, attention_mask=mask, chunk_size=chunk_size
    )
    completion = counted & jnp.pad(labels[:, 1:] != -100, ((0, 0), (0, 1)))
    sums = jnp.sum(jnp.where(completion, logps, 0.0), axis=1)
    lengths = jnp.sum(completion.astype(jnp.int32), axis=1).astype(jnp.float32)
    n = batch["chosen_input_ids"].shape[0]
    out = {
        "chosen_logps": sums[:n],
        "rejected_logps": sums[n:],
        "chosen_lengths": lengths[:n],
        "rejected_lengths": lengths[n:],
    }
    if sft_nll:
        full = counted[:n]
        out["chosen_nll"] = -jnp.sum(logps[:n]) / jnp.maximum(
            jnp.sum(full.astype(jnp.int32)), 1
        ).astype(jnp.float32)
    return out | with_router_losses(model, stats)


def with_router_losses(model: CausalLM, stats: RouterStats | None) -> dict[str, Array]:
    """A MoE forward pass's ``router_loss`` (what ``edl.models.heads.router_losses`` adds to
    a loss) with ``aux_loss`` / ``z_loss`` (scalars); nothing for a dense model."""
    if stats is None:
        return {}
    added, metrics = router_losses(model.config, stats)
    return {"router_loss": added, **metrics}


def _pair_tokens(batch: Batch) -> Int[Array, ""]:
    """The tokens a preference step runs the model over: both sequences' real tokens (the
    ``tokens`` metric that tokens/s and MFU count; ``count`` is the pairs)."""
    return sum(
        jnp.sum(jnp.asarray(batch[f"{side}_attention_mask"], jnp.int32))
        for side in ("chosen", "rejected")
    )


def reference_logps(
    model: CausalLM, batch: Batch, *, chunk_size: int | None = None
) -> dict[str, Array]:
    """``batch`` with ``ref_chosen_logps`` / ``ref_rejected_logps`` ``(batch,)`` float32
    added: ``model``'s summed completion log-probs, for ``make_dpo_step(reference="batch")``
    (compute them once, e.g. ``jax.jit(reference_logps)`` over the data set)."""
    logps = preference_logps(model, batch, chunk_size=chunk_size)
    return {
        **batch,
        "ref_chosen_logps": logps["chosen_logps"],
        "ref_rejected_logps": logps["rejected_logps"],
    }


def _dpo_loss_fn(
    loss: PreferenceLoss, options: LossOptions, reference: str, chunk_size: int | None
) -> Callable[[Any, Batch, Any], tuple[Array, dict[str, Array]]]:
    """``loss_fn(model, batch, reference_model) -> (loss, metrics)`` (the reference model is
    used only for ``reference="model"``)."""
    who = f"make_dpo_step(loss_type={loss.name!r}, reference={reference!r})"
    keys = PAIR_KEYS + (REF_KEYS if loss.needs_reference and reference == "batch" else ())

    def loss_fn(
        model: CausalLM, batch: Batch, reference_model: CausalLM | None
    ) -> tuple[Array, dict[str, Array]]:
        _check_batch(who, batch, keys)
        policy = preference_logps(model, batch, chunk_size=chunk_size, sft_nll=loss.sft_nll)
        n = jnp.asarray(batch["chosen_input_ids"].shape[0], jnp.int32)  # weights micro-batches
        lengths = {k: policy[k] for k in ("chosen_lengths", "rejected_lengths")}
        # Per completion token (SimPO, ORPO): both sides by the policy's completion lengths.
        scale = lambda x, side: (
            x / jnp.maximum(policy[f"{side}_lengths"], 1.0) if loss.length_average else x
        )
        chosen = scale(policy["chosen_logps"], "chosen")
        rejected = scale(policy["rejected_logps"], "rejected")
        if not loss.needs_reference:
            pairs = Pairs(chosen, rejected, **lengths, chosen_nll=policy.get("chosen_nll"))
        else:
            ref = _reference(who, model, batch, reference_model, reference, chunk_size)
            pairs = Pairs(
                chosen - scale(ref["chosen_logps"], "chosen"),
                rejected - scale(ref["rejected_logps"], "rejected"),
                **lengths,
                chosen_nll=policy.get("chosen_nll"),
            )
        value, metrics = preference_loss(loss, pairs, options, chosen, rejected)
        value, metrics = add_router_losses(value, metrics, policy)
        return value, {**metrics, "count": n, "tokens": _pair_tokens(batch)}

    return loss_fn


def add_router_losses(
    loss: Float[Array, ""], metrics: dict[str, Array], policy: Mapping[str, Array]
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``loss`` plus the policy pass's ``router_loss`` (MoE models; TRL adds
    ``router_aux_loss_coef * aux_loss`` when ``output_router_logits`` is set), with
    ``aux_loss`` / ``z_loss`` among the metrics; unchanged for a dense model."""
    if "router_loss" not in policy:
        return loss, metrics
    loss = loss + policy["router_loss"].astype(loss.dtype)
    extra = {k: jax.lax.stop_gradient(policy[k]) for k in ("aux_loss", "z_loss")}
    return loss, {**metrics, "loss": loss, **extra}


def reference_model_for(
    who: str, model: CausalLM, reference: str, reference_model: CausalLM | None
) -> CausalLM | None:
    """The model a step's reference log-probs come from: ``model`` with its LoRA adapters
    switched off (``reference="lora"``; an error naming ``who`` when it has none), else
    ``reference_model``."""
    if reference != "lora":
        return reference_model
    if not find(model, lambda x: isinstance(x, LoraLinear)):
        raise ValueError(
            f"{who}: the model has no LoRA adapters to switch off for the "
            "reference; wrap it with edl.lora.apply_lora, or pass "
            "reference='model' with reference_model= (or reference='batch')"
        )
    return edl_lora.unwrap_lora(model)


def _reference(
    who: str,
    model: CausalLM,
    batch: Batch,
    reference_model: CausalLM | None,
    reference: str,
    chunk_size: int | None,
) -> dict[str, Array]:
    """The reference's summed completion log-probs ``chosen_logps`` / ``rejected_logps``,
    without gradient: from the batch, the LoRA-off ``model`` or ``reference_model``."""
    if reference == "batch":
        ref = {k: batch[f"ref_{k}"].astype(jnp.float32) for k in ("chosen_logps", "rejected_logps")}
    else:
        reference_model = reference_model_for(who, model, reference, reference_model)
        ref = preference_logps(reference_model, batch, chunk_size=chunk_size)
    return jax.lax.stop_gradient(ref)


def make_dpo_step(
    optimizer: optax.GradientTransformation,
    *,
    loss_type: str = "sigmoid",
    beta: float | None = None,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    reference: Literal["lora", "model", "batch"] = "lora",
    reference_model: CausalLM | None = None,
    chunk_size: int | None = None,
    **step_options: Any,
) -> Step:
    """A preference-optimisation ``step(state, batch) -> (state, metrics)`` for a causal LM
    state (``edl.create_state``), usable with ``edl.train.train``: ``make_train_step`` on the
    loss below, so ``step_options`` are its options (``grad_accum_steps``, ``clip_norm``,
    ``schedule``, ``skip_nonfinite``, ``compute_dtype``, ``donate``, ``jit``, ``mesh``,
    ``rules``).

    Args:
        loss_type: a name in ``PREFERENCE_LOSSES``: ``"sigmoid"`` (DPO), ``"ipo"``,
            ``"hinge"``: :func:`dpo_loss` against a reference; ``"simpo"``
            (:func:`simpo_loss`) and ``"orpo"`` (:func:`orpo_loss`, its SFT term the chosen
            sequences' token NLL): reference-free, on length-averaged log-probs; or a
            registered one.
        beta: the loss's β; None: its ``default_beta`` (0.1, or 2.0 for SimPO: TRL's / the
            paper's defaults).
        label_smoothing: ε of the conservative ``"sigmoid"`` loss and of SimPO.
        gamma: SimPO's target reward margin (TRL's ``simpo_gamma``).
        reference: where the DPO reference log-probs come from (unused by SimPO / ORPO):
            ``"lora"``: the trained model with its LoRA adapters switched off
            (``edl.lora.unwrap_lora`` inside the loss, no second copy of the weights);
            ``"model"``: ``reference_model``, a frozen model passed to the compiled step as an
            argument (never donated, never trained, not baked into the program);
            ``"batch"``: the batch's ``ref_chosen_logps`` / ``ref_rejected_logps``
            (:func:`reference_logps`). Reference log-probs carry no gradient.
        chunk_size: tokens per LM-head chunk (``edl.ops.losses.causal_lm_token_logps``; None:
            ``edl.ops.losses.default_chunk_size``).

    Metrics: the loss's (TRL's names: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; ORPO's
    ``log_odds_ratio``, ``log_odds_chosen``, ``nll_loss``), ``count`` (pairs) and the train
    step's; a MoE model's router losses are added as ``compute_loss`` adds them
    (:func:`add_router_losses`, TRL's ``aux_loss`` term). Batch errors (missing keys, shapes) and a
    ``reference="lora"`` model without adapters raise when the step is first traced.
    """
    loss_fn = _dpo_loss(
        "make_dpo_step",
        loss_type,
        (beta, label_smoothing, gamma),
        reference,
        reference_model,
        chunk_size,
    )
    if reference_model is None:
        return make_train_step(lambda m, b: loss_fn(m, b, None), optimizer, **step_options)
    return _with_reference(loss_fn, optimizer, reference_model, step_options)


def _dpo_loss(
    who: str,
    loss_type: str,
    hyper: tuple[float | None, float, float],
    reference: str,
    reference_model: CausalLM | None,
    chunk_size: int | None,
) -> Callable[[Any, Batch, Any], tuple[Array, dict[str, Array]]]:
    """The DPO-family ``loss_fn(model, batch, reference_model)``, the arguments checked
    (errors name ``who``); ``hyper``: ``(beta, label_smoothing, gamma)``, ``beta`` None
    the loss's default."""
    loss = PREFERENCE_LOSSES.lookup(loss_type, f"{who}: loss_type")
    if reference not in REFERENCES:
        raise ValueError(f"{who}: reference must be one of {REFERENCES}, got {reference!r}")
    uses_model = loss.needs_reference and reference == "model"
    if uses_model != (reference_model is not None):
        needing = [n for n, e in PREFERENCE_LOSSES.items() if e.needs_reference]
        raise ValueError(
            f"{who}: reference_model is needed exactly when loss_type is one of "
            f"{tuple(needing)} and reference='model'; got loss_type={loss_type!r}, "
            f"reference={reference!r}, reference_model "
            f"{'given' if reference_model is not None else 'None'}"
        )
    beta, label_smoothing, gamma = hyper
    if beta is None:
        beta = loss.default_beta
    if beta <= 0 or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"{who}: need beta > 0 and 0 <= label_smoothing < 0.5, got beta={beta}, "
            f"label_smoothing={label_smoothing}"
        )
    options = LossOptions(beta, label_smoothing, gamma)
    return _dpo_loss_fn(loss, options, reference, chunk_size)


def _with_reference(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    reference_model: CausalLM | None,
    step_options: dict[str, Any],
    who: str = "make_dpo_step",
) -> Step:
    """The train step with the reference model's arrays as a constant argument of the
    compiled program (a closure would bake them into it), placed on the step's mesh by its
    rules."""
    options = dict(step_options)
    jit, donate = options.pop("jit", True), options.pop("donate", True)
    mesh, rules = options.pop("mesh", None), options.pop("rules", None)
    make_train_step(lambda m, b: loss_fn(m, b, None), optimizer, jit=False, **options)  # checks
    arrays, static = eqx.partition(reference_model, eqx.is_array)

    def step(state: Any, batch: Batch, ref_arrays: Any) -> tuple[Any, dict]:
        ref = eqx.combine(ref_arrays, static)
        pure = make_train_step(lambda m, b: loss_fn(m, b, ref), optimizer, jit=False, **options)
        return pure(state, batch)

    if not jit:
        if mesh is not None:
            raise ValueError(f"{who}: mesh= needs jit=True")
        return lambda state, batch: step(state, batch, arrays)
    return StepProgram(step, mesh=mesh, rules=rules, donate=donate, constants=arrays)


def reward_loss(
    chosen_rewards: Float[Array, " batch"],
    rejected_rewards: Float[Array, " batch"],
    *,
    center_rewards_coefficient: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Bradley-Terry: ``-mean(log σ(r_chosen - r_rejected))``, plus (TRL's
    ``center_rewards_coefficient``) ``c * mean((r_chosen + r_rejected)²)``.

    Metrics: ``loss``, ``accuracy`` (how often the chosen reward is higher),
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (batch means).
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_rewards.ndim != 1:
        raise ValueError(
            f"reward_loss: rewards must be (batch,) of one size, got {chosen_rewards.shape} and "
            f"{rejected_rewards.shape}"
        )
    chosen, rejected = chosen_rewards.astype(jnp.float32), rejected_rewards.astype(jnp.float32)
    loss = -jnp.mean(jax.nn.log_sigmoid(chosen - rejected))
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * jnp.mean(jnp.square(chosen + rejected))
    chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    return loss, {
        "loss": loss,
        "accuracy": jnp.mean((chosen > rejected).astype(jnp.float32)),
        "rewards/chosen": jnp.mean(chosen),
        "rewards/rejected": jnp.mean(rejected),
        "rewards/margins": jnp.mean(chosen - rejected),
    }


def make_reward_step(
    optimizer: optax.GradientTransformation,
    *,
    center_rewards_coefficient: float | None = None,
    **step_options: Any,
) -> Step:
    """A reward-model ``step(state, batch) -> (state, metrics)`` (``make_train_step`` on
    :func:`reward_loss`; ``step_options`` are its options) for an ``edl.models``
    ``*ForSequenceClassification`` with ``num_labels=1``, scored at each row's last non-pad
    token. The batch needs ``chosen_input_ids``, ``chosen_attention_mask``,
    ``rejected_input_ids`` and ``rejected_attention_mask`` (labels are not read); chosen and
    rejected run in one forward pass. Metrics: :func:`reward_loss`'s and ``count`` (pairs).
    """
    return make_train_step(_reward_loss_fn(center_rewards_coefficient), optimizer, **step_options)


def _reward_loss_fn(
    center_rewards_coefficient: float | None,
) -> Callable[[Any, Batch], tuple[Array, dict[str, Array]]]:
    keys = (
        "chosen_input_ids",
        "chosen_attention_mask",
        "rejected_input_ids",
        "rejected_attention_mask",
    )

    def loss_fn(model: eqx.Module, batch: Batch) -> tuple[Array, dict[str, Array]]:
        num_labels = getattr(model.config, "num_labels", None)
        if not hasattr(model, "score") or num_labels != 1:
            raise ValueError(
                "make_reward_step: the model must be a sequence-classification model with "
                f"num_labels=1, got {type(model).__name__} with num_labels={num_labels}"
            )
        _check_batch("make_reward_step", batch, keys)
        pad = model.config.pad_token_id
        ids, mask = _concatenated(
            batch, ("input_ids", "attention_mask"), (0 if pad is None else pad, 0)
        )
        rewards = model(ids, attention_mask=mask).logits[:, 0]
        n = batch["chosen_input_ids"].shape[0]
        loss, metrics = reward_loss(
            rewards[:n], rewards[n:], center_rewards_coefficient=center_rewards_coefficient
        )
        count = jnp.asarray(n, jnp.int32)
        return loss, {**metrics, "count": count, "tokens": _pair_tokens(batch)}

    return loss_fn
