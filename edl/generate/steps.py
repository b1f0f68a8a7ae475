"""The model calls generation is built from: prompt compaction, prefill, one decode step.

A causal LM fits when it has a ``model`` trunk taking ``(input_ids, attention_mask=...,
cache=...)`` and returning ``last_hidden_state`` and ``cache``, and ``lm_logits(hidden)``
(``edl.models.LlamaForCausalLM`` does). Logits are float32 and computed for the last token
of each row only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = ["compact_prompts", "decode_step", "decoder", "prefill"]


def compact_prompts(
    input_ids: Int[Array, "batch seq"], attention_mask: Bool[Array, "batch seq"]
) -> tuple[Int[Array, "batch seq"], Bool[Array, "batch seq"], Int[Array, " batch"]]:
    """Move each row's real tokens (mask 1, in order) to the front: left- (or any-) padded
    prompts become right-padded, as the KV cache stores them. Returns ``(ids, mask,
    lengths)``; padded slots keep their token ids (never attended to)."""
    order = jnp.argsort(~attention_mask, axis=1, stable=True)
    ids = jnp.take_along_axis(input_ids, order, axis=1)
    lengths = jnp.sum(attention_mask, axis=1, dtype=jnp.int32)
    mask = jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None] < lengths[:, None]
    return ids, mask, lengths


def prefill(
    model: Any,
    ids: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"],
    lengths: Int[Array, " batch"],
    cache: Any,
) -> tuple[Float[Array, "batch vocab"], Any]:
    """Run right-padded prompts through a fresh ``cache``: the logits after each row's last
    prompt token and the filled cache."""
    out = model.model(ids, attention_mask=mask, cache=cache)
    last = jnp.take_along_axis(out.last_hidden_state, (lengths - 1)[:, None, None], axis=1)
    return model.lm_logits(last[:, 0]).astype(jnp.float32), out.cache


def decoder(model: Any, unstack_layers: bool) -> Any:
    """The model the decode loop calls: ``model``, or with ``unstack_layers`` its layer
    stacks cut once into separate layers (``model.unstacked()``). Call it after the
    prefill, which keeps the stacks (scanned: compile time flat in depth)."""
    return model.unstacked() if unstack_layers else model


def decode_step(
    model: Any, tokens: Int[Array, " batch"], cache: Any
) -> tuple[Float[Array, "batch vocab"], Any]:
    """One new token per row through the cache: next-token logits and the updated cache."""
    out = model.model(tokens[:, None], cache=cache)
    return model.lm_logits(out.last_hidden_state[:, 0]).astype(jnp.float32), out.cache


def history(
    prompt: Int[Array, "batch prompt"],
    prompt_mask: Bool[Array, "batch prompt"],
    generated: Int[Array, "batch new"],
    step: Int[Array, ""],
) -> tuple[Int[Array, "batch total"], Bool[Array, "batch total"]]:
    """Every token so far (prompt + generated before ``step``) for logits processors."""
    done = jnp.arange(generated.shape[1], dtype=jnp.int32)[None] < step
    tokens = jnp.concatenate([prompt, generated], axis=1)
    valid = jnp.concatenate([prompt_mask, jnp.broadcast_to(done, generated.shape)], axis=1)
    return tokens, valid


def is_eos(tokens: Int[Array, "*shape"], eos_ids: tuple[int, ...]) -> Bool[Array, "*shape"]:
    """Whether each token is one of ``eos_ids`` (all False when there are none)."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, jnp.bool_)
    return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def fold_step(key: jax.Array, step: Int[Array, ""]) -> jax.Array:
    """The sampling key of decode step ``step`` (the compiled loop and the streaming one
    draw identical tokens from one key)."""
    return jax.random.fold_in(key, step)
