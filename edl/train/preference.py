"""Preference losses (DPO and its IPO / hinge variants, SimPO, ORPO) on per-sequence
log-probabilities, and those log-probabilities computed on the chunked LM-head path.
Each loss is an entry of ``PREFERENCE_LOSSES`` (a :class:`PreferenceLoss`): what
``make_dpo_step(loss_type=...)`` and ``edl train --loss-type`` accept, and where one more
loss is one more entry.

    import edl, optax
    from edl.train import make_dpo_step, train

    model = edl.lora.apply_lora(edl.from_pretrained("..."), rank=8, alpha=16, key=key)
    tx = optax.adamw(5e-6)
    state = edl.create_state(model, tx, trainable=edl.lora.lora_trainable)
    step = make_dpo_step(tx, beta=0.1, reference="lora")   # reference: the LoRA-off base
    state, summary = train(state, step, batches, RunConfig(steps=1000))
    # batches: dicts of chosen_/rejected_ input_ids, labels (-100 on prompt and padding,
    # unshifted) and attention_mask, int32 (batch, seq); see edl.train.preference_step.

The losses are pure functions of ``(batch,)`` log-probabilities, each returning
``(loss, metrics)`` with TRL's metric names as batch means (``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``) plus ``loss``. They follow TRL 1.16 (``trl/trainer/dpo_trainer.py``
``DPOTrainer._compute_loss``; ``trl/experimental/cpo/cpo_trainer.py`` ``CPOTrainer.cpo_loss``
for SimPO; ``trl/experimental/orpo/orpo_trainer.py`` ``ORPOTrainer.odds_ratio_loss``), and
the tests check them against those methods. They take float32 or float64 log-probs and
compute in the wider of their inputs' dtype and float32 (``edl.train.loss_inputs``), so a
float64 reference check runs in float64 throughout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from edl._registry import Registry
from edl.generate.steps import CausalLM
from edl.ops.checks import check_ids
from edl.ops.losses import causal_lm_token_logps, mask_without_context
from edl.ops.moe import RouterStats
from edl.train.loss_inputs import loss_dtype, widened

__all__ = [
    "PREFERENCE_LOSSES",
    "ForwardLogps",
    "LossOptions",
    "Pairs",
    "PreferenceLoss",
    "dpo_loss",
    "forward_logps",
    "orpo_loss",
    "sequence_logps",
    "simpo_loss",
]

Logps = Float[Array, " batch"]
Metrics = dict[str, Float[Array, ""]]


class ForwardLogps(NamedTuple):
    """One forward pass's per-token log-probs (:func:`token_logps`) and, for a MoE model,
    its routing statistics (``None`` for a dense one): what a post-training loss needs to
    add the router losses (``edl.models.heads.router_losses``) as ``compute_loss`` does."""

    logps: Float[Array, "batch seq"]
    counted: Bool[Array, "batch seq"]
    router_stats: RouterStats | None


def forward_logps(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    chunk_size: int | None = None,
) -> ForwardLogps:
    """:func:`token_logps` with the forward pass's MoE routing statistics."""
    c = model.config
    if c.run.check_inputs:
        labels = check_ids(labels, c.vocab_size, name="labels", ignore=-100)
    labels = mask_without_context(labels, attention_mask=attention_mask, segment_ids=segment_ids)
    out = model.model(input_ids, attention_mask=attention_mask, segment_ids=segment_ids)
    logps, counted = causal_lm_token_logps(
        out.last_hidden_state,
        model.head_weight,
        labels,
        attention_mask=attention_mask,
        chunk_size=chunk_size,
        softcap=c.final_softcap,
    )
    return ForwardLogps(logps, counted, out.router_stats)


def token_logps(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    chunk_size: int | None = None,
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """``(logps, counted)`` ``(batch, seq)``: ``logps[:, t] = log p(labels[:, t + 1] |
    prefix)`` in float32 (0.0 where not counted) and whether it is counted; see
    :func:`sequence_logps`, which sums these."""
    out = forward_logps(
        model,
        input_ids,
        labels,
        attention_mask=attention_mask,
        segment_ids=segment_ids,
        chunk_size=chunk_size,
    )
    return out.logps, out.counted


def sequence_logps(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    average: bool = False,
    chunk_size: int | None = None,
) -> Float[Array, " batch"]:
    """Per sequence, the sum (``average=True``: the mean over counted tokens, 0.0 when none)
    of ``log p(labels[:, t + 1] | input_ids[:, :t + 1])`` under a causal LM
    (``edl.models`` ``*ForCausalLM``), float32.

    ``labels`` are HF-aligned (unshifted: usually ``input_ids`` with -100 on the prompt and
    padding). Not counted: -100 labels, padded positions, a token whose context is padding,
    and (with ``segment_ids``) the first token of each packed segment, exactly as
    ``compute_loss`` counts them. Computed as ``compute_loss`` is, from the final hidden states
    by ``edl.ops.losses.causal_lm_token_logps`` in chunks of ``chunk_size`` tokens (never the full
    ``(batch, seq, vocab)`` logits), log-softmax in float32, Gemma 2's final soft-cap applied.
    """
    logps, counted = token_logps(
        model,
        input_ids,
        labels,
        attention_mask=attention_mask,
        segment_ids=segment_ids,
        chunk_size=chunk_size,
    )
    total = jnp.sum(logps, axis=1)
    if not average:
        return total
    return total / jnp.maximum(jnp.sum(counted.astype(jnp.int32), axis=1), 1).astype(jnp.float32)


def _reward_metrics(
    chosen_rewards: Logps, rejected_rewards: Logps, chosen_logps: Logps, rejected_logps: Logps
) -> Metrics:
    """TRL's logged metrics: batch means of the rewards, their margin, how often the chosen
    one wins, and the policy log-probs (all without gradient)."""
    sg = jax.lax.stop_gradient
    chosen_rewards, rejected_rewards = sg(chosen_rewards), sg(rejected_rewards)
    return {
        "rewards/chosen": jnp.mean(chosen_rewards),
        "rewards/rejected": jnp.mean(rejected_rewards),
        "rewards/accuracies": jnp.mean(
            (chosen_rewards > rejected_rewards).astype(chosen_rewards.dtype)
        ),
        "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
        "logps/chosen": jnp.mean(sg(chosen_logps)),
        "logps/rejected": jnp.mean(sg(rejected_logps)),
    }


def _check_shapes(name: str, **arrays: Array | None) -> None:
    shapes = {k: v.shape for k, v in arrays.items() if v is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 1 for s in shapes.values()):
        raise ValueError(f"{name}: log-probs must all be (batch,) of one size, got {shapes}")


def _check_logps(name: str, **logps: Array | None) -> np.dtype:
    """Checks ``(batch,)`` float log-probs of one size; returns the dtype the loss computes
    in (``edl.train.loss_inputs.loss_dtype``: float64 for float64 inputs, else float32)."""
    _check_shapes(name, **logps)
    return loss_dtype(name, **logps)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """What a preference loss reads, float32 ``(batch,)`` per pair.

    Attributes:
        chosen, rejected: the policy's log-ratios to the reference (``policy - reference``
            log-probs) for a loss that ``needs_reference``, else the policy's log-probs;
            summed over the completion, or length-averaged for a ``length_average`` loss.
        chosen_lengths, rejected_lengths: counted completion tokens, when known.
        chosen_nll: the chosen sequences' mean token NLL (ORPO's SFT term), for a loss
            with ``sft_nll``.
    """

    chosen: Logps
    rejected: Logps
    chosen_lengths: Logps | None = None
    rejected_lengths: Logps | None = None
    chosen_nll: Float[Array, ""] | None = None


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """A preference loss's hyperparameters: ``beta`` (β), ``label_smoothing`` (ε of the
    conservative sigmoid losses) and ``gamma`` (SimPO's target reward margin)."""

    beta: float
    label_smoothing: float = 0.0
    gamma: float = 0.5


LossFn = Callable[[Pairs, LossOptions], tuple[Float[Array, ""], Metrics]]


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """One preference loss: an entry of ``PREFERENCE_LOSSES``.

    Attributes:
        name: its ``loss_type`` (``make_dpo_step``, ``dpo_loss``, ``edl train --loss-type``).
        fn: ``fn(pairs, options) -> (loss, metrics)``: the batch's scalar loss and any
            metrics beyond TRL's reward metrics, which :func:`preference_loss` adds.
        needs_reference: the loss reads log-ratios to a reference model (DPO's family);
            else the policy's log-probs alone (SimPO, ORPO).
        length_average: the log-probs are averaged over each completion's tokens.
        sft_nll: the loss reads ``pairs.chosen_nll``.
        default_beta: β when none is given.
    """

    name: str
    fn: LossFn
    needs_reference: bool = True
    length_average: bool = False
    sft_nll: bool = False
    default_beta: float = 0.1


def _sigmoid_loss(logits: Logps, label_smoothing: float) -> Logps:
    """Conservative (label-smoothed) logistic loss: -(1-ε) log σ(x) - ε log σ(-x)."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(logits) - label_smoothing * (
        jax.nn.log_sigmoid(-logits)
    )


def _sigmoid(pairs: Pairs, o: LossOptions) -> tuple[Float[Array, ""], Metrics]:
    """DPO: ``-(1 - ε) log σ(β h) - ε log σ(-β h)``, ``h = chosen - rejected`` log-ratios."""
    return jnp.mean(_sigmoid_loss(o.beta * (pairs.chosen - pairs.rejected), o.label_smoothing)), {}


def _hinge(pairs: Pairs, o: LossOptions) -> tuple[Float[Array, ""], Metrics]:
    """SLiC: ``relu(1 - β h)``."""
    return jnp.mean(jax.nn.relu(1.0 - o.beta * (pairs.chosen - pairs.rejected))), {}


def _ipo(pairs: Pairs, o: LossOptions) -> tuple[Float[Array, ""], Metrics]:
    """IPO: ``(h' - 1 / (2 β))²``, each log-ratio of ``h`` divided by its length (when
    given: TRL's normalisation)."""
    delta = pairs.chosen - pairs.rejected  # no lengths: per-token log-probs given
    if pairs.chosen_lengths is not None and pairs.rejected_lengths is not None:
        per_token = lambda x, n: x / jnp.maximum(n.astype(x.dtype), 1.0)
        delta = per_token(pairs.chosen, pairs.chosen_lengths) - per_token(
            pairs.rejected, pairs.rejected_lengths
        )
    return jnp.mean(jnp.square(delta - 1.0 / (2.0 * o.beta))), {}


def _simpo(pairs: Pairs, o: LossOptions) -> tuple[Float[Array, ""], Metrics]:
    """SimPO: ``-(1 - ε) log σ(β h - γ) - ε log σ(-(β h - γ))`` on length-averaged
    log-probs (TRL's form: γ / β subtracted from ``h``)."""
    logits = pairs.chosen - pairs.rejected - o.gamma / o.beta
    return jnp.mean(_sigmoid_loss(o.beta * logits, o.label_smoothing)), {}


def _log1mexp(x: Float[Array, " batch"]) -> Float[Array, " batch"]:
    """log(1 - exp(x)) for x < 0, stable at both ends (Mächler's split at -log 2, as TRL's
    ``log1mexp``); each branch sees only its own inputs, so neither leaks NaN gradients."""
    near_zero = x > -0.6931471805599453
    return jnp.where(
        near_zero,
        jnp.log(-jnp.expm1(jnp.where(near_zero, x, -1.0))),
        jnp.log1p(-jnp.exp(jnp.where(near_zero, -1.0, x))),
    )


def _orpo(pairs: Pairs, o: LossOptions) -> tuple[Float[Array, ""], Metrics]:
    """ORPO: ``chosen_nll - β mean(log σ(log_odds))`` on length-averaged log-probs."""
    if pairs.chosen_nll is None:
        raise ValueError("orpo: the loss needs pairs.chosen_nll (the chosen sequences' NLL)")
    log_odds = (pairs.chosen - pairs.rejected) - (
        _log1mexp(pairs.chosen) - _log1mexp(pairs.rejected)
    )
    ratio = jax.nn.log_sigmoid(log_odds)
    chosen_nll = pairs.chosen_nll.astype(pairs.chosen.dtype)
    loss = chosen_nll - o.beta * jnp.mean(ratio)
    sg = jax.lax.stop_gradient
    return loss, {
        "log_odds_ratio": jnp.mean(sg(ratio)),
        "log_odds_chosen": jnp.mean(sg(log_odds)),
        "nll_loss": sg(chosen_nll),
    }


_SIMPO = PreferenceLoss(
    "simpo", _simpo, needs_reference=False, length_average=True, default_beta=2.0
)
_ORPO = PreferenceLoss("orpo", _orpo, needs_reference=False, length_average=True, sft_nll=True)
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry(
    "preference loss",
    [
        PreferenceLoss("sigmoid", _sigmoid),
        PreferenceLoss("ipo", _ipo),
        PreferenceLoss("hinge", _hinge),
        _SIMPO,
        _ORPO,
    ],
)
"""The preference losses by ``loss_type``: ``sigmoid`` (DPO), ``ipo``, ``hinge`` against a
reference; ``simpo``, ``orpo`` without one. ``PREFERENCE_LOSSES.register(PreferenceLoss(...))``
adds one (``make_dpo_step`` and ``edl train --loss-type`` then accept it)."""


def preference_loss(
    loss: PreferenceLoss,
    pairs: Pairs,
    options: LossOptions,
    policy_chosen_logps: Logps,
    policy_rejected_logps: Logps,
) -> tuple[Float[Array, ""], Metrics]:
    """``loss.fn(pairs, options)`` with TRL's metrics: ``loss``, rewards ``β * pairs.chosen`` /
    ``β * pairs.rejected`` (log-ratios, or log-probs for a reference-free loss), and the
    policy's log-probs as ``logps/chosen`` / ``logps/rejected``, then the loss's own."""
    value, extra = loss.fn(pairs, options)
    metrics = _reward_metrics(
        options.beta * pairs.chosen,
        options.beta * pairs.rejected,
        policy_chosen_logps,
        policy_rejected_logps,
    )
    return value, {"loss": value, **metrics, **extra}


def _reference_loss(who: str, loss_type: str) -> PreferenceLoss:
    """The registered loss ``loss_type`` that needs a reference, or a ``ValueError``."""
    entry = PREFERENCE_LOSSES.get(loss_type)
    if entry is None or not entry.needs_reference:
        names = [n for n, e in PREFERENCE_LOSSES.items() if e.needs_reference]
        raise ValueError(
            f"{who}: loss_type must be one of {', '.join(names)} (the losses "
            f"against a reference), got {loss_type!r}"
        )
    return entry


def dpo_loss(
    policy_chosen_logps: Logps,
    policy_rejected_logps: Logps,
    ref_chosen_logps: Logps,
    ref_rejected_logps: Logps,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Float[Array, " batch"] | Int[Array, " batch"] | None = None,
    rejected_lengths: Float[Array, " batch"] | Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, ""], Metrics]:
    """DPO on summed completion log-probs ``(batch,)`` of the policy and the reference
    (float32 or float64; computed in float64 when any is, else float32).

    ``loss_type``: a loss of ``PREFERENCE_LOSSES`` that needs a reference. With ``h =
    (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)``, built in:

    - ``"sigmoid"`` (DPO): ``-(1 - ε) log σ(β h) - ε log σ(-β h)`` with ``ε =
      label_smoothing`` (conservative DPO; TRL 1.16's DPO ``sigmoid`` is ``ε = 0``, its CPO
      ``sigmoid`` has this form).
    - ``"ipo"``: ``(h' - 1 / (2 β))²`` where ``h'`` divides each log-ratio by its completion
      length, as TRL does: pass the summed log-probs as for the others plus
      ``chosen_lengths`` / ``rejected_lengths`` ``(batch,)`` (counted completion tokens;
      lengths below 1 count as 1). Without lengths the log-probs are taken as given, i.e.
      pass length-averaged ones (the reward metrics are then per token).
    - ``"hinge"`` (SLiC): ``relu(1 - β h)``.

    Lengths come both or neither. Returns ``(loss, metrics)``: the batch mean, and TRL's
    metrics with rewards ``β (policy - reference)`` per sequence (summed log-ratios, also for
    IPO).
    """
    name = "dpo_loss"
    dtype = _check_logps(
        name,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps = widened(
        dtype, policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    entry = _reference_loss(name, loss_type)
    if beta <= 0:
        raise ValueError(f"{name}: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{name}: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError(
            f"{name}: loss_type={loss_type!r} takes both chosen_lengths and "
            "rejected_lengths, or neither"
        )
    lengths = {}
    if chosen_lengths is not None and rejected_lengths is not None:
        chosen_lengths, rejected_lengths = widened(dtype, chosen_lengths, rejected_lengths)
        lengths = {"chosen_lengths": chosen_lengths, "rejected_lengths": rejected_lengths}
        _check_shapes(name, policy_chosen_logps=policy_chosen_logps, **lengths)
    pairs = Pairs(
        policy_chosen_logps - ref_chosen_logps,
        policy_rejected_logps - ref_rejected_logps,
        **lengths,
    )
    return preference_loss(
        entry, pairs, LossOptions(beta, label_smoothing), policy_chosen_logps, policy_rejected_logps
    )


def simpo_loss(
    policy_chosen_logps: Logps,
    policy_rejected_logps: Logps,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[Float[Array, ""], Metrics]:
    """SimPO (reference-free) on length-averaged log-probs ``(batch,)`` float32 / float64
    (``sequence_logps(..., average=True)``).

    ``loss = -(1 - ε) log σ(β h - γ) - ε log σ(-(β h - γ))`` with ``h = chosen - rejected``:
    TRL's ``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``. ``gamma`` is TRL's
    ``simpo_gamma`` (the target reward margin); TRL subtracts ``gamma / beta`` from ``h``
    (the SimPO repository's ``gamma_beta_ratio``), the same thing. Rewards are
    ``β * logps``.
    """
    name = "simpo_loss"
    dtype = _check_logps(
        name, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps
    )
    policy_chosen_logps, policy_rejected_logps = widened(
        dtype, policy_chosen_logps, policy_rejected_logps
    )
    if beta <= 0:
        raise ValueError(f"{name}: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{name}: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    return preference_loss(
        _SIMPO,
        Pairs(policy_chosen_logps, policy_rejected_logps),
        LossOptions(beta, label_smoothing, gamma),
        policy_chosen_logps,
        policy_rejected_logps,
    )


def orpo_loss(
    policy_chosen_logps: Logps,
    policy_rejected_logps: Logps,
    chosen_nll: Float[Array, ""],
    *,
    beta: float = 0.1,
) -> tuple[Float[Array, ""], Metrics]:
    """ORPO (reference-free): ``chosen_nll - β mean(log σ(log_odds))`` with
    ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))`` on length-averaged log-probs
    ``c``, ``r`` ``(batch,)`` float32 / float64 (``sequence_logps(..., average=True)``, all
    < 0).

    ``chosen_nll``: the SFT term, the chosen sequences' mean token NLL (TRL's ORPO takes it
    over the whole chosen sequence, prompt included; ``make_dpo_step`` does the same).
    Metrics as TRL's ``ORPOTrainer``: rewards ``β * logps``, plus ``log_odds_ratio`` (the mean
    of ``log σ(log_odds)``), ``log_odds_chosen`` (the mean log odds) and ``nll_loss``.
    """
    name = "orpo_loss"
    dtype = _check_logps(
        name, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps
    )
    policy_chosen_logps, policy_rejected_logps, chosen_nll = widened(
        dtype, policy_chosen_logps, policy_rejected_logps, chosen_nll
    )
    if beta <= 0:
        raise ValueError(f"{name}: beta must be > 0, got {beta}")
    pairs = Pairs(policy_chosen_logps, policy_rejected_logps, chosen_nll=chosen_nll)
    return preference_loss(
        _ORPO,
        pairs,
        LossOptions(beta),
        policy_chosen_logps,
        policy_rejected_logps,
    )
