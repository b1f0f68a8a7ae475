"""KTO (Kahneman-Tversky Optimisation, https://huggingface.co/papers/2402.01306) on
unpaired preferences: each example is one completion labelled desirable or not.

``kto_loss`` is TRL 1.16's ``KTOTrainer._compute_loss`` with ``loss_type="kto"``
(``trl/trainer/kto_trainer.py``), checked against it in the tests::

    kl      = max(0, mean(policy_KL_logps - ref_KL_logps))        (no gradient)
    h       = policy_logps - ref_logps                             (summed over the completion)
    loss_i  = desirable_weight   * (1 - σ(β (h_i - kl)))          for desirable examples
              undesirable_weight * (1 - σ(β (kl - h_i)))          for undesirable ones
    loss    = mean_i loss_i

The KL term is TRL's estimate of KL(policy || reference) from *mismatched* pairs: example
``i``'s prompt with example ``i - 1``'s completion (cyclically within the batch, as TRL's
``KL_completion_ids``), scored by both models; it is a batch-level baseline, so it carries
no gradient and is clamped at 0.

The batch of ``make_kto_step`` (what ``edl.train.kto_data.KTOBatches`` yields): int32
``(batch, seq)`` ``input_ids`` / ``labels`` / ``attention_mask`` (labels unshifted, -100 off
the completion) and the same three ``kl_*`` for the mismatched pairs, ``label`` bool
``(batch,)`` (desirable), and for ``reference="batch"`` float ``(batch,)`` ``ref_logps`` /
``ref_kl_logps`` (:func:`kto_reference_logps`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from edl.generate.steps import CausalLM
from edl.ops.moe import RouterStats
from edl.train.loss_inputs import loss_dtype, widened
from edl.train.preference import forward_logps
from edl.train.preference_step import (
    REFERENCES,
    _with_reference,
    add_router_losses,
    reference_model_for,
    with_router_losses,
)
from edl.train.step import make_train_step

__all__ = [
    "KTO_KEYS",
    "kl_estimate",
    "kto_logps",
    "kto_loss",
    "kto_reference_logps",
    "make_kto_step",
]

KTO_KEYS = (
    "input_ids",
    "labels",
    "attention_mask",
    "kl_input_ids",
    "kl_labels",
    "kl_attention_mask",
    "label",
)
REF_KEYS = ("ref_logps", "ref_kl_logps")
Batch = Mapping[str, Array]


def kl_estimate(
    policy_kl_logps: Float[Array, " batch"], ref_kl_logps: Float[Array, " batch"]
) -> Float[Array, ""]:
    """TRL's KL estimate before its clamp: ``mean(policy_KL_logps - ref_KL_logps)`` over the
    mismatched pairs (``kto_loss`` detaches it and clamps it at 0)."""
    dtype = loss_dtype("kl_estimate", policy_kl_logps=policy_kl_logps, ref_kl_logps=ref_kl_logps)
    policy_kl_logps, ref_kl_logps = widened(dtype, policy_kl_logps, ref_kl_logps)
    return jnp.mean(policy_kl_logps - ref_kl_logps)


def kto_loss(
    policy_logps: Float[Array, " batch"],
    ref_logps: Float[Array, " batch"],
    desirable: Bool[Array, " batch"],
    kl: Float[Array, ""],
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """KTO's loss (module docstring) on summed completion log-probs ``(batch,)`` of the
    policy and the reference, float32 or float64 (computed in the wider, at least float32).

    ``kl``: the KL estimate (:func:`kl_estimate`); its gradient is stopped and it is clamped
    at 0 here, as TRL does. Returns ``(loss, metrics)``: the mean over examples of the
    weighted per-example losses, and TRL's metrics: ``kl`` (clamped), ``rewards/chosen`` /
    ``rewards/rejected`` (``β h`` averaged over the desirable / undesirable examples),
    ``logps/chosen`` / ``logps/rejected`` (the policy's), ``rewards/margins`` (their
    difference); a side with no example reports 0 (TRL logs nothing for it), margins 0
    unless both sides have one.
    """
    who = "kto_loss"
    shapes = {"policy_logps": policy_logps.shape, "ref_logps": ref_logps.shape}
    shapes["desirable"] = desirable.shape
    if len(set(shapes.values())) != 1 or len(policy_logps.shape) != 1 or jnp.ndim(kl) != 0:
        raise ValueError(
            f"{who}: need (batch,) log-probs and labels of one size and a scalar kl, got "
            f"{shapes} and kl {jnp.shape(kl)}"
        )
    if beta <= 0 or desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"{who}: need beta > 0 and weights >= 0, got beta={beta}, desirable_weight="
            f"{desirable_weight}, undesirable_weight={undesirable_weight}"
        )
    dtype = loss_dtype(who, policy_logps=policy_logps, ref_logps=ref_logps, kl=kl)
    policy_logps, ref_logps, kl = widened(dtype, policy_logps, ref_logps, kl)
    kl = jnp.maximum(jax.lax.stop_gradient(kl), 0.0)
    logratios = policy_logps - ref_logps
    chosen = desirable_weight * (1.0 - jax.nn.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (kl - logratios)))
    loss = jnp.mean(jnp.where(desirable, chosen, rejected))
    return loss, {"loss": loss, "kl": kl, **_kto_metrics(beta * logratios, policy_logps, desirable)}


def _kto_metrics(
    rewards: Float[Array, " batch"], logps: Float[Array, " batch"], desirable: Bool[Array, " batch"]
) -> dict[str, Float[Array, ""]]:
    """TRL's per-side means (sums over the side's examples / their number), no gradient."""
    rewards, logps = jax.lax.stop_gradient(rewards), jax.lax.stop_gradient(logps)
    n_chosen = jnp.sum(desirable.astype(rewards.dtype))
    n_rejected = desirable.shape[0] - n_chosen
    side_mean = lambda x, on, n: jnp.sum(jnp.where(on, x, 0.0)) / jnp.maximum(n, 1.0)
    out = {
        "rewards/chosen": side_mean(rewards, desirable, n_chosen),
        "rewards/rejected": side_mean(rewards, ~desirable, n_rejected),
        "logps/chosen": side_mean(logps, desirable, n_chosen),
        "logps/rejected": side_mean(logps, ~desirable, n_rejected),
    }
    both = (n_chosen > 0) & (n_rejected > 0)
    out["rewards/margins"] = jnp.where(both, out["rewards/chosen"] - out["rewards/rejected"], 0.0)
    return out


def _check_batch(who: str, batch: Batch, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(
            f"{who}: the batch lacks {', '.join(missing)} (it has {', '.join(sorted(batch))})"
        )
    for prefix in ("", "kl_"):
        shapes = {k: batch[prefix + k].shape for k in ("input_ids", "labels", "attention_mask")}
        if len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 2:
            raise ValueError(
                f"{who}: the {prefix}* arrays must share one (batch, seq), got {shapes}"
            )
    rows = {k: batch[k].shape[0] for k in keys}
    if len(set(rows.values())) != 1 or batch["label"].ndim != 1:
        raise ValueError(f"{who}: every array needs the same batch size, got {rows}")


def _completion_sums(
    model: CausalLM,
    ids: Int[Array, "rows seq"],
    labels: Int[Array, "rows seq"],
    mask: Int[Array, "rows seq"],
    chunk_size: int | None,
) -> tuple[Float[Array, " rows"], RouterStats | None]:
    """Summed completion log-probs per row (as ``preference_logps``) and the pass's MoE
    routing statistics."""
    logps, counted, stats = forward_logps(
        model, ids, labels, attention_mask=mask, chunk_size=chunk_size
    )
    completion = counted & jnp.pad(labels[:, 1:] != -100, ((0, 0), (0, 1)))
    return jnp.sum(jnp.where(completion, logps, 0.0), axis=1), stats


def kto_logps(
    model: CausalLM, batch: Batch, *, chunk_size: int | None = None
) -> dict[str, Float[Array, " batch"]]:
    """``logps`` (the examples' summed completion log-probs) and ``kl_logps`` (the
    mismatched pairs', without gradient), both ``(batch,)`` float32, from one forward pass
    over the two sets of rows (right-padded to a common length). For a MoE model also that
    pass's ``router_loss`` / ``aux_loss`` / ``z_loss``: its routing statistics cover the
    mismatched rows too (TRL's aux loss is the examples' pass alone)."""
    _check_batch("kto_logps", batch, KTO_KEYS)
    seq = max(batch["input_ids"].shape[1], batch["kl_input_ids"].shape[1])
    parts = []
    for name, pad in (("input_ids", 0), ("labels", -100), ("attention_mask", 0)):
        rows = [batch[name], batch["kl_" + name]]
        rows = [jnp.pad(x, ((0, 0), (0, seq - x.shape[1])), constant_values=pad) for x in rows]
        parts.append(jnp.concatenate(rows))
    sums, stats = _completion_sums(model, *parts, chunk_size)
    n = batch["input_ids"].shape[0]
    out = {"logps": sums[:n], "kl_logps": jax.lax.stop_gradient(sums[n:])}
    return out | with_router_losses(model, stats)


def kto_reference_logps(
    model: CausalLM, batch: Batch, *, chunk_size: int | None = None
) -> dict[str, Array]:
    """``batch`` with ``ref_logps`` / ``ref_kl_logps`` added (``model``'s), for
    ``make_kto_step(reference="batch")``: TRL's precomputed reference columns."""
    logps = kto_logps(model, batch, chunk_size=chunk_size)
    return {**batch, "ref_logps": logps["logps"], "ref_kl_logps": logps["kl_logps"]}


def _kto_loss_fn(
    beta: float, weights: tuple[float, float], reference: str, chunk_size: int | None
) -> Callable[[Any, Batch, Any], tuple[Array, dict[str, Array]]]:
    who = f"make_kto_step(reference={reference!r})"
    keys = KTO_KEYS + (REF_KEYS if reference == "batch" else ())

    def loss_fn(model: CausalLM, batch: Batch, reference_model: CausalLM | None):
        _check_batch(who, batch, keys)
        policy = kto_logps(model, batch, chunk_size=chunk_size)
        if reference == "batch":
            ref = {"logps": batch["ref_logps"], "kl_logps": batch["ref_kl_logps"]}
        else:
            reference_model = reference_model_for(who, model, reference, reference_model)
            ref = kto_logps(reference_model, batch, chunk_size=chunk_size)
        ref = jax.lax.stop_gradient(ref)
        kl = kl_estimate(policy["kl_logps"], ref["kl_logps"])
        loss, metrics = kto_loss(
            policy["logps"],
            ref["logps"],
            batch["label"].astype(bool),
            kl,
            beta=beta,
            desirable_weight=weights[0],
            undesirable_weight=weights[1],
        )
        loss, metrics = add_router_losses(loss, metrics, policy)
        n = jnp.asarray(batch["input_ids"].shape[0], jnp.int32)  # weights micro-batches
        tokens = jnp.sum(jnp.asarray(batch["attention_mask"], jnp.int32)) + jnp.sum(
            jnp.asarray(batch["kl_attention_mask"], jnp.int32)
        )
        return loss, {**metrics, "count": n, "tokens": tokens}

    return loss_fn


def make_kto_step(
    optimizer: optax.GradientTransformation,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    reference: Literal["lora", "model", "batch"] = "lora",
    reference_model: CausalLM | None = None,
    chunk_size: int | None = None,
    **step_options: Any,
) -> Callable[[Any, Batch], tuple[Any, dict[str, Array]]]:
    """A KTO ``step(state, batch) -> (state, metrics)`` (the batch: module docstring),
    usable with ``edl.train.train``: ``make_train_step`` on :func:`kto_loss`, so
    ``step_options`` are its options (``grad_accum_steps``, ``clip_norm``, ``schedule``,
    ``skip_nonfinite``, ``compute_dtype``, ``donate``, ``jit``, ``mesh``, ``rules``).

    ``beta``, ``desirable_weight``, ``undesirable_weight``: TRL's ``KTOConfig`` defaults.
    ``reference`` as ``make_dpo_step``'s: the LoRA-off model (``"lora"``), a frozen
    ``reference_model`` passed to the compiled step as an argument (``"model"``), or the
    batch's ``ref_logps`` / ``ref_kl_logps`` (``"batch"``). With gradient accumulation the
    KL estimate is each micro-batch's (TRL's is each device batch's). Metrics:
    :func:`kto_loss`'s, ``count`` (examples), ``tokens`` and the train step's.
    """
    loss_fn = _kto_loss(
        "make_kto_step",
        (beta, desirable_weight, undesirable_weight),
        reference,
        reference_model,
        chunk_size,
    )
    if reference != "model":
        return make_train_step(lambda m, b: loss_fn(m, b, None), optimizer, **step_options)
    return _with_reference(loss_fn, optimizer, reference_model, step_options, "make_kto_step")


def _kto_loss(
    who: str,
    hyper: tuple[float, float, float],
    reference: str,
    reference_model: CausalLM | None,
    chunk_size: int | None,
) -> Callable[[Any, Batch, Any], tuple[Array, dict[str, Array]]]:
    """KTO's ``loss_fn(model, batch, reference_model)``, the arguments checked (errors name
    ``who``); ``hyper``: ``(beta, desirable_weight, undesirable_weight)``."""
    beta, desirable_weight, undesirable_weight = hyper
    if reference not in REFERENCES:
        raise ValueError(f"{who}: reference must be one of {REFERENCES}, got {reference!r}")
    if (reference == "model") != (reference_model is not None):
        raise ValueError(
            f"{who}: reference_model is needed exactly when reference='model'; got "
            f"reference={reference!r}, reference_model "
            f"{'given' if reference_model is not None else 'None'}"
        )
    if beta <= 0 or desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"{who}: need beta > 0 and weights >= 0, got beta={beta}, desirable_weight="
            f"{desirable_weight}, undesirable_weight={undesirable_weight}"
        )
    return _kto_loss_fn(beta, (desirable_weight, undesirable_weight), reference, chunk_size)
