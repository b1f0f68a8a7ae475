"""DAPO's dynamic sampling for the GRPO step: groups whose rewards do not vary (every
completion of a prompt scored the same) have zero advantages and carry no learning signal;
they are dropped and the batch is filled with the groups of further prompts, drawn from the
run's own prompt iterator, for at most ``GRPOConfig.max_dynamic_sampling_rounds`` extra
generation rounds (Yu et al., 2025, "DAPO", section 3.2; TRL has no such option).

Deterministic for resume: round ``r >= 1`` of step ``s`` samples with ``fold_in(fold_in(key,
s), r)``, and the further prompts come from the same iterator ``edl.train.train`` reads
(a ``PromptBatches``), whose position every checkpoint saves after the step: a resumed run
draws the prompts and the samples the uninterrupted one would.

When the rounds (or the prompts) run out before the batch is full, it is filled with dropped
groups under a zero loss mask: the batch keeps its shape (no recompilation) and those rows
weigh nothing (no policy term, no KL, no tokens in any normaliser).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from edl.train.grpo_objective import group_advantages

__all__ = ["dynamic_batch", "fill_groups", "varied_groups"]

Rollout = Callable[[Sequence[Any], PRNGKeyArray], tuple[dict[str, Array], dict[str, float]]]


def varied_groups(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """``(groups,)`` bool: whether each group's rewards vary: the Bessel-corrected std not
    ``isclose`` to 0 (TRL's ``is_std_zero`` test for ``frac_reward_zero_std``)."""
    std = np.asarray(rewards, np.float64).reshape(-1, num_generations).std(axis=1, ddof=1)
    return ~np.isclose(std, 0.0)


def _left_pad_to(x: Array, width: int, value: Any) -> Array:
    pad = width - x.shape[1]
    return x if pad == 0 else jnp.pad(x, ((0, 0), (pad, 0)), constant_values=value)


def _rows(batch: dict[str, Array], rows: np.ndarray, width: int, pad_id: int) -> dict:
    """``rows`` of a rollout batch, its prompts left-padded to ``width`` total tokens."""
    out = {k: v[rows] for k, v in batch.items()}
    out["input_ids"] = _left_pad_to(out["input_ids"], width, pad_id)
    out["attention_mask"] = _left_pad_to(out["attention_mask"], width, False)
    return out


def _concat(parts: list[dict[str, Array]]) -> dict[str, Array]:
    return {k: jnp.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def fill_groups(
    first: dict[str, Array],
    rollout: Rollout,
    prompts: Iterator[Sequence[Any]] | None,
    *,
    num_generations: int,
    max_rounds: int,
    key: PRNGKeyArray,
    pad_id: int,
) -> tuple[dict[str, Array], dict[str, float]]:
    """The batch of ``first``'s size made of groups whose rewards vary: ``first``'s, then
    those of further rollouts (``rollout(next(prompts), fold_in(key, r))``, ``r = 1 ..
    max_rounds``) until enough; short of that, dropped groups under a zero loss mask.

    ``first`` and each rollout's batch hold ``input_ids`` / ``attention_mask`` ``(rows,
    prompt + new)``, ``completion_mask`` ``(rows, new)`` and ``rewards`` ``(rows,)``, rows
    grouped consecutively by ``num_generations``. Returns the batch (advantages left to the
    caller, computed on it) and metrics: ``dynamic_sampling/rounds`` (extra rounds run),
    ``/kept_groups`` (varied groups in the batch), ``/filled_groups`` (masked fillers),
    ``sample_s`` / ``reward_s`` (the extra rounds' seconds).
    """
    g = num_generations
    target = first["rewards"].shape[0] // g
    kept, dropped, rounds, extra = [], [], 0, {"sample_s": 0.0, "reward_s": 0.0}
    batch = first
    while True:
        varied = varied_groups(np.asarray(batch["rewards"]), g)
        kept += [(batch, i) for i in np.flatnonzero(varied)]
        dropped += [(batch, i) for i in np.flatnonzero(~varied)]
        if len(kept) >= target or rounds >= max_rounds or prompts is None:
            break
        more = next(prompts, None)
        if not more:
            break
        rounds += 1
        batch, metrics = rollout(more, jax.random.fold_in(key, rounds))
        for k in extra:
            extra[k] += metrics[k]
    fillers = dropped[: max(0, target - len(kept))]
    chosen = kept[:target] + fillers
    width = max(b["input_ids"].shape[1] for b, _ in chosen)
    parts = []
    for n, (b, i) in enumerate(chosen):
        part = _rows(b, np.arange(i * g, (i + 1) * g), width, pad_id)
        if n >= len(kept[:target]):  # a filler: in the batch's shape, out of the loss
            part["completion_mask"] = jnp.zeros_like(part["completion_mask"])
        parts.append(part)
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/kept_groups": float(min(len(kept), target)),
        "dynamic_sampling/filled_groups": float(len(fillers)),
        **extra,
    }
    return _concat(parts), metrics


def dynamic_batch(
    step: Any, model: Any, batch: dict[str, Array], metrics: dict[str, Any], key: PRNGKeyArray
) -> tuple[dict[str, Array], dict[str, Any]]:
    """A ``GRPOStep``'s first rollout ``batch`` after dynamic sampling (:func:`fill_groups`
    with ``step.rollout`` on ``model`` and ``step.prompt_source``), its advantages
    recomputed on the groups kept. The metrics stay the first rollout's (what the policy
    scored on the step's own prompts), with the rounds' seconds added."""
    c = step.config
    filled, extra = fill_groups(
        batch,
        lambda prompts, k: step.rollout(model, prompts, k),
        step.prompt_source,
        num_generations=c.num_generations,
        max_rounds=c.max_dynamic_sampling_rounds,
        key=key,
        pad_id=step.pad_id,
    )
    filled["advantages"] = group_advantages(
        filled["rewards"], c.num_generations, scale_rewards=c.scale_rewards
    )
    out = dict(metrics)
    for k, v in extra.items():
        out[k] = out.get(k, 0.0) + v
    return filled, out
