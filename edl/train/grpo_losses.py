"""GRPO's loss family as pure functions: the per-token policy objectives (clipped ratio,
CISPO, SAPO, VESPO), token- or sequence-level importance ratios (GSPO), the reductions
(``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo``, ``vespo``), the
high-entropy token mask and the k3 KL term.

Formulas follow TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss``
(``get_high_entropy_mask``, ``get_gamma_weights``; no vLLM importance correction, no
off-policy mask, no entropy bonus, ``use_bias_correction_kl=False``). Each ``loss_type`` is
one :class:`GRPOLoss` in :data:`GRPO_LOSSES`: its per-token objective, its reduction and how
its micro-batches combine under gradient accumulation (TRL's divisions by
``current_gradient_accumulation_steps`` or by the generation batch's token count).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from edl._registry import Registry
from edl.train.loss_inputs import loss_dtype, widened

__all__ = [
    "ACCUMULATE",
    "GRPO_LOSSES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "GRPOLoss",
    "PolicyTerms",
    "grpo_loss",
    "high_entropy_mask",
    "kl_k3",
    "token_entropy",
]

PerToken = Float[Array, "rows new"]
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ACCUMULATE = ("rows", "tokens")
VESPO_OPTIONS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


@dataclasses.dataclass(frozen=True)
class PolicyTerms:
    """What a per-token objective reads.

    Attributes:
        logps: ``(rows, new)`` the policy's log-probs (differentiated).
        log_ratio: ``(rows, new)`` ``logps - old_logps`` per token.
        ratio: ``(rows, new)`` (token level) or ``(rows, 1)`` (sequence level) importance
            weight ``exp(log_weight)``, TRL's ``coef_1``.
        advantages: ``(rows, 1)``.
        mask: ``(rows, new)`` 1.0 on counted tokens.
        options: the loss's scalars: ``epsilon_low``, ``epsilon_high``, ``delta``,
            ``sapo_temperature_pos`` / ``_neg``, ``vespo_k_pos`` / ``vespo_lambda_pos`` /
            ``vespo_k_neg`` / ``vespo_lambda_neg``.
    """

    logps: PerToken
    log_ratio: PerToken
    ratio: Float[Array, "rows _"]
    advantages: Float[Array, "rows 1"]
    mask: PerToken
    options: Mapping[str, float | None]


Objective = Callable[[PolicyTerms], tuple[Float[Array, "rows _"], Float[Array, "rows _"] | None]]
"""``objective(terms) -> (per_token_loss, clipped)``: the policy loss per token (or per row,
``(rows, 1)``, at sequence level) and the boolean-as-float "clipped" indicator its
``clip_ratio`` metric averages (None: the loss has none)."""


def _clipped(t: PolicyTerms) -> tuple[Array, Array]:
    """PPO's two-sided clip: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; with
    ``delta`` (INTELLECT-2) the unclipped ratio is capped at ``delta`` too."""
    low, high, delta = t.options["epsilon_low"], t.options["epsilon_high"], t.options["delta"]
    coef_2 = jnp.clip(t.ratio, 1.0 - low, 1.0 + high)
    coef_1 = t.ratio if delta is None else jnp.minimum(t.ratio, delta)
    per_token = -jnp.minimum(coef_1 * t.advantages, coef_2 * t.advantages)
    # The region clip ratio reads the capped ratio, as TRL's metric does.
    region = ((coef_1 < 1.0 - low) & (t.advantages < 0)) | (
        (coef_1 > 1.0 + high) & (t.advantages > 0)
    )
    return per_token, region.astype(per_token.dtype)


def _cispo(t: PolicyTerms) -> tuple[Array, Array]:
    """MiniMax-M1: ``-sg(min(r, eps_high)) A logp`` (the ratio clipped, not the update)."""
    high = t.options["epsilon_high"]
    clamped = jax.lax.stop_gradient(jnp.minimum(t.ratio, high))
    clipped = (t.ratio > high) & (t.advantages > 0)
    return -clamped * t.advantages * t.logps, clipped.astype(t.logps.dtype)


def _sapo(t: PolicyTerms) -> tuple[Array, None]:
    """SAPO's soft gate: ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau`` by the sign of A."""
    tau = jnp.where(
        t.advantages > 0, t.options["sapo_temperature_pos"], t.options["sapo_temperature_neg"]
    ).astype(t.ratio.dtype)
    return -(jax.nn.sigmoid(tau * (t.ratio - 1.0)) * 4.0 / tau) * t.advantages, None


def _vespo(t: PolicyTerms) -> tuple[Array, None]:
    """VESPO: ``-sg(phi(w)) A logp``, ``phi(w) = exp(lam + k log w - lam w)`` of the
    sequence ratio ``w = exp(sum of the masked, clamped token log-ratios)``; ``k`` / ``lam``
    by the sign of A (TRL ``get_gamma_weights``, no vLLM correction)."""
    o, lower = t.options, math.log(1e-8)
    seq = jnp.sum(jnp.clip(t.log_ratio, -20.0, 20.0) * t.mask, axis=-1, keepdims=True)
    log_w = jnp.clip(seq, lower, 20.0)
    nonneg = t.advantages >= 0
    k = jnp.where(nonneg, o["vespo_k_pos"], o["vespo_k_neg"]).astype(log_w.dtype)
    lam = jnp.maximum(jnp.where(nonneg, o["vespo_lambda_pos"], o["vespo_lambda_neg"]), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jax.lax.stop_gradient(jnp.where(jnp.isfinite(phi), phi, 0.0))
    return -phi * t.advantages * t.logps, None


Reduce = Callable[[PerToken, PerToken, int | None], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """One ``GRPOConfig.loss_type``: an entry of ``GRPO_LOSSES``.

    Attributes:
        name: the ``loss_type``.
        reduce: ``reduce(per_token, mask, max_new_tokens) -> loss``: the per-token losses
            ``(rows, new)`` (policy term plus KL) and the completion mask (1.0 on counted
            tokens) to the scalar loss; ``max_new_tokens`` is the completion budget
            (``None`` when the caller gave none).
        objective: the per-token policy loss (:data:`Objective`; default: the clipped ratio).
        accumulate: how micro-batch losses combine under gradient accumulation: ``"rows"``
            (each micro-batch weighs the same: TRL divides these by the accumulation steps)
            or ``"tokens"`` (weighted by completion tokens: TRL divides the token sum by the
            whole generation batch's token count, ``num_items_in_batch``).
    """

    name: str
    reduce: Reduce
    objective: Objective = _clipped
    accumulate: Literal["rows", "tokens"] = "rows"


def _grpo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """Each completion's masked mean, averaged over completions."""
    rows = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.mean(rows)


def _bnpo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """The masked mean over every token of the (micro-)batch."""
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _dr_grpo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """The masked sum over ``rows * max_new_tokens`` (Dr. GRPO: no length bias)."""
    if max_new_tokens is None:
        raise ValueError("grpo_loss: loss_type 'dr_grpo' needs max_new_tokens")
    return jnp.sum(per_token * mask) / (per_token.shape[0] * max_new_tokens)


def _luspo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """Each completion's masked sum, averaged over completions (LUSPO: the sequence loss
    scaled by its length)."""
    return jnp.mean(jnp.sum(per_token * mask, axis=1))


GRPO_LOSSES: Registry[GRPOLoss] = Registry(
    "GRPO loss",
    [
        GRPOLoss("grpo", _grpo),
        GRPOLoss("bnpo", _bnpo),
        GRPOLoss("dr_grpo", _dr_grpo),
        # dapo / cispo / vespo: the token sum over the generation batch's token count; per
        # micro-batch the token mean, weighted by its tokens (the same quotient).
        GRPOLoss("dapo", _bnpo, accumulate="tokens"),
        GRPOLoss("cispo", _bnpo, _cispo, accumulate="tokens"),
        GRPOLoss("sapo", _grpo, _sapo),
        GRPOLoss("luspo", _luspo),
        GRPOLoss("vespo", _bnpo, _vespo, accumulate="tokens"),
    ],
)
"""GRPO's losses by ``loss_type`` (TRL 1.16's); ``GRPO_LOSSES.register(GRPOLoss(...))``
adds one."""


def kl_k3(
    logps: Float[Array, "*shape"], ref_logps: Float[Array, "*shape"]
) -> Float[Array, "*shape"]:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token:
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased under samples from pi)."""
    delta = ref_logps - logps
    return jnp.exp(delta) - delta - 1.0


def token_entropy(logits: Float[Array, "*rows vocab"]) -> Float[Array, "*rows"]:
    """Shannon entropy (nats) of ``softmax(logits)`` along the last axis, in float32 or
    wider (TRL ``entropy_from_logits``)."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def high_entropy_mask(
    entropies: PerToken, mask: PerToken, top_quantile: float
) -> Float[Array, "rows new"]:
    """1.0 on counted tokens whose entropy is at least the ``1 - top_quantile`` quantile
    (linear interpolation, ``torch.quantile``'s) of the counted tokens' entropies; all 0
    when no token counts (TRL ``get_high_entropy_mask``)."""
    counted = mask > 0
    values = jnp.where(counted, entropies, jnp.nan)
    threshold = jnp.nanquantile(values, 1.0 - top_quantile)  # NaN with no token: none kept
    return ((entropies * mask >= threshold) & counted).astype(mask.dtype)


def _importance(log_ratio: PerToken, mask: PerToken, level: str) -> Float[Array, "rows _"]:
    """TRL's ``log_importance_weights``: per token, or each row's masked mean (GSPO)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        rows = jnp.sum(log_ratio * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        return rows[:, None]
    raise ValueError(
        f"grpo_loss: importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
        f"got {level!r}"
    )


def _masked_mean(x: Float[Array, "rows _"], mask: PerToken) -> Float[Array, ""]:
    """TRL's ``global_masked_mean``: over counted tokens, or over rows for ``(rows, 1)``."""
    if x.shape[1] == 1:
        return jnp.mean(x)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def grpo_loss(
    logps: Float[Array, "rows new"],
    old_logps: Float[Array, "rows new"],
    advantages: Float[Array, " rows"],
    mask: Float[Array, "rows new"],
    *,
    ref_logps: Float[Array, "rows new"] | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    max_new_tokens: int | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    entropies: Float[Array, "rows new"] | None = None,
    top_entropy_quantile: float = 1.0,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """A GRPO loss (TRL ``_compute_loss``) and its metrics.

    ``log_w = logp - old_logp`` per token (``importance_sampling_level="token"``) or each
    row's masked mean (``"sequence"``, GSPO), ``ratio = exp(log_w)``; the per-token policy
    loss is ``GRPO_LOSSES[loss_type].objective``'s (default the clipped ratio
    ``-min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A)``), times the high-entropy
    mask when ``top_entropy_quantile < 1`` (``entropies`` needed), plus ``beta *
    kl_k3(logp, ref)``; then reduced by the entry's ``reduce``.

    Log-probs may be float32 or float64; the loss computes in float64 when any is, else
    float32. ``vespo``: ``(k_pos, lambda_pos, k_neg, lambda_neg)``.

    Metrics: ``loss``, ``kl`` (masked mean of k3; 0 without a reference), ``clip_ratio``
    (TRL's ``clip_ratio/region_mean``, or ``cispo_clip_ratio``; 0 for losses without
    clipping), ``entropy`` (masked mean; 0 without ``entropies``), ``count`` (completion
    tokens) and ``accumulation_weight`` (this batch's share when micro-batches combine:
    its tokens or its rows, by the entry's ``accumulate``).
    """
    entry = GRPO_LOSSES.lookup(loss_type, "grpo_loss: loss_type")
    dtype = loss_dtype("grpo_loss", logps=logps, old_logps=old_logps, ref_logps=ref_logps)
    logps, old_logps, advantages, mask, ref_logps, entropies = widened(
        dtype, logps, old_logps, advantages, mask, ref_logps, entropies
    )
    log_ratio = logps - old_logps
    options = {
        "epsilon_low": epsilon,
        "epsilon_high": epsilon if epsilon_high is None else epsilon_high,
        "delta": delta,
        "sapo_temperature_pos": sapo_temperature_pos,
        "sapo_temperature_neg": sapo_temperature_neg,
        **dict(zip(VESPO_OPTIONS, vespo, strict=True)),
    }
    ratio = jnp.exp(_importance(log_ratio, mask, importance_sampling_level))
    terms = PolicyTerms(logps, log_ratio, ratio, advantages[:, None], mask, options)
    per_token, clipped = entry.objective(terms)
    if top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("grpo_loss: top_entropy_quantile < 1 needs entropies")
        per_token = per_token * high_entropy_mask(entropies, mask, top_entropy_quantile)
    tokens = jnp.sum(mask)
    kl = jnp.zeros((), dtype)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta != 0 needs ref_logps (the reference model's)")
        per_token_kl = kl_k3(logps, ref_logps)
        per_token = per_token + beta * per_token_kl
        kl = _masked_mean(per_token_kl, mask)
    per_token = jnp.broadcast_to(per_token, mask.shape)  # sequence level without KL: (rows, 1)
    loss = entry.reduce(per_token, mask, max_new_tokens)
    zero = jnp.zeros((), dtype)
    weight = tokens if entry.accumulate == "tokens" else jnp.asarray(mask.shape[0], dtype)
    metrics = {
        "loss": loss,
        "kl": kl,
        "clip_ratio": zero if clipped is None else _masked_mean(clipped, mask),
        "entropy": zero if entropies is None else _masked_mean(entropies, mask),
        "count": tokens,
        "accumulation_weight": weight,
    }
    return loss, metrics
