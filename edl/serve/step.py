"""The engine's device side: one pure, jitted model step over a paged KV cache.

``model_step`` runs every row's new tokens (``width`` columns, right-padded: a prefilling
request's prompt chunk, a decoding request's last token, nothing for a padding row) through
the model and the paged cache, with the model step ``generate`` decodes with too
(``edl.generate.steps.forward``), and returns each row's next-token logits; ``sample_step``
then samples each row's token with that row's own settings (``edl.ops.sampling.RowSampling``,
the one per-row sampler ``edl.generate``'s processors use too), or, when some row of the
call has a repetition / presence / frequency penalty, ``sample_step_penalized``, which also
reads and updates the per-batch-place penalty state (``reset_penalty_slot`` starts a
request's). The sampler is its own small program (its shapes: rows x vocab), so penalties
add one program per row bucket and one reset, not a second copy of every model step.

The engine calls ``model_step`` with a fixed set of shapes: ``(rows,
width)`` tokens over a ``(rows, pages)`` page table trimmed to the pages the step touches
(``Engine.step_shapes``), so a running engine never recompiles; attention reads the whole
trimmed table (``PagedKVCache.whole_table``).

Pages are allocated by the host (``edl.serve.pages``), which knows which pages requests
share; the cache's ``page_table`` and ``lengths`` come from it every step and its ``free``
mask is all False, so the model's own ``PagedKVCache.reserve`` has nothing to allocate. The
engine checks on the host, before each call, that every row's table covers its tokens
(``Engine._call``), and the program holds no check of its own (``PagedKVCache(checked=
False)``): a program with a host callback is never written to jax's persistent compilation
cache, and the step must be, so that a restarted server loads its shapes instead of
compiling them.
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.generate import steps
from edl.generate.paged import PagedKVCache
from edl.generate.steps import CausalLM
from edl.ops.kv_quant import QuantizedPages
from edl.ops.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from edl.ops.sampling import RowSampling, sample_rows
from edl.serve.grammar import mask_logits

__all__ = [
    "PromptLogprobs",
    "model_step",
    "reset_penalty_slot",
    "sample_step",
    "sample_step_penalized",
    "sampled_logprobs",
]


def _masked(
    logits: Float[Array, "batch vocab"], allowed: Int[Array, "batch words"] | None
) -> Float[Array, "batch vocab"]:
    """The logits under the rows' grammar bitmasks (``edl.serve.grammar``), if any."""
    return logits if allowed is None else mask_logits(logits, allowed)


@jax.jit
def sample_step(
    logits: Float[Array, "batch vocab"],
    sampling: RowSampling,
    allowed: Int[Array, "batch words"] | None = None,
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """Each row's next token and its log-prob (``edl.ops.sampling.sample_rows``), for a
    call where no row has a penalty: the sampler holds no penalty code or state.
    ``allowed``: grammar bitmasks (None: the unmasked program)."""
    return sample_rows(_masked(logits, allowed), sampling)


@functools.partial(jax.jit, donate_argnums=(2,))
def sample_step_penalized(
    logits: Float[Array, "batch vocab"],
    sampling: RowSampling,
    counts: Int[Array, "slots vocab"],
    seen: Bool[Array, "slots vocab"],
    slots: Int[Array, " batch"],
    emit: Bool[Array, " batch"],
    allowed: Int[Array, "batch words"] | None = None,
) -> tuple[Int[Array, " batch"], Float[Array, " batch"], Int[Array, "slots vocab"]]:
    """``sample_step`` with the penalties: row ``b`` reads the penalty state of batch place
    ``slots[b]`` (``counts``: its generated ids, ``seen``: its prompt's; a place out of
    range, as padding rows give, reads zeros), and the rows that ``emit`` their token add it
    to their counts. ``counts`` is donated: pass the returned one to the next call."""
    row_counts = counts.at[slots].get(mode="fill", fill_value=0)
    row_seen = seen.at[slots].get(mode="fill", fill_value=False)
    tokens, logprobs = sample_rows(_masked(logits, allowed), sampling, row_counts, row_seen)
    counts = counts.at[slots, tokens].add(emit.astype(counts.dtype), mode="drop")
    return tokens, logprobs, counts


@functools.partial(jax.jit, donate_argnums=(0, 1))
def reset_penalty_slot(
    counts: Int[Array, "slots vocab"],
    seen: Bool[Array, "slots vocab"],
    slot: Int[Array, ""],
    prompt: Int[Array, " max_len"],
) -> tuple[Int[Array, "slots vocab"], Bool[Array, "slots vocab"]]:
    """A new request's penalty state at batch place ``slot``: no generated ids, and its
    prompt's ids (``prompt``, padded with -1 to a fixed length) seen. Both donated."""
    vocab = counts.shape[-1]
    ids = jnp.where((prompt >= 0) & (prompt < vocab), prompt, vocab)
    row = jnp.zeros((vocab + 1,), jnp.bool_).at[ids].set(True)[:vocab]
    # A place out of range changes nothing (mode="drop"): warmup compiles with one.
    return counts.at[slot].set(0, mode="drop"), seen.at[slot].set(row, mode="drop")


# --- log-probs (issue 47): the step's optional outputs, from the raw logits ---------------


class PromptLogprobs(eqx.Module):
    """A prefill call's prompt log-probs (``model_step(..., logprobs=True)``), from the
    model's raw float32 logits (``edl.ops.logprobs.token_logprobs``, ``K =
    MAX_TOP_LOGPROBS``: requests take their first ``k``): ``prompt`` ``(batch, width)`` for
    each new position's ``targets`` token (the prompt's next token) and ``prompt_top_ids`` /
    ``prompt_top`` ``(batch, width, K)``."""

    prompt: Float[Array, "batch width"]
    prompt_top_ids: Int[Array, "batch width k"]
    prompt_top: Float[Array, "batch width k"]


def prompt_logprobs(
    model: CausalLM,
    hidden: Float[Array, "batch width hidden"],
    targets: Int[Array, "batch width"],
) -> PromptLogprobs | None:
    """The log-probs of ``targets`` at every position of ``hidden`` in a prefill call
    (width > 1; whose logits only this variant computes); None in a decode call."""
    batch, width = targets.shape
    if width == 1:
        return None
    k = MAX_TOP_LOGPROBS
    every = model.lm_logits(hidden).astype(jnp.float32).reshape(batch * width, -1)
    chosen, ids, top = token_logprobs(every, targets.reshape(-1), k)
    return PromptLogprobs(
        chosen.reshape(batch, width), ids.reshape(batch, width, k), top.reshape(batch, width, k)
    )


@jax.jit
def sampled_logprobs(
    logits: Float[Array, "batch vocab"], tokens: Int[Array, " batch"]
) -> dict[str, Array]:
    """Each row's sampled token's log-prob and the top ``MAX_TOP_LOGPROBS`` of the raw
    logits (before any sampling processor or grammar mask): ``sampled`` ``(batch,)``,
    ``sampled_top_ids`` / ``sampled_top`` ``(batch, K)``."""
    sampled, ids, top = token_logprobs(logits, tokens, MAX_TOP_LOGPROBS)
    return {"sampled": sampled, "sampled_top_ids": ids, "sampled_top": top}


# --- the step --------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=(1, 2), static_argnames=("logprobs", "every"))
def model_step(
    model: CausalLM,
    k_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    v_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    page_table: Int[Array, "batch pages"],
    lengths: Int[Array, " batch"],
    tokens: Int[Array, "batch width"],
    num_new: Int[Array, " batch"],
    targets: Int[Array, "batch width"] | None = None,
    *,
    logprobs: bool = False,
    every: bool = False,
    rope_min_length: Int[Array, " batch"] | None = None,
) -> tuple[
    Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    Float[Array, "batch *width vocab"],
    PromptLogprobs | None,
]:
    """Row ``b``'s first ``num_new[b]`` tokens (at positions ``lengths[b] + i``) through
    the model, their keys/values written to its pages (``page_table[b]`` must cover
    ``lengths[b] + num_new[b]`` tokens, unchecked here; attention reads all of it); returns
    the updated pools and each row's float32 logits after its last new token (meaningless
    where ``num_new`` is 0), for ``sample_step`` / ``sample_step_penalized``. The pools are
    donated: pass the returned ones to the next call.

    ``logprobs`` (static: its own compiled variant, so calls without it cost nothing more)
    also returns, in a prefill call, ``PromptLogprobs`` of ``targets`` (each position's next
    prompt token), else None. ``every`` (static too): the logits at every position
    ``(batch, width, vocab)`` instead, for speculative verification
    (``edl.serve.speculation``). ``rope_min_length``: each row's LongRoPE length at least
    (``edl.serve.refill``: a chunk of a sequence past the original context)."""
    cache = step_cache(k_pages, v_pages, page_table, lengths)
    logits, extra, cache = run_model(
        model, cache, tokens, num_new, targets, logprobs, every, rope_min_length
    )
    return cache.k_pages, cache.v_pages, logits, extra


def step_cache(
    k_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    v_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"] | QuantizedPages,
    page_table: Int[Array, "batch pages"],
    lengths: Int[Array, " batch"],
) -> PagedKVCache:
    """A step's paged cache: the host allocated its pages (``free`` all False), attention
    reads the whole trimmed table, no host-callback checks (module docstring)."""
    free = jnp.zeros((k_pages.shape[1],), jnp.bool_)
    return PagedKVCache(
        k_pages, v_pages, page_table, lengths, free, whole_table=True, checked=False
    )


def run_model(
    model: CausalLM,
    cache: Any,
    tokens: Int[Array, "batch width"],
    num_new: Int[Array, " batch"],
    targets: Int[Array, "batch width"] | None,
    logprobs: bool,
    every: bool,
    rope_min_length: Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, "batch *width vocab"], PromptLogprobs | None, Any]:
    """``model_step``'s body on a built cache (``edl.serve.state_slots`` wraps the paged
    cache with recurrent states first): ``(logits, prompt log-probs or None, cache)``."""
    logits, hidden, cache = steps.forward(
        model, tokens, cache, num_new=num_new, every=every, rope_min_length=rope_min_length
    )
    extra = None
    if logprobs:
        if targets is None:
            raise ValueError("model_step(logprobs=True) needs targets (batch, width)")
        extra = prompt_logprobs(model, hidden, targets)
    return logits, extra, cache
