"""GRPO's maths as pure functions: completion masks, per-token log-probs, group-normalised
advantages, the k3 KL estimator and the clipped-ratio loss with TRL's normalisations.

Formulas follow TRL 1.16.0 ``trl/trainer/grpo_trainer.py``: ``_generate_and_score_completions``
(advantages, ``scale_rewards``; ``nanstd`` is the Bessel-corrected std; eps ``1e-4``) and
``_compute_loss`` (ratio, two-sided clip with ``epsilon_low`` / ``epsilon_high``, k3 KL
``exp(ref - logp) - (ref - logp) - 1`` weighted by ``beta``, the ``"grpo"`` / ``"bnpo"`` /
``"dr_grpo"`` normalisations, the region clip ratio). Completion masks as its EOS masking:
up to and including the first EOS. The normalisations are the entries of ``GRPO_LOSSES`` (one
more is one :class:`GRPOLoss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl._registry import Registry
from edl.train.loss_inputs import loss_dtype, widened

__all__ = [
    "GRPO_LOSSES",
    "GRPOLoss",
    "completion_logprobs",
    "completion_mask",
    "group_advantages",
    "grpo_loss",
    "kl_k3",
]

SCALE_REWARDS = ("group", "batch", "none")

PerToken = Float[Array, "rows new"]


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """One ``GRPOConfig.loss_type``: an entry of ``GRPO_LOSSES``.

    Attributes:
        name: the ``loss_type``.
        reduce: ``reduce(per_token, mask, max_new_tokens) -> loss``: the per-token losses
            ``(rows, new)`` (clipped-ratio term plus KL) and the completion mask (1.0 on
            counted tokens) to the scalar loss; ``max_new_tokens`` is the completion budget
            (``None`` when the caller gave none).
    """

    name: str
    reduce: Callable[[PerToken, PerToken, int | None], Float[Array, ""]]


def _grpo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """Each completion's masked mean, averaged over completions."""
    rows = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.mean(rows)


def _bnpo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """The masked mean over every token of the batch."""
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _dr_grpo(per_token: PerToken, mask: PerToken, max_new_tokens: int | None) -> Float[Array, ""]:
    """The masked sum over ``rows * max_new_tokens`` (Dr. GRPO: no length bias)."""
    if max_new_tokens is None:
        raise ValueError("grpo_loss: loss_type 'dr_grpo' needs max_new_tokens")
    return jnp.sum(per_token * mask) / (per_token.shape[0] * max_new_tokens)


GRPO_LOSSES: Registry[GRPOLoss] = Registry(
    "GRPO loss", [GRPOLoss("grpo", _grpo), GRPOLoss("bnpo", _bnpo), GRPOLoss("dr_grpo", _dr_grpo)]
)
"""GRPO's loss normalisations by ``loss_type`` (TRL's ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``);
``GRPO_LOSSES.register(GRPOLoss(...))`` adds one."""


def completion_mask(
    completion_ids: Int[Array, "rows new"], eos_ids: tuple[int, ...]
) -> Float[Array, "rows new"]:
    """1.0 on each row's tokens up to and including its first EOS (all of a row without
    one: a truncated completion still counts, TRL's ``mask_truncated_completions=False``),
    0.0 after it."""
    eos = jnp.zeros(completion_ids.shape, jnp.bool_)
    for e in eos_ids:
        eos = eos | (completion_ids == e)
    # Tokens before position t that are EOS; a token is kept while none came before it.
    before = jnp.cumsum(eos.astype(jnp.int32), axis=1) - eos.astype(jnp.int32)
    return (before == 0).astype(jnp.float32)


def completion_logprobs(
    model,
    input_ids: Int[Array, "rows total"],
    attention_mask: Bool[Array, "rows total"],
    num_new: int,
    temperature: float,
) -> Float[Array, "rows new"]:
    """log pi(token | prefix) of the last ``num_new`` tokens of each row, in float32, under
    the model's logits divided by ``temperature`` (TRL's convention: the policy is the
    temperature-scaled distribution that sampling draws from).

    ``input_ids`` = left-padded prompt (``attention_mask`` 0 on its padding) followed by the
    completion; positions count real tokens only, as ``edl.generate`` numbers them.
    """
    positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=positions).logits
    # Logits at t predict token t + 1: the completion's predictions start one before it.
    logits = logits[:, -num_new - 1 : -1].astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = input_ids[:, -num_new:]
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def group_advantages(
    rewards: Float[Array, " rows"],
    num_generations: int,
    *,
    scale_rewards: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
) -> Float[Array, " rows"]:
    """``r - mean(group)``, divided by ``std + eps`` (``"group"``: the group's std,
    ``"batch"``: the whole batch's, ``"none"``: not divided); stds are Bessel-corrected as
    TRL's ``nanstd``. Rows are grouped consecutively: ``rows = prompts * num_generations``.
    Computed on the rewards scaled by a power of two, so any finite float32 rewards give
    finite advantages with ``"group"`` / ``"batch"`` (``"none"`` returns differences in the
    rewards' own scale, which overflow where they exceed float32's max).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(
            f"group_advantages: scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}"
        )
    if num_generations < 2 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"group_advantages: {rewards.shape[0]} rewards do not split into groups of "
            f"num_generations={num_generations} (>= 2)"
        )
    groups = rewards.reshape(-1, num_generations)
    # Rewards up to float32's max would overflow the mean's sum and the std's squares: scale
    # them by a power of two (exact: the formula's value is unchanged) that brings them under 4.
    inverse = _inverse_scale(groups, axis=None if scale_rewards == "batch" else 1)
    scaled = groups * inverse
    centred = scaled - jnp.mean(scaled, axis=1, keepdims=True)
    if scale_rewards == "none":
        return (centred / inverse).reshape(-1)
    if scale_rewards == "group":
        std = jnp.std(scaled, axis=1, ddof=1, keepdims=True)
    else:
        std = jnp.std(scaled, ddof=1)
    # (d * i) / (std * i + eps * i) == d / (std + eps). eps * i can fall below the smallest
    # normal float, which XLA flushes to 0 (then 0 / 0 for equal rewards): keep it from 0.
    eps_scaled = jnp.maximum(eps * inverse, jnp.finfo(rewards.dtype).tiny)
    return (centred / (std + eps_scaled)).reshape(-1)


def _inverse_scale(x: Float[Array, "groups size"], axis: int | None) -> Float[Array, "_ 1"]:
    """``2**-k`` (keepdims along ``axis``), ``k >= 0`` the least with ``max |x| * 2**-k < 2``,
    at most the smallest normal's exponent (float32's max then scales under 4); 1 for
    rewards within [-1, 1]."""
    _, exponent = jnp.frexp(jnp.max(jnp.abs(x), axis=axis, keepdims=True))  # |x| < 2**e
    k = jnp.clip(exponent - 1, 0, -jnp.finfo(x.dtype).minexp)
    return jnp.ldexp(jnp.ones((), x.dtype), -k)


def kl_k3(
    logps: Float[Array, "*shape"], ref_logps: Float[Array, "*shape"]
) -> Float[Array, "*shape"]:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token:
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased under samples from pi)."""
    delta = ref_logps - logps
    return jnp.exp(delta) - delta - 1.0


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
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The clipped-ratio GRPO loss (TRL ``_compute_loss``) and its metrics.

    per token: ``-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
    + beta * kl_k3(logp, ref)`` with ``ratio = exp(logp - old_logp)``; then reduced by
    ``GRPO_LOSSES[loss_type]``: ``"grpo"``: each row's masked mean, averaged over rows;
    ``"bnpo"``: the masked mean over all tokens; ``"dr_grpo"``: the masked sum over ``rows *
    max_new_tokens``.

    Log-probs may be float32 or float64; the loss computes in float64 when any is, else
    float32 (advantages and mask cast alike).

    Metrics: ``loss``, ``kl`` (masked mean of k3; 0 without a reference), ``clip_ratio``
    (TRL's ``clip_ratio/region_mean``: tokens whose ratio is clipped on the side where the
    clip binds, masked mean) and ``count`` (completion tokens).
    """
    reduction = GRPO_LOSSES.lookup(loss_type, "grpo_loss: loss_type")
    dtype = loss_dtype("grpo_loss", logps=logps, old_logps=old_logps, ref_logps=ref_logps)
    logps, old_logps, advantages, mask, ref_logps = widened(
        dtype, logps, old_logps, advantages, mask, ref_logps
    )
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = jnp.exp(logps - old_logps)
    adv = advantages[:, None]
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    tokens = jnp.sum(mask)
    masked_mean = lambda x: jnp.sum(x * mask) / jnp.maximum(tokens, 1.0)
    kl = jnp.zeros((), dtype)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta != 0 needs ref_logps (the reference model's)")
        per_token_kl = kl_k3(logps, ref_logps)
        per_token = per_token + beta * per_token_kl
        kl = masked_mean(per_token_kl)
    loss = reduction.reduce(per_token, mask, max_new_tokens)
    region = ((ratio < 1.0 - epsilon) & (adv < 0)) | ((ratio > 1.0 + high) & (adv > 0))
    metrics = {
        "loss": loss,
        "kl": kl,
        "clip_ratio": masked_mean(region.astype(dtype)),
        "count": tokens,
    }
    return loss, metrics
