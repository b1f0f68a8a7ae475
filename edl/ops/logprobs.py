"""Log-probabilities of chosen tokens and the top-k alternatives, as vLLM and OpenAI report them.

Both generation stacks (``edl.generate.generate`` and the serving engine's
``edl.serve.step.model_step``) call :func:`token_logprobs` on the model's raw float32 logits,
before any sampling processor (temperature, top-k / top-p, penalties): the model's own
distribution, vLLM's default ``raw_logprobs`` and OpenAI's definition. A sampled token that a
processor made likelier than the model thinks it is therefore keeps the model's log-prob.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["MAX_TOP_LOGPROBS", "token_logprobs"]

# OpenAI's limit on ``top_logprobs`` / legacy ``logprobs`` (and vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20


def token_logprobs(
    logits: Float[Array, "batch vocab"], tokens: Int[Array, " batch"], k: int
) -> tuple[Float[Array, " batch"], Int[Array, "batch k"], Float[Array, "batch k"]]:
    """``(chosen, top_ids, top_logprobs)``: ``log_softmax(logits)`` in float32 at each row's
    ``tokens`` ``(batch,)``, and the row's ``k`` most likely ids with their log-probs
    ``(batch, k)``, most likely first (ties: the lower id first, as ``lax.top_k``).

    ``k`` is static, in ``[0, MAX_TOP_LOGPROBS]``; ``k = 0`` gives ``(batch, 0)`` arrays.
    ``logits`` are the model's raw scores; ``-inf`` entries get log-prob ``-inf``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"token_logprobs: k must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}"
        )
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(k, logits.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_logprobs
