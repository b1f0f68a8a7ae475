"""The model calls generation is built from: prompt compaction, prefill, one decode step.

What generation needs of a model is ``CausalLM`` (``edl.models.LlamaForCausalLM`` and the
other families fit, LoRA-wrapped or quantized too). Logits are float32 and computed for the
last token of each row only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl.generate.block_prefill import BlockPrefill, unwrap
from edl.generate.cache import init_cache
from edl.generate.paged import init_paged_cache
from edl.models.config import DecoderConfig
from edl.models.llava import LlavaConfig, merge_image_features
from edl.nn.attention import KVCacheLike

__all__ = [
    "CausalLM",
    "CausalTrunk",
    "ImagePrompt",
    "ImageTextLM",
    "decoder",
    "forward",
    "prefill",
    "start",
]


@runtime_checkable
class CausalTrunk(Protocol):
    """The decoder trunk of a ``CausalLM`` as generation calls it (``DecoderModel``)."""

    embed_tokens: Any  # its ``weight.dtype`` is the KV cache's dtype
    config: Any  # ``check_inputs``: generate turns the in-program id check off

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        *,
        attention_mask: Bool[Array, "batch seq"] | None = None,
        cache: KVCacheLike | None = None,
    ) -> Any:
        """New tokens through ``cache``: an output with ``last_hidden_state (batch, seq,
        dim)`` and ``cache``, the updated cache."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """What generation needs of a model: ``edl.models.*ForCausalLM`` (also LoRA-wrapped by
    ``edl.lora`` or quantized by ``edl.quantize``, which keep the model's class).

    ``model`` is the trunk, run with a KV cache; ``lm_logits`` the LM head on final hidden
    states (applied to each row's last token only); ``config`` has HF field names
    (``vocab_size``, and the cache geometry ``init_cache`` reads: ``num_hidden_layers``,
    ``num_key_value_heads``, ``head_dim``); ``unstacked()`` is the same model with its layer
    stacks cut into separate layers (``generate(..., unstack_layers=True)``)."""

    model: CausalTrunk

    @property
    def config(self) -> DecoderConfig: ...

    def lm_logits(self, h: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab"]: ...

    def unstacked(self) -> CausalLM: ...


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


def new_cache(
    model: CausalLM,
    rows: int,
    cache_len: int,
    page_size: int | None,
    kv_cache_dtype: str = "auto",
) -> KVCacheLike:
    """A fresh contiguous cache in the model's dtype, or (``page_size``) a paged one whose
    pool fits every row, stored as ``kv_cache_dtype`` (``edl.ops.kv_quant``)."""
    dtype = model.model.embed_tokens.weight.dtype
    if page_size is None:
        cache = init_cache(model.config, rows, cache_len, dtype)
    else:
        pages = rows * -(-cache_len // page_size)
        cache = init_paged_cache(
            model.config,
            pages,
            page_size,
            batch=rows,
            cache_len=cache_len,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
    # A trunk with recurrent layers (Qwen3-Next) adds their per-row states.
    wrap = getattr(model.model, "wrap_cache", None)
    return cache if wrap is None else wrap(cache)


@runtime_checkable
class ImageTextLM(Protocol):
    """A vision-language model as generation uses it (``edl.models.LlavaForConditionalGeneration``):
    ``get_image_features`` encodes images into the language model's width, ``text_lm()``
    is the language model with its head (a ``CausalLM``) and ``config.image_token_index``
    the placeholder id the features replace."""

    @property
    def config(self) -> LlavaConfig: ...

    def get_image_features(
        self, pixel_values: Float[Array, "images channels height width"]
    ) -> Float[Array, "images tokens dim"]: ...

    def text_lm(self) -> CausalLM: ...


class ImagePrompt(eqx.Module):
    """Image features to merge into a prompt's embeddings at the ``image_token`` ids;
    ``bidirectional``: each image's tokens attend to each other both ways in the prefill
    (Gemma 3, ``edl.generate.block_prefill``)."""

    features: Float[Array, "images tokens dim"]
    image_token: int = eqx.field(static=True)
    bidirectional: bool = eqx.field(static=True, default=False)

    def embed(self, model: CausalLM, ids: Int[Array, "batch seq"]) -> Float[Array, "b s d"]:
        """The prompt's token embeddings with the placeholders replaced (in order)."""
        return merge_image_features(model.model.embed(ids), ids, self.features, self.image_token)


def start(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    attention_mask: Bool[Array, "batch seq"],
    max_new: int,
    page_size: int | None = None,
    images: ImagePrompt | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[
    Float[Array, "batch vocab"], KVCacheLike, Int[Array, "batch seq"], Bool[Array, "batch seq"]
]:
    """Compaction, a fresh cache with room for ``max_new`` tokens and the prefill:
    ``(logits, cache, prompt, mask)`` (the compacted prompt and its mask). ``images``: their
    features replace the image placeholders of the (compacted) prompt in the prefill.
    ``kv_cache_dtype``: the paged cache's storage (``edl.ops.kv_quant``)."""
    ids, mask, lengths = compact_prompts(input_ids, attention_mask)
    rows, cache_len = input_ids.shape[0], input_ids.shape[1] + max_new
    cache = new_cache(model, rows, cache_len, page_size, kv_cache_dtype)
    embeds = None if images is None else images.embed(model, ids)
    if images is not None and images.bidirectional:
        cache = BlockPrefill.of(cache, ids == images.image_token)
    logits, cache = prefill(model, ids, lengths, cache, inputs_embeds=embeds)
    return logits, unwrap(cache), ids, mask


def forward(
    model: CausalLM,
    tokens: Int[Array, "batch width"],
    cache: KVCacheLike,
    *,
    num_new: Int[Array, " batch"] | None = None,
    inputs_embeds: Float[Array, "batch width dim"] | None = None,
    every: bool = False,
    rope_min_length: Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, "batch *width vocab"], Float[Array, "batch width dim"], KVCacheLike]:
    """The one model step every decoding path is built from (``prefill``, ``decode_step``,
    speculative verification and draft steps here; the serving engine's
    ``edl.serve.step.model_step``): row ``b``'s first ``num_new[b]`` tokens (all ``width``
    where None) through ``cache``, a contiguous ``KVCache`` or a ``PagedKVCache``, at
    positions ``cache.lengths[b] + i``.

    Returns ``(logits, hidden, cache)``: float32 logits after each row's last new token
    ``(batch, vocab)`` (meaningless where ``num_new`` is 0), or with ``every`` at every
    position ``(batch, width, vocab)``; the final hidden states ``(batch, width, dim)``;
    the updated cache. ``inputs_embeds``: the tokens' embeddings, used instead of
    ``tokens``' (images merged in). ``rope_min_length``: each row's length for LongRoPE's
    factors at least (the serving engine's chunks of a sequence longer as a whole;
    passed on only when given, so trunks without it still take the call)."""
    width = tokens.shape[1]
    mask = None
    if num_new is not None:
        mask = jnp.arange(width, dtype=jnp.int32)[None] < num_new[:, None]
    extra = {} if rope_min_length is None else {"rope_min_length": rope_min_length}
    if inputs_embeds is None:
        out = model.model(tokens, attention_mask=mask, cache=cache, **extra)
    else:
        out = model.model(inputs_embeds=inputs_embeds, attention_mask=mask, cache=cache, **extra)
    hidden = out.last_hidden_state
    if every:
        last = hidden
    elif num_new is None:
        last = hidden[:, -1]
    else:
        index = jnp.clip(num_new - 1, 0, width - 1)[:, None, None]
        last = jnp.take_along_axis(hidden, index, axis=1)[:, 0]
    return model.lm_logits(last).astype(jnp.float32), hidden, out.cache


def prefill(
    model: CausalLM,
    ids: Int[Array, "batch seq"],
    lengths: Int[Array, " batch"],
    cache: KVCacheLike,
    *,
    inputs_embeds: Float[Array, "batch seq dim"] | None = None,
) -> tuple[Float[Array, "batch vocab"], KVCacheLike]:
    """Run right-padded prompts (each row's first ``lengths`` tokens) through a
    fresh ``cache``: the logits after each row's last prompt token and the filled cache.
    ``inputs_embeds``: the prompt's embeddings, used instead of ``ids``' (images merged
    in)."""
    logits, _, cache = forward(model, ids, cache, num_new=lengths, inputs_embeds=inputs_embeds)
    return logits, cache


def decoder(model: CausalLM, unstack_layers: bool) -> CausalLM:
    """The model the decode loop calls: ``model``, or with ``unstack_layers`` its layer
    stacks cut once into separate layers (``model.unstacked()``). Call it after the
    prefill, which keeps the stacks (scanned: compile time flat in depth)."""
    return model.unstacked() if unstack_layers else model


def decode_step(
    model: CausalLM, tokens: Int[Array, " batch"], cache: KVCacheLike
) -> tuple[Float[Array, "batch vocab"], KVCacheLike]:
    """One new token per row through the cache: next-token logits and the updated cache."""
    logits, _, cache = forward(model, tokens[:, None], cache)
    return logits, cache


def refill_length(model: CausalLM) -> int | None:
    """The cache length at which a decode step re-runs the whole sequence instead, or
    ``None``. transformers' Phi-3 ``generate`` drops its cache when a sequence first grows
    past LongRoPE's ``original_max_position_embeddings``, so that every position, cached
    ones included, is rotated by the long factors from then on; configs that ask for this
    set ``REFILL_PAST_ORIGINAL_CONTEXT`` (``edl.models.Phi3Config``)."""
    config = model.config
    rope = getattr(config, "rope", None)
    if not getattr(config, "REFILL_PAST_ORIGINAL_CONTEXT", False) or rope is None:
        return None
    return rope.original_max_position_embeddings if rope.rope_type == "longrope" else None


def with_row_rope_lengths(model: CausalLM) -> CausalLM:
    """``model`` with ``config.run.rope_length="row"`` where its trunk has run options: each
    row's length-dependent RoPE (``dynamic``, ``longrope``) reads its own length, so a
    request's tokens do not depend on the requests batched with it (the serving engine;
    speculative decoding of a model with a ``refill_length``, whose rows cross it apart)."""
    trunk = getattr(model, "model", None)
    config = getattr(trunk, "config", None)
    if getattr(getattr(config, "run", None), "rope_length", "row") == "row":
        return model
    trunk = dataclasses.replace(trunk, config=config.replace(rope_length="row"))
    return dataclasses.replace(model, model=trunk)


def decode_or_refill(
    model: CausalLM,
    tokens: Int[Array, " batch"],
    cache: KVCacheLike,
    prompt: Int[Array, "batch prompt"],
    prompt_mask: Bool[Array, "batch prompt"],
    generated: Int[Array, "batch new"],
    step: Int[Array, ""],
) -> tuple[Float[Array, "batch vocab"], KVCacheLike]:
    """``decode_step`` of ``tokens`` (``generated[:, step]``), except at ``refill_length``:
    then the prompt and every generated token so far run through the emptied cache as one
    prefill (only models with a refill length compile that branch)."""
    limit = refill_length(model)
    if limit is None:
        return decode_step(model, tokens, cache)

    def refill(cache: KVCacheLike) -> tuple[Float[Array, "batch vocab"], KVCacheLike]:
        ids, valid = history(prompt, prompt_mask, generated, step + 1)
        ids, _, lengths = compact_prompts(ids, valid)
        emptied = dataclasses.replace(cache, lengths=jnp.zeros_like(cache.lengths))
        return prefill(model, ids, lengths, emptied)

    crossing = jnp.max(cache.lengths) == limit
    return jax.lax.cond(crossing, refill, lambda c: decode_step(model, tokens, c), cache)


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
