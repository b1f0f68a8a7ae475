"""GRPO with environments: a ``GRPOStep``'s rollout when ``make_grpo_step(...,
environment=factory)`` is given: ``num_generations`` multi-turn conversations per prompt
record (``edl.train.multiturn``, up to ``GRPOConfig.max_turns`` turns), one environment per
row built by ``factory()``.

Rewards: each row's environment rewards summed over its turns, plus the step's weighted
reward functions (optional with an environment) called as for single-turn GRPO with
``completions`` the last turn's text and ``completion_ids`` the row's tokens after the
prompt (model and environment tokens); group-normalised advantages of that total. The loss
mask covers the model's own tokens only; ``mask_truncated_completions`` drops rows whose
turn ran out of tokens. ``dr_grpo``'s constant normaliser stays ``max_new_tokens`` (one
turn's budget). Metrics add ``turns`` (mean per row), ``tool_calls`` (the environment's
``tool`` messages, one per call, mean per row), ``truncated`` (the fraction of rows cut by
the budget) and ``reward/environment``; ``sample_s`` includes the environments' steps
(the tools' run time).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from edl.train.grpo_objective import group_advantages
from edl.train.grpo_rewards import score_completions
from edl.train.multiturn import multi_turn_rollout, trajectory_batch

__all__ = ["check_environment", "tool_rollout"]


def check_environment(environment: Any, tokenizer: Any, config: Any) -> None:
    """``make_grpo_step``'s checks of ``environment=`` (None passes): a callable (the
    factory), a tokenizer with a chat template to render the conversations, and no dynamic
    sampling (its refills assume single-turn batches of one completion width)."""
    if environment is None:
        return
    if config.dynamic_sampling:
        raise ValueError(
            "make_grpo_step: GRPOConfig.dynamic_sampling is not supported with environment= "
            "(multi-turn batches differ in width); turn one of them off"
        )
    if not callable(environment):
        raise TypeError(
            "make_grpo_step: environment must be a factory () -> Environment, got "
            f"{environment!r:.80}"
        )
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(
            "make_grpo_step: environment= renders conversations with the chat template; "
            f"{type(tokenizer).__name__} has none (load the model's tokenizer: load_tokenizer)"
        )


def _rewards(step: Any, rows: list, records: list[Mapping[str, Any]]) -> tuple[np.ndarray, dict]:
    g = step.config.num_generations
    total = np.array([r.reward for r in rows], np.float32)
    if not np.all(np.isfinite(total)):
        bad = np.flatnonzero(~np.isfinite(total))
        raise ValueError(
            f"GRPO step: the environment's rewards are not finite at rows {bad[:8].tolist()}: "
            f"{total[bad[:8]].tolist()}"
        )
    per_fn = {"reward/environment": float(total.mean())}
    if step.reward_fns:
        columns = {
            k: [r[k] for r in records for _ in range(g)] for k in records[0] if k != "prompt"
        }
        scored, means = score_completions(
            step.reward_fns,
            step.weights,
            [r["prompt"] for r in records for _ in range(g)],
            [r.answer for r in rows],
            [r.tokens for r in rows],
            columns,
        )
        total, per_fn = total + scored, {**per_fn, **means}
    return total, per_fn


def tool_rollout(
    step: Any, model: Any, records: Sequence[Mapping[str, Any]], key: PRNGKeyArray
) -> tuple[dict[str, Array], dict[str, float]]:
    """``step``'s (a ``GRPOStep`` with an environment) batch and metrics for ``records``:
    ``completion_length`` is the mean of each row's own tokens, ``turns`` the mean turns,
    ``tool_calls`` the mean tool results, ``truncated`` the fraction of rows cut by the
    token budget."""
    c, g = step.config, step.config.num_generations
    records = list(records)
    envs = [step.environment() for _ in range(len(records) * g)]
    t0 = time.perf_counter()
    rows = multi_turn_rollout(
        model,
        step.tokenizer,
        envs,
        [r for r in records for _ in range(g)],
        key=key,
        max_turns=c.max_turns,
        eos_id=step.eos_id,
        sampling={
            "max_new_tokens": c.max_new_tokens,
            "temperature": c.temperature,
            "top_k": c.top_k,
            "top_p": c.top_p,
            "pad_token_id": step.pad_id,
        },
    )
    t1 = time.perf_counter()
    rewards, per_fn = _rewards(step, rows, records)
    batch = trajectory_batch(rows, step.pad_id)
    if c.mask_truncated_completions:
        keep = np.array([not r.truncated for r in rows], np.float32)[:, None]
        batch["completion_mask"] = batch["completion_mask"] * jnp.asarray(keep)
    batch["advantages"] = group_advantages(jnp.asarray(rewards), g, scale_rewards=c.scale_rewards)
    batch["rewards"] = jnp.asarray(rewards)
    step.last_rollout = {
        "prompts": [r["prompt"] for r in records for _ in range(g)],
        "completions": [r.answer for r in rows],
        "conversations": [r.messages for r in rows],
        "rewards": rewards,
    }
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        **per_fn,
        "completion_length": float(np.mean([sum(r.own) for r in rows])),
        "turns": float(np.mean([r.turns for r in rows])),
        "tool_calls": float(np.mean([r.tool_calls for r in rows])),
        "truncated": float(np.mean([r.truncated for r in rows])),
        "sample_s": t1 - t0,
        "reward_s": time.perf_counter() - t1,
    }
    return batch, metrics
