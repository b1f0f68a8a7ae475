"""DeepSeek-V3's router as a pure function: sigmoid scores, a bias used only to choose
experts, grouped top-k, and scaled weights (HF's ``DeepseekV3TopkRouter``).

The experts fall into ``n_group`` equal groups. Each group is scored by the sum of its two
best biased scores; a token may only pick experts of its ``topk_group`` best groups, then
takes the ``top_k`` best biased scores among those. The *weights* are the unbiased sigmoid
scores of the chosen experts (the ``e_score_correction_bias`` balances the load by shifting
the choice, never the output), optionally renormalised to sum to 1 (``norm_topk_prob``),
times ``routed_scaling_factor``. Everything in float32, as transformers computes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["grouped_sigmoid_route"]


def grouped_sigmoid_route(
    logits: Float[Array, "tokens experts"],
    bias: Float[Array, " experts"],
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"], Float[Array, "tokens experts"]]:
    """``(weights, experts, scores)``: each token's ``top_k`` experts, their float32 weights
    and every expert's sigmoid score (module docstring)."""
    tokens, experts = logits.shape
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"grouped_sigmoid_route: {experts} experts in n_group={n_group} groups with "
            f"topk_group={topk_group}: need equal groups and 1 <= topk_group <= n_group"
        )
    per_group = experts // n_group
    if per_group < 2 or not 1 <= top_k <= topk_group * per_group:
        raise ValueError(
            f"grouped_sigmoid_route: top_k={top_k} from {topk_group} groups of {per_group} "
            "experts (each group needs >= 2 experts: it is scored by its best two)"
        )
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)[None]
    grouped = choice.reshape(tokens, n_group, per_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, topk_group)
    allowed = jnp.any(best_groups[..., None] == jnp.arange(n_group)[None, None], axis=-2)
    allowed = jnp.repeat(allowed, per_group, axis=-1)
    _, chosen = jax.lax.top_k(jnp.where(allowed, choice, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, chosen.astype(jnp.int32), scores
