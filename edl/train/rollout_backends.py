"""Where GRPO's single-turn rollouts are sampled: the ``ROLLOUT_BACKENDS`` registry, read by
``GRPOConfig.rollout_backend`` and ``edl train --method grpo --rollout-backend``.

- ``"generate"`` (the default): ``edl.generate.generate``, one compiled decode loop over the
  whole batch of ``prompts * num_generations`` left-padded rows (a contiguous KV cache; each
  group's prompt is prefilled ``num_generations`` times).
- ``"engine"``: the serving engine (``edl.train.rollout_engine``): continuous batching over
  the paged KV cache, each prompt's samples sharing its whole prompt pages.

Both sample from the model they are given, the train state's own arrays (no copy), and
return the same thing: ``(tokens, num_new)``, ``tokens`` ``(rows, max_new_tokens)`` int32
(row ``p * g + j``: prompt ``p``'s ``j``-th sample; its stop token included, ``pad_id``
after) and ``num_new`` ``(rows,)``, the new tokens per row, the stop token included. The
same key gives the same completions in each (resume); the two backends draw differently.

Which is faster (``benchmarks/grpo_rollouts.py``; ``benchmarks/RESULTS.md``,
"grpo_rollouts", a shared 2-core CPU): ``generate`` for short prompts and tiny models
(8-token prompts, 4 x 8 samples, 2 layers of width 64: 16.1k vs 6.5k tokens/s), so it stays
the default; the engine once prompts are long (256-token prompts, 4 layers of width 256:
430 vs 1204 tokens/s at G = 8, 477 vs 1309 at G = 16), since it computes a prompt's whole
pages once per group instead of ``num_generations`` times. On short prompts it loses to
its per-step host scheduling (a model call, a sampler call and the tokens read back each
step, where ``generate`` is one compiled loop) and to slicing the stacked layers inside
each call (it runs the state's arrays as they are; ``generate``'s loop slices them once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from edl._registry import Registry
from edl.generate import generate
from edl.generate.steps import CausalLM
from edl.train.rollout_engine import engine_rollouts

__all__ = ["ROLLOUT_BACKENDS", "RolloutBackend", "generate_rollouts"]


def generate_rollouts(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    num_generations: int,
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
    eos_id: int,
    pad_id: int,
    padded: tuple[Int[np.ndarray, "rows width"], Bool[np.ndarray, "rows width"]],
) -> tuple[Int[Array, "rows new"], Int[np.ndarray, " rows"]]:
    """``num_generations`` completions of each prompt by ``edl.generate.generate`` over the
    left-padded rows ``padded`` (``(ids, mask)``, each prompt repeated ``num_generations``
    times, as the GRPO batch holds them); ``temperature=0``: greedy (module docstring)."""
    ids, mask = padded
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k}
        sampling["top_p"] = top_p
    out = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        key=key,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **sampling,
    )
    return out.sequences[:, ids.shape[1] :], np.asarray(out.num_new)


def _engine(model, prompts, num_generations, key, *, padded, **sampling):
    del padded  # the engine takes the prompts unpadded
    return engine_rollouts(model, prompts, num_generations, key, **sampling)


@dataclasses.dataclass(frozen=True)
class RolloutBackend:
    """One way to sample GRPO's rollouts: ``sample(model, prompts, num_generations, key, *,
    max_new_tokens, temperature, top_k, top_p, eos_id, pad_id, padded) -> (tokens,
    num_new)`` (module docstring); ``prompts`` one token list per prompt, ``padded`` the
    ``(ids, mask)`` left-padded rows of the GRPO batch."""

    name: str
    sample: Callable[..., tuple[Array, np.ndarray]]
    help: str


ROLLOUT_BACKENDS: Registry[RolloutBackend] = Registry(
    "rollout backend",
    [
        RolloutBackend("generate", generate_rollouts, "edl.generate's fixed-batch decode loop"),
        RolloutBackend("engine", _engine, "the serving engine, prompt pages shared per group"),
    ],
)
