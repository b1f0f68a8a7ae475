"""On-policy distillation with environments: the student's rollouts are multi-turn
conversations (``edl.train.multiturn``: tool calls answered by one environment per row, up
to ``max_turns`` turns), and the teacher scores the same tokens: the divergence counts the
student's own tokens only, environment and template tokens being context for both models.

Used by ``make_distill_step(..., environment=factory, tokenizer=...)``, whose batches are
then lists of prompt records (``edl.train.PromptBatches``, as GRPO reads them) rather than
``DistillBatches``: every step samples (``lmbda=1``, or ``seq_kd``: the teacher's own
rollouts with the same tools), since such records hold no completions to train on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from edl.train.environments import prompt_messages
from edl.train.multiturn import multi_turn_rollout, trajectory_batch

__all__ = ["check_tool_options", "tool_batch"]


def check_tool_options(who: str, tokenizer: Any, lmbda: float, seq_kd: bool, turns: int) -> None:
    """``make_distill_step``'s checks of its ``environment=`` options (``ValueError``)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(
            f"{who}: environment= renders conversations with a chat template: pass the "
            f"model's tokenizer= (got {type(tokenizer).__name__})"
        )
    if lmbda < 1.0 and not seq_kd:
        raise ValueError(
            f"{who}: with environment=, batches are prompt records without completions, so "
            f"every step must sample: lmbda=1 or seq_kd=True (got lmbda={lmbda})"
        )
    if turns < 1:
        raise ValueError(f"{who}: max_turns must be >= 1, got {turns}")


def tool_batch(
    options: Mapping[str, Any],
    model: Any,
    records: Any,
    key: PRNGKeyArray,
) -> dict[str, Array]:
    """``model``'s conversations from ``records`` (``options``: the distill step's
    ``environment``, ``tokenizer``, ``max_turns``, ``max_new_tokens``, ``temperature``,
    ``eos_token_id``, ``pad_token_id``) as a distillation batch: ``input_ids`` /
    ``attention_mask`` ``(rows, seq)`` and ``labels`` (unshifted) equal to the ids on the
    model's own tokens, -100 elsewhere."""
    if isinstance(records, Mapping) or not records:
        raise ValueError(
            "DistillStep with an environment: each batch must be a non-empty list of prompt "
            f"records (edl.train.PromptBatches), got {type(records).__name__}"
        )
    records = [r if isinstance(r, Mapping) else {"prompt": r} for r in records]
    for record in records:
        prompt_messages(record)  # a clear error for a record without a usable prompt
    rows = multi_turn_rollout(
        model,
        options["tokenizer"],
        [options["environment"]() for _ in records],
        records,
        key=key,
        max_turns=options["max_turns"],
        eos_id=options["eos_token_id"],
        sampling={
            "max_new_tokens": options["max_new_tokens"],
            "temperature": options["temperature"],
            "top_k": None,
            "top_p": 1.0,
            "pad_token_id": options["pad_token_id"],
        },
    )
    batch = trajectory_batch(rows, options["pad_token_id"])
    ids, own = np.asarray(batch["input_ids"]), np.asarray(batch["completion_mask"])
    counted = np.pad(own > 0, ((0, 0), (ids.shape[1] - own.shape[1], 0)))
    return {
        "input_ids": batch["input_ids"],
        "labels": jnp.asarray(np.where(counted, ids, -100).astype(np.int32)),
        "attention_mask": jnp.asarray(np.asarray(batch["attention_mask"]).astype(np.int32)),
    }
