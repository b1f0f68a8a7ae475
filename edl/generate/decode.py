"""``generate``: greedy, sampling and beam search as one compiled program per setting.

    out = edl.generate.generate(model, input_ids, attention_mask=mask, max_new_tokens=32)
    text_ids = out.sequences[:, input_ids.shape[1]:]

Prompts are left-padded as in HF (any padding works: real tokens are compacted to the front
of the KV cache). The prompt is prefilled once with the flash kernel, then a
``lax.while_loop`` decodes one token per row per iteration through
``edl.ops.cached_attention`` (the decode kernel on GPU) until every row has hit EOS or
``max_new_tokens`` is reached. ``generate_stream`` runs the same step function from Python
and yields each step's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from edl.generate import steps
from edl.generate.beam import beam_search
from edl.generate.config import GenerateOutput, GenerationConfig
from edl.generate.paged import check_quantizable
from edl.generate.speculative import SpeculativeConfig, check_speculative, generate_speculative
from edl.generate.steps import CausalLM, ImagePrompt, ImageTextLM
from edl.nn.attention import KVCacheLike
from edl.ops.checks import check_ids
from edl.ops.kv_quant import KV_CACHE_DTYPES
from edl.ops.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from edl.ops.sampling import LogitsProcessor, compose, greedy, processors_for, sample

__all__ = ["generate", "generate_stream"]


class DecodeState(eqx.Module):
    """The greedy / sampling decode loop's state after ``step`` tokens per row: the
    logits for the next token, the KV cache, the tokens so far (``generated[:, :step]``;
    ``pad_id`` after a row's EOS and, until written, beyond ``step``) and which rows are
    ``done`` (have hit EOS). With log-probs asked (``generate(..., logprobs=k)``), each
    step's chosen token's log-prob and the ``k`` most likely ids and log-probs (``Logprobs``);
    else None, and the loop computes none."""

    step: Int[Array, ""]
    logits: Float[Array, "batch vocab"]
    cache: KVCacheLike
    generated: Int[Array, "batch max_new"]
    done: Bool[Array, " batch"]
    logprobs: Logprobs | None = None

    @classmethod
    def start(
        cls,
        logits: Float[Array, "batch vocab"],
        cache: KVCacheLike,
        max_new: int,
        pad_id: int,
        logprobs: int | None = None,
    ) -> DecodeState:
        """The state after the prefill: nothing generated yet."""
        rows = logits.shape[0]
        generated = jnp.full((rows, max_new), pad_id, jnp.int32)
        lp = None if logprobs is None else Logprobs.empty(rows, max_new, logprobs)
        return cls(jnp.int32(0), logits, cache, generated, jnp.zeros((rows,), jnp.bool_), lp)


# --- log-probs (issue 47) ------------------------------------------------------------------


class Logprobs(eqx.Module):
    """Per generated token, from the model's raw logits before any processor
    (``edl.ops.logprobs.token_logprobs``): ``chosen`` ``(batch, max_new)``, ``top_ids`` and
    ``top`` ``(batch, max_new, k)``; 0 where a row had finished."""

    chosen: Float[Array, "batch max_new"]
    top_ids: Int[Array, "batch max_new k"]
    top: Float[Array, "batch max_new k"]

    @classmethod
    def empty(cls, rows: int, max_new: int, k: int) -> Logprobs:
        return cls(
            jnp.zeros((rows, max_new), jnp.float32),
            jnp.zeros((rows, max_new, k), jnp.int32),
            jnp.zeros((rows, max_new, k), jnp.float32),
        )

    def record(
        self,
        step: Int[Array, ""],
        logits: Float[Array, "batch vocab"],
        token: Int[Array, " batch"],
        done: Bool[Array, " batch"],
    ) -> Logprobs:
        """These log-probs with column ``step`` set from ``logits`` and the chosen ``token``."""
        chosen, ids, top = token_logprobs(logits, token, self.top_ids.shape[-1])
        live = ~done
        return Logprobs(
            self.chosen.at[:, step].set(jnp.where(live, chosen, 0.0)),
            self.top_ids.at[:, step].set(jnp.where(live[:, None], ids, 0)),
            self.top.at[:, step].set(jnp.where(live[:, None], top, 0.0)),
        )


def _check_logprobs(logprobs: int | None, num_beams: int, speculative: bool) -> None:
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int):
        raise ValueError(f"generate: logprobs must be None or an integer, got {logprobs!r}")
    if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"generate: logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    if num_beams > 1:
        raise ValueError("generate: logprobs are not reported by beam search; use num_beams=1")
    if speculative:
        raise ValueError(
            f"generate: logprobs={logprobs} is not available with speculative decoding"
        )


@functools.lru_cache(maxsize=128)
def logits_processor_for(
    config: GenerationConfig, user: LogitsProcessor | None = None
) -> LogitsProcessor:
    """The processors ``config`` asks for, in HF's order (repetition penalty; then, when
    sampling, temperature, top-k, top-p, min-p), followed by the user's own. Memoised:
    the same arguments give the same function, so the compiled decode loop is reused."""
    chain = [processors_for(repetition_penalty=config.repetition_penalty)]
    if config.do_sample:
        chain.append(
            processors_for(
                temperature=config.temperature,
                top_k=config.top_k,
                top_p=config.top_p,
                min_p=config.min_p,
            )
        )
    if user is not None:
        chain.append(user)
    return compose(*chain)


def _sample_step(
    model: CausalLM, state: DecodeState, *, prompt, mask, key, config, processor
) -> tuple[DecodeState, Int[Array, " batch"]]:
    """Choose each row's next token from ``state``'s logits, then run it through the model."""
    step = state.step
    tokens, valid = steps.history(prompt, mask, state.generated, step)
    scores = processor(state.logits, tokens, valid)
    token = sample(scores, steps.fold_step(key, step)) if config.do_sample else greedy(scores)
    token = jnp.where(state.done, config.pad_id, token)
    generated = state.generated.at[:, step].set(token)
    lp = state.logprobs
    if lp is not None:  # from the raw logits, before the processors
        lp = lp.record(step, state.logits, token, state.done)
    done = state.done | steps.is_eos(token, config.eos_ids)
    logits, cache = steps.decode_or_refill(model, token, state.cache, prompt, mask, generated, step)
    return DecodeState(step + 1, logits, cache, generated, done, lp), token


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "processor",
        "max_new",
        "page_size",
        "unstack_layers",
        "logprobs",
        "kv_cache_dtype",
    ),
)
def _generate_compiled(
    model,
    input_ids,
    attention_mask,
    key,
    images=None,
    *,
    config,
    processor,
    max_new,
    page_size=None,
    unstack_layers=False,
    logprobs=None,
    kv_cache_dtype="auto",
):
    if config.num_beams > 1:
        return beam_search(
            model,
            input_ids,
            attention_mask,
            key,
            config=config,
            processor=processor,
            max_new=max_new,
            unstack_layers=unstack_layers,
        )
    logits, cache, prompt, mask = steps.start(
        model, input_ids, attention_mask, max_new, page_size, images, kv_cache_dtype
    )
    state = DecodeState.start(logits, cache, max_new, config.pad_id, logprobs)
    body = functools.partial(
        _sample_step,
        steps.decoder(model, unstack_layers),
        prompt=prompt,
        mask=mask,
        key=key,
        config=config,
        processor=processor,
    )

    def running(s: DecodeState) -> Bool[Array, ""]:
        return (s.step < max_new) & ~jnp.all(s.done)

    final = jax.lax.while_loop(running, lambda s: body(s)[0], state)
    lp = final.logprobs
    return GenerateOutput(
        jnp.concatenate([input_ids, final.generated], axis=1),
        _num_new(final.generated, final.step, config),
        logprobs=None if lp is None else lp.chosen,
        top_logprobs=None if lp is None else lp.top,
        top_ids=None if lp is None else lp.top_ids,
    )


def _num_new(generated, steps_run, config):
    """Tokens generated per row, up to and including its first EOS."""
    eos = steps.is_eos(generated, config.eos_ids)
    first = jnp.argmax(eos, axis=1).astype(jnp.int32)
    return jnp.where(jnp.any(eos, axis=1), first + 1, steps_run)


def _check_inputs(model, input_ids, attention_mask, key, config, page_size, kv_cache_dtype="auto"):
    """Eager checks with messages that name the problem (before anything compiles)."""
    if page_size is not None and (page_size < 1 or config.num_beams > 1):
        raise ValueError(f"generate: page_size {page_size} needs >= 1 and num_beams 1")
    if KV_CACHE_DTYPES.lookup(kv_cache_dtype, "generate: kv_cache_dtype").quantized:
        if page_size is None:
            raise ValueError(
                f"generate: kv_cache_dtype={kv_cache_dtype!r} needs the paged cache (pass "
                f"page_size=...); the contiguous cache stores the compute dtype only"
            )
        check_quantizable(model.config, kv_cache_dtype)
    if not isinstance(model, CausalLM):  # also without the beartype hook, by name
        raise TypeError(
            f"generate needs a causal LM (edl.generate.CausalLM: model, config, lm_logits, "
            f"unstacked), got {type(model).__name__}"
        )
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be integers (batch, seq>0), got {ids.dtype}{ids.shape}")
    vocab = model.config.vocab_size
    check_ids(ids, vocab)
    if config.num_beams == 1 and not 0 <= config.pad_id < vocab:
        raise ValueError(
            f"generate: pad_token_id {config.pad_id} must lie in [0, {vocab}) (vocab_size "
            f"{vocab}): finished rows feed it to the model"
        )
    if attention_mask is None:
        mask = np.ones(ids.shape, bool)
    else:
        mask = np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {mask.shape} must match input_ids {ids.shape}")
        if not (np.issubdtype(mask.dtype, np.integer) or mask.dtype == np.bool_):
            raise ValueError(f"attention_mask must be 0/1 integers or bools, got {mask.dtype}")
        mask = mask.astype(bool)
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise ValueError(f"prompt rows {empty.tolist()} have no tokens (attention_mask all 0)")
    if config.do_sample and key is None:
        raise ValueError("generate: do_sample=True needs a PRNG key (key=jax.random.key(0))")
    return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)


_image_features = eqx.filter_jit(lambda model, pixels: model.get_image_features(pixels))


def _text_and_images(
    model: CausalLM | ImageTextLM, pixel_values: ArrayLike | None, num_beams: int
) -> tuple[CausalLM, ImagePrompt | None]:
    """The causal LM to decode with and the prompt's image features: a vision-language
    model's images are encoded once (their own compiled program) and its language model
    decodes; any other model must come without ``pixel_values``."""
    if not isinstance(model, ImageTextLM):
        if pixel_values is not None:
            raise TypeError(
                f"generate: pixel_values need a vision-language model (such as "
                f"edl.models.LlavaForConditionalGeneration), got {type(model).__name__}"
            )
        return model, None
    if pixel_values is None:
        return model.text_lm(), None
    if num_beams > 1:
        raise ValueError("generate: beam search does not take pixel_values; use num_beams=1")
    features = _image_features(model, jnp.asarray(pixel_values))
    both_ways = getattr(model.config, "BIDIRECTIONAL_IMAGES", False)  # Gemma 3
    return model.text_lm(), ImagePrompt(features, model.config.image_token_index, both_ways)


def _check_image_tokens(ids: jax.Array, images: ImagePrompt | None) -> None:
    """The prompts hold exactly one placeholder per image feature (checked before compiling)."""
    if images is None:
        return
    found = int(np.sum(np.asarray(ids) == images.image_token))
    count, tokens = images.features.shape[:2]
    if found != count * tokens:
        raise ValueError(
            f"generate: input_ids hold {found} image tokens (id {images.image_token}); "
            f"{count} images need {count * tokens} ({tokens} per image)"
        )


def _without_id_checks(model: CausalLM) -> CausalLM:
    """``model`` with its in-program token-id check off (``config.run.check_inputs``), where it
    has one: ``_check_inputs`` has checked the prompt and ``pad_token_id``, and sampled ids
    lie in the vocabulary, so the check would only cost each decode step a host round trip
    (on GPU the conditional's predicate, ~30 us on an H100) and, on CPU, the asynchronous
    dispatch of ``generate_stream``'s steps (``edl.ops.checks``)."""
    trunk = getattr(model, "model", None)
    config = getattr(trunk, "config", None)
    if not getattr(getattr(config, "run", None), "check_inputs", False):
        return model
    trunk = dataclasses.replace(trunk, config=config.replace(check_inputs=False))
    return dataclasses.replace(model, model=trunk)


def prompt_bucket(length: int) -> int:
    """The prompt width ``generate`` compiles for: ``length`` rounded up to 16, 24, 32, 48,
    64, 96, ... (powers of two and 1.5x them), so prompts of nearby lengths share one
    compiled program while padding wastes at most a third of the width."""
    if length < 1:
        raise ValueError(f"prompt_bucket: length must be >= 1, got {length}")
    power = max(16, 1 << (length - 1).bit_length())
    return power * 3 // 4 if power > 16 and power * 3 // 4 >= length else power


def _pad_prompts(
    ids: Int[Array, "batch seq"], mask: Bool[Array, "batch seq"], pad_id: int
) -> tuple[Int[Array, "batch width"], Bool[Array, "batch width"]]:
    """Left-pad prompts to their ``prompt_bucket`` width (mask 0: never attended to, and the
    positions count real tokens only, so the continuation is the same)."""
    extra = prompt_bucket(ids.shape[1]) - ids.shape[1]
    if not extra:
        return ids, mask
    return (
        jnp.pad(ids, ((0, 0), (extra, 0)), constant_values=pad_id),
        jnp.pad(mask, ((0, 0), (extra, 0))),
    )


def _resolve(model, config, max_new_tokens, overrides):
    config = config or GenerationConfig.of_model(model)
    if max_new_tokens is not None:
        if max_new_tokens <= 0:
            raise ValueError(f"generate: max_new_tokens must be positive, got {max_new_tokens}")
        overrides = {**overrides, "max_new_tokens": max_new_tokens}
    return config.replace(**overrides) if overrides else config


def generate(
    model: CausalLM | ImageTextLM,
    input_ids: ArrayLike,
    *,
    pixel_values: ArrayLike | None = None,
    attention_mask: ArrayLike | None = None,
    max_new_tokens: int | None = None,
    key: PRNGKeyArray | None = None,
    config: GenerationConfig | None = None,
    logits_processor: LogitsProcessor | None = None,
    page_size: int | None = None,
    unstack_layers: bool = False,
    bucket_prompts: bool = True,
    logprobs: int | None = None,
    speculative: SpeculativeConfig | None = None,
    draft_model: CausalLM | None = None,
    kv_cache_dtype: str = "auto",
    **overrides: Any,
) -> GenerateOutput:
    """Generate continuations of a batch of prompts (one compiled program per setting).

    Args:
        model: a causal LM such as ``edl.models.LlamaForCausalLM``, or a vision-language
            model (``edl.models.LlavaForConditionalGeneration``).
        input_ids: prompts ``(batch, seq)`` of integer ids (numpy or jax), left-padded as HF
            expects (``attention_mask`` ``(batch, seq)``, 0 on padding); checked eagerly.
        pixel_values: ``(images, channels, height, width)`` for a vision-language model:
            their features replace the prompts' image tokens, in order, in the prefill
            (the KV cache holds them after); one image token per feature (checked).
        max_new_tokens: overrides ``config.max_new_tokens``.
        key: PRNG key for sampling (required with ``do_sample``).
        config: decoding settings (default: the model's own, from its
            ``generation_config.json``: ``GenerationConfig.of_model``); keyword
            ``overrides`` replace its fields (``generate(m, ids, max_new_tokens=8,
            do_sample=True, top_p=0.9, key=k)``). A model whose defaults sample needs ``key``
            (or ``do_sample=False``).
        logits_processor: ``(logits, tokens, valid) -> logits``, applied after the
            config's processors. It is a static argument: pass the same function object
            to reuse the compiled program.
        page_size: decode through a ``PagedKVCache`` with pages of this many tokens
            (default: the contiguous ``KVCache``). Not with beam search.
        kv_cache_dtype: how the KV cache stores keys / values (``edl.ops.kv_quant.
            KV_CACHE_DTYPES``): ``"auto"`` (the model's dtype), ``"int8"`` or
            ``"fp8_e4m3"`` (one float32 scale per token and KV head; about half of bfloat16's
            bytes). Quantized: the paged cache only (``page_size``), read by the paged kernels;
            refused for DeepSeek-V3's latent cache and Qwen3-Next.
        unstack_layers: after the prefill (which stays scanned), slice the layer stacks
            into separate layers once (``model.unstacked()``) and run the decode loop
            unrolled over them. By default every decode step copies each layer's weights
            out of the stacks (XLA does not hoist those slices); unstacked, batch-1
            decoding on CPU is faster, batch 8 unchanged. The price: a second copy of the
            layer weights while generating, and compile time that grows with depth, hence
            opt-in: for small models and long generations. Measured in
            ``benchmarks/RESULTS.md``, "generate: unstacked layers, a run_stack regression
            fixed, interleaved rounds".
        bucket_prompts: left-pad prompts to ``prompt_bucket(seq)`` columns (attention mask
            0) before compiling, so a new prompt length usually reuses a compiled program
            (one per bucket, ``max_new_tokens`` and setting); the output keeps the prompt as
            given. The padding's cost is a wider prefill and cache.
        logprobs: also return each generated token's log-prob and the ``logprobs`` (0-20)
            most likely ids and log-probs at each step (``GenerateOutput.logprobs``,
            ``top_ids``, ``top_logprobs``), from the model's float32 log-softmax before any
            processor (vLLM's and OpenAI's definition); 0: the chosen token's only. None
            (default): none computed. Not with beam search or ``speculative``.
        speculative: decode speculatively (``edl.generate.speculative``): draft
            ``num_speculative_tokens`` per row by prompt lookup (``method="ngram"``) or with
            ``draft_model`` (``"draft"``) and verify them in one target forward. Greedy
            output is the same as without it; sampling keeps the target's distribution.
            Greedy or sampling only (no beams, ``page_size``, ``pixel_values`` or
            ``logprobs``).
        draft_model: the drafting causal LM of ``method="draft"``: smaller, same vocabulary.

    Returns:
        ``GenerateOutput`` (sequences = prompt + new tokens, per-row counts, beam scores,
        log-probs when asked; with ``speculative``, the per-row draft counts).
    """
    config = _resolve(model, config, max_new_tokens, overrides)
    _check_logprobs(logprobs, config.num_beams, speculative is not None)
    model, images = _text_and_images(model, pixel_values, config.num_beams)
    ids, mask = _check_inputs(
        model, input_ids, attention_mask, key, config, page_size, kv_cache_dtype
    )
    _check_image_tokens(ids, images)
    check_speculative(
        model,
        draft_model,
        speculative,
        num_beams=config.num_beams,
        page_size=page_size,
        images=images,
    )
    max_new = config.new_tokens(ids.shape[1])
    processor = logits_processor_for(config, logits_processor)
    key = jax.random.key(0) if key is None else key
    model = _without_id_checks(model)
    width = ids.shape[1]
    if bucket_prompts:
        ids, mask = _pad_prompts(ids, mask, config.pad_id)
    common = dict(config=config, processor=processor, max_new=max_new)
    if speculative is not None:
        draft = None if draft_model is None else _without_id_checks(draft_model)
        out = generate_speculative(
            model, draft, ids, mask, key, spec=speculative, unstack_layers=unstack_layers, **common
        )
    else:
        out = _generate_compiled(
            model,
            ids,
            mask,
            key,
            images,
            page_size=page_size,
            unstack_layers=unstack_layers,
            logprobs=logprobs,
            kv_cache_dtype=kv_cache_dtype,
            **common,
        )
    extra = ids.shape[1] - width  # the bucket's padding leaves the output as given
    return out if not extra else dataclasses.replace(out, sequences=out.sequences[:, extra:])


@functools.partial(
    jax.jit,
    static_argnames=("config", "max_new", "page_size", "unstack_layers", "kv_cache_dtype"),
)
def _stream_setup(
    model,
    input_ids,
    attention_mask,
    images,
    *,
    config,
    max_new,
    page_size,
    unstack_layers,
    kv_cache_dtype="auto",
):
    logits, cache, prompt, mask = steps.start(
        model, input_ids, attention_mask, max_new, page_size, images, kv_cache_dtype
    )
    state = DecodeState.start(logits, cache, max_new, config.pad_id)
    # Sliced once here; every streamed step then reuses these layers.
    return steps.decoder(model, unstack_layers), state, prompt, mask


@functools.partial(jax.jit, static_argnames=("config", "processor"), donate_argnums=(1,))
def _stream_step(model, state, prompt, mask, key, *, config, processor):
    return _sample_step(
        model, state, prompt=prompt, mask=mask, key=key, config=config, processor=processor
    )


def generate_stream(
    model: CausalLM | ImageTextLM,
    input_ids: ArrayLike,
    *,
    pixel_values: ArrayLike | None = None,
    attention_mask: ArrayLike | None = None,
    max_new_tokens: int | None = None,
    key: PRNGKeyArray | None = None,
    config: GenerationConfig | None = None,
    logits_processor: LogitsProcessor | None = None,
    page_size: int | None = None,
    unstack_layers: bool = False,
    bucket_prompts: bool = True,
    kv_cache_dtype: str = "auto",
    **overrides: Any,
) -> Iterator[np.ndarray]:
    """Like ``generate`` (greedy or sampling), but yields each step's tokens ``(batch,)`` as
    soon as they exist (``pad_id`` for finished rows), for interactive use. With the same
    key it produces exactly ``generate``'s tokens. Beam search is not streamed."""
    config = _resolve(model, config, max_new_tokens, overrides)
    if config.num_beams > 1:
        raise ValueError("generate_stream: beam search cannot be streamed; use generate")
    model, images = _text_and_images(model, pixel_values, config.num_beams)
    ids, mask = _check_inputs(
        model, input_ids, attention_mask, key, config, page_size, kv_cache_dtype
    )
    _check_image_tokens(ids, images)
    max_new = config.new_tokens(ids.shape[1])
    processor = logits_processor_for(config, logits_processor)
    key = jax.random.key(0) if key is None else key
    if bucket_prompts:
        ids, mask = _pad_prompts(ids, mask, config.pad_id)
    model, state, prompt, mask = _stream_setup(
        _without_id_checks(model),
        ids,
        mask,
        images,
        config=config,
        max_new=max_new,
        page_size=page_size,
        unstack_layers=unstack_layers,
        kv_cache_dtype=kv_cache_dtype,
    )
    for _ in range(max_new):
        state, token = _stream_step(
            model, state, prompt, mask, key, config=config, processor=processor
        )
        yield np.asarray(token)
        if bool(jnp.all(state.done)):
            return
