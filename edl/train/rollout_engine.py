"""GRPO rollouts on the serving engine (``edl.serve.engine.Engine``): ``num_generations``
completions of each prompt by continuous batching over the paged KV cache, the ``"engine"``
entry of ``edl.train.rollout_backends.ROLLOUT_BACKENDS``.

What it returns is what ``edl.generate.generate`` gives GRPO (``rollout_backends``): each
row's ``max_new_tokens`` new tokens, the stop token included, ``pad_id`` after it, and the
count of new tokens per row; rows are prompt-major (the ``g`` samples of prompt 0 first).

- No weight copy: the engine runs ``model`` itself, its layer stacks as they are
  (``Engine(unstack_layers=False)``): the arrays the train state holds, the same buffers.
- Compile once: ``edl.serve.step.model_step`` is one module-level ``jax.jit`` with the model
  an argument, so new parameters of the same shapes reuse its compiled programs. Each call
  builds a fresh engine (fresh page pools: pages computed with the previous step's
  parameters must not be shared with this step's requests) whose geometry depends only on
  bucketed sizes (``_geometry``): the rows rounded up to a power of two, prompt + new tokens
  rounded up by ``edl.generate.decode.prompt_bucket``, so steps with nearby prompt lengths
  call the same programs.
- Prefix sharing: each prompt's first sample is submitted alone; once its prompt is
  computed (its first token is out), its whole prompt pages are in the engine's prefix cache
  and the other ``g - 1`` samples, submitted then, share them (``Engine``'s
  ``prefix_caching``): the prompt is computed once per group, up to its last partial page and
  last token, which each sample computes again. A prompt shorter than a page shares nothing;
  its samples are all submitted at once.
- Sampling: row ``i``'s seed is ``jax.random.bits(key, (rows,))[i]`` and the engine draws
  its ``t``-th token with ``fold_in(key(seed), t)`` (``edl.serve.sampler``), so the same key
  gives the same completions (a resumed run's step ``s`` key is ``fold_in(key, s)``, as
  with ``generate``; both follow the same schedule, so the calls have the same shapes and
  the same float rounding). The draws differ from ``generate``'s (another key scheme);
  greedy decoding (``temperature=0``) gives ``generate``'s tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from edl.generate.decode import prompt_bucket
from edl.generate.steps import CausalLM
from edl.serve.engine import Engine
from edl.serve.types import SamplingParams

__all__ = ["engine_rollouts", "rollout_engine"]

PAGE_SIZE = 16
"""Tokens per KV page: the unit of prefix sharing (a prompt shares its whole pages)."""


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _geometry(rows: int, longest: int, max_new_tokens: int) -> dict[str, int]:
    """The engine's sizes, bucketed so that nearby batches build the same programs:
    ``max_batch`` (all rows run at once), ``max_model_len``, ``prefill_chunk`` (a prompt
    prefills in one call) and ``prefill_tokens`` (every first sample's prompt in one call)."""
    chunk = prompt_bucket(longest)
    return {
        "max_batch": _pow2(rows),
        "max_model_len": prompt_bucket(longest + max_new_tokens),
        "page_size": PAGE_SIZE,
        "prefill_chunk": chunk,
        "prefill_tokens": chunk * _pow2(rows),
        "max_queue": max(rows, 1),
    }


def rollout_engine(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    num_generations: int,
    *,
    max_new_tokens: int,
    eos_id: int,
) -> Engine:
    """The engine one rollout runs on: ``model``'s own arrays, stacked, prefix caching on."""
    longest = max(len(p) for p in prompts)
    sizes = _geometry(len(prompts) * num_generations, longest, max_new_tokens)
    return Engine(model, eos_token_ids=(eos_id,), unstack_layers=False, **sizes)


def _params(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float, seed: int
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )


def engine_rollouts(
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
    engine: Engine | None = None,
) -> tuple[Int[Array, "rows new"], Int[np.ndarray, " rows"]]:
    """``num_generations`` completions of each of ``prompts`` (token ids, unpadded) on the
    serving engine (module docstring); ``temperature=0``: greedy.

    Returns ``(tokens, num_new)``: ``tokens`` ``(len(prompts) * num_generations,
    max_new_tokens)`` int32, row ``p * num_generations + j`` the ``j``-th sample of prompt
    ``p``, its stop token (``eos_id``) included and ``pad_id`` after; ``num_new`` each row's
    new tokens, the stop token included. ``engine``: one built by :func:`rollout_engine`
    (tests inspect it), else a fresh one.
    """
    g, rows = num_generations, len(prompts) * num_generations
    engine = engine or rollout_engine(
        model, prompts, g, max_new_tokens=max_new_tokens, eos_id=eos_id
    )
    seeds = np.asarray(jax.random.bits(key, (rows,), jnp.uint32)).tolist()
    params = [_params(max_new_tokens, temperature, top_k, top_p, s) for s in seeds]
    row_of: dict[int, int] = {}  # request id -> row
    waiting: dict[int, int] = {}  # a group's first request id -> its prompt (rest not added)
    for p, prompt in enumerate(prompts):
        first = engine.add_request(prompt, params[p * g])
        row_of[first] = p * g
        if len(prompt) - 1 >= engine.page_size:  # whole pages to share: the rest waits
            waiting[first] = p
        else:
            for j in range(1, g):
                row_of[engine.add_request(prompt, params[p * g + j])] = p * g + j
    out = np.full((rows, max_new_tokens), pad_id, np.int32)
    num_new = np.zeros((rows,), np.int32)
    while engine.has_unfinished():
        for o in engine.step():
            row = row_of[o.request_id]
            n = len(o.new_token_ids)
            out[row, num_new[row] : num_new[row] + n] = o.new_token_ids
            num_new[row] += n
            if o.request_id in waiting:  # its prompt pages are published: add the rest
                p = waiting.pop(o.request_id)
                for j in range(1, g):
                    row_of[engine.add_request(prompts[p], params[p * g + j])] = p * g + j
    return jnp.asarray(out), num_new
