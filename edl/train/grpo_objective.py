"""GRPO's maths as pure functions: completion masks, per-token log-probs, group-normalised
advantages, the k3 KL estimator and the clipped-ratio loss with TRL's normalisations.

Formulas follow TRL 1.16.0 ``trl/trainer/grpo_trainer.py``: ``_generate_and_score_completions``
(advantages, ``scale_rewards``; ``nanstd`` is the Bessel-corrected std; eps ``1e-4``) and
``_compute_loss`` (ratio, two-sided clip with ``epsilon_low`` / ``epsilon_high``, k3 KL
``exp(ref - logp) - (ref - logp) - 1`` weighted by ``beta``, the ``"grpo"`` / ``"bnpo"`` /
``"dr_grpo"`` normalisations, the region clip ratio). Completion masks as its EOS masking:
up to and including the first EOS. The loss family itself (``grpo_loss``, ``GRPO_LOSSES``,
``kl_k3``) lives in ``edl.train.grpo_losses`` and is importable from here as before.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.train.grpo_losses import GRPO_LOSSES, GRPOLoss, grpo_loss, kl_k3, token_entropy

__all__ = [
    "GRPO_LOSSES",
    "GRPOLoss",
    "completion_logprobs",
    "completion_mask",
    "group_advantages",
    "grpo_loss",
    "kl_k3",
    "truncated_rows",
]

SCALE_REWARDS = ("group", "batch", "none")


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


def truncated_rows(
    completion_ids: Int[Array, "rows new"],
    mask: Float[Array, "rows new"],
    stop_ids: tuple[int, ...],
) -> Bool[Array, " rows"]:
    """Rows whose last counted token (``mask``: a prefix of each row) is none of
    ``stop_ids`` (EOS and pad): completions cut at the token budget, which TRL's
    ``mask_truncated_completions`` drops from the loss."""
    last = jnp.maximum(jnp.sum(mask, axis=1).astype(jnp.int32) - 1, 0)
    token = jnp.take_along_axis(completion_ids, last[:, None], axis=1)[:, 0]
    stopped = jnp.zeros(token.shape, jnp.bool_)
    for s in stop_ids:
        stopped = stopped | (token == s)
    return ~stopped


def completion_logprobs(
    model,
    input_ids: Int[Array, "rows total"],
    attention_mask: Bool[Array, "rows total"],
    num_new: int,
    temperature: float,
    *,
    with_entropy: bool = False,
) -> Float[Array, "rows new"] | tuple[Float[Array, "rows new"], Float[Array, "rows new"]]:
    """log pi(token | prefix) of the last ``num_new`` tokens of each row, in float32, under
    the model's logits divided by ``temperature`` (TRL's convention: the policy is the
    temperature-scaled distribution that sampling draws from); with ``with_entropy``, also
    the entropy of that distribution at each of those positions (no gradient: it only
    selects tokens, TRL's ``top_entropy_quantile``), as ``(logps, entropies)``.

    ``input_ids`` = left-padded prompt (``attention_mask`` 0 on its padding) followed by the
    completion; positions count real tokens only, as ``edl.generate`` numbers them.
    """
    positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=positions).logits
    # Logits at t predict token t + 1: the completion's predictions start one before it.
    logits = logits[:, -num_new - 1 : -1].astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = input_ids[:, -num_new:]
    token_logps = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return token_logps
    return token_logps, jax.lax.stop_gradient(token_entropy(logits))


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
