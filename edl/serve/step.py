"""The engine's device side: one pure, jitted model step over a paged KV cache.

``model_step`` runs every row's new tokens (``width`` columns, right-padded: a prefilling
request's prompt chunk, a decoding request's last token, nothing for a padding row) through
the model and the paged cache, and samples each row's next token with that row's own
settings (``SlotSampling``). The engine calls it with a fixed set of shapes: ``(rows,
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

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt

from edl.generate.paged import PagedKVCache
from edl.generate.steps import CausalLM
from edl.ops.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from edl.serve.grammar import mask_logits

__all__ = ["SlotSampling", "StepLogprobs", "model_step"]


class SlotSampling(eqx.Module):
    """Per-slot sampling settings as arrays (``(batch,)`` each): ``temperature`` (0:
    greedy), ``top_k`` (0: off), ``top_p`` (1: off), the request's ``seed`` and
    ``counter``, the number of tokens it has generated so far (the key of its next token is
    ``fold_in(key(seed), counter)``, so it does not depend on the batch it runs in)."""

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]
    seed: UInt[Array, " batch"]
    counter: Int[Array, " batch"]


def filter_logits(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> Float[Array, " vocab"]:
    """One row's logits after temperature, top-k (0: off) and top-p (1: off), in HF's
    order and with ``edl.ops.sampling``'s tie rules (ties with a cut-off are kept);
    filtered logits are ``-inf``. ``temperature == 0`` leaves the logits unscaled."""
    vocab = logits.shape[0]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    kth = jnp.sort(scaled)[::-1][jnp.clip(top_k - 1, 0, vocab - 1)]
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    ascending = jnp.sort(scaled)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending))
    remove = (cumulative <= 1.0 - top_p) & (jnp.arange(vocab) < vocab - 1)
    cutoff = jnp.min(jnp.where(remove, jnp.inf, ascending))
    return jnp.where((top_p < 1.0) & (scaled < cutoff), -jnp.inf, scaled)


def _sample_row(logits, temperature, top_k, top_p, seed, counter):
    """One row's token: a draw from its filtered logits, or the argmax at temperature 0."""
    key = jax.random.fold_in(jax.random.key(seed), counter)
    scaled = filter_logits(logits, temperature, top_k, top_p)
    drawn = jax.random.categorical(key, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits).astype(jnp.int32))


def sample_rows(
    logits: Float[Array, "batch vocab"], sampling: SlotSampling
) -> Int[Array, " batch"]:
    """Each row's next token under its own settings (``SlotSampling``)."""
    return jax.vmap(_sample_row)(
        logits,
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.seed,
        sampling.counter,
    )


# --- log-probs (issue 47): the step's optional outputs, from the raw logits ---------------


class StepLogprobs(eqx.Module):
    """A ``model_step(..., logprobs=True)`` call's log-probs, each from the model's raw float32
    logits (``edl.ops.logprobs.token_logprobs``, ``K = MAX_TOP_LOGPROBS``: requests take their
    first ``k``): ``sampled`` ``(batch,)`` and ``sampled_top_ids`` / ``sampled_top``
    ``(batch, K)`` for each row's next token; ``prompt`` ``(batch, width)`` for each new
    position's ``targets`` token (the prompt's next token) and ``prompt_top_ids`` /
    ``prompt_top`` ``(batch, width, K)``; the prompt ones are None in decode calls (width 1)."""

    sampled: Float[Array, " batch"]
    sampled_top_ids: Int[Array, "batch k"]
    sampled_top: Float[Array, "batch k"]
    prompt: Float[Array, "batch width"] | None
    prompt_top_ids: Int[Array, "batch width k"] | None
    prompt_top: Float[Array, "batch width k"] | None


def step_logprobs(
    model: CausalLM,
    hidden: Float[Array, "batch width hidden"],
    logits: Float[Array, "batch vocab"],
    next_tokens: Int[Array, " batch"],
    targets: Int[Array, "batch width"],
) -> StepLogprobs:
    """The log-probs of ``next_tokens`` under ``logits`` and, in a prefill call (width > 1),
    of ``targets`` at every position of ``hidden`` (whose logits only this variant computes)."""
    k = MAX_TOP_LOGPROBS
    sampled = token_logprobs(logits, next_tokens, k)
    batch, width = targets.shape
    if width == 1:
        return StepLogprobs(*sampled, None, None, None)
    every = model.lm_logits(hidden).astype(jnp.float32).reshape(batch * width, -1)
    chosen, ids, top = token_logprobs(every, targets.reshape(-1), k)
    return StepLogprobs(
        *sampled,
        chosen.reshape(batch, width),
        ids.reshape(batch, width, k),
        top.reshape(batch, width, k),
    )


# --- the step --------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=(1, 2), static_argnames=("logprobs",))
def model_step(
    model: CausalLM,
    k_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"],
    v_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "batch pages"],
    lengths: Int[Array, " batch"],
    tokens: Int[Array, "batch width"],
    num_new: Int[Array, " batch"],
    sampling: SlotSampling,
    targets: Int[Array, "batch width"] | None = None,
    allowed: Int[Array, "batch words"] | None = None,
    *,
    logprobs: bool = False,
) -> tuple[
    Float[Array, "layers num_pages page_size kv_heads head_dim"],
    Float[Array, "layers num_pages page_size kv_heads head_dim"],
    Int[Array, " batch"],
    StepLogprobs | None,
]:
    """Row ``b``'s first ``num_new[b]`` tokens (at positions ``lengths[b] + i``) through
    the model, their keys/values written to its pages (``page_table[b]`` must cover
    ``lengths[b] + num_new[b]`` tokens, unchecked here; attention reads all of it); returns
    the updated pools and each row's next token, sampled after its last new token
    (meaningless where ``num_new`` is 0). The pools are donated: pass the returned ones to
    the next call. ``allowed``: the rows' grammar bitmasks (``edl.serve.grammar``; None,
    the plain program, when no row has a grammar); log-probs are of the model's logits,
    before the mask.

    ``logprobs`` (static: its own compiled variant, so calls without it cost nothing more)
    also returns ``StepLogprobs`` (``targets``: each position's next prompt token, needed
    then), else None."""
    free = jnp.zeros((k_pages.shape[1],), jnp.bool_)
    cache = PagedKVCache(
        k_pages, v_pages, page_table, lengths, free, whole_table=True, checked=False
    )
    width = tokens.shape[1]
    mask = jnp.arange(width, dtype=jnp.int32)[None] < num_new[:, None]
    out = model.model(tokens, attention_mask=mask, cache=cache)
    last = jnp.clip(num_new - 1, 0, width - 1)[:, None, None]
    hidden = jnp.take_along_axis(out.last_hidden_state, last, axis=1)[:, 0]
    logits = model.lm_logits(hidden).astype(jnp.float32)
    masked = logits if allowed is None else mask_logits(logits, allowed)  # a separate program
    next_tokens = sample_rows(masked, sampling)
    extra = None
    if logprobs:
        if targets is None:
            raise ValueError("model_step(logprobs=True) needs targets (batch, width)")
        extra = step_logprobs(model, out.last_hidden_state, logits, next_tokens, targets)
    return out.cache.k_pages, out.cache.v_pages, next_tokens, extra
