"""Text in, text out: ``generate_text`` and ``stream_text`` over a model and its tokenizer.

    tokenizer = edl.text.load_tokenizer(model_dir)
    model = edl.from_pretrained(model_dir)
    print(generate_text(model, tokenizer, "The capital of France is", max_new_tokens=20))
    for piece in stream_text(model, tokenizer, "Hi!", chat=True, max_new_tokens=64):
        print(piece, end="", flush=True)

The prompt's ids are what transformers would feed the model: a plain prompt is encoded as
``tokenizer(prompt)`` (a BOS when the tokenizer adds one), a chat is the tokenizer's chat
template with the generation prompt. Generation stops at the model's EOS ids
(``generation_config.json``, else the tokenizer's EOS); the text excludes the prompt and the
EOS. Greedy unless ``temperature > 0``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import PRNGKeyArray

from edl.generate.config import GenerationConfig
from edl.generate.decode import CausalLM, generate, generate_stream
from edl.text.detokenize import IncrementalText, decode
from edl.text.tokenizer import Tokenizer

__all__ = ["generate_text", "prompt_ids", "stream_text"]


def prompt_ids(
    tokenizer: Tokenizer,
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    system: str | None = None,
    chat: bool = False,
) -> list[int]:
    """The prompt's token ids: ``messages`` (or, with ``chat``, ``prompt`` as one user
    message), ``system`` first when given, through the tokenizer's chat template with the
    generation prompt; otherwise ``prompt`` encoded as transformers' ``tokenizer(prompt)``
    (``encode(prompt, add_bos=tokenizer.adds_bos)``). Raises ``ValueError`` for a missing
    or doubly given prompt."""
    if messages is not None and prompt is not None:
        raise ValueError("prompt_ids: give either prompt or messages, not both")
    if messages is None and (chat or system is not None):
        if prompt is None:
            raise ValueError("prompt_ids: chat needs a prompt or messages")
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            name = getattr(tokenizer, "name", type(tokenizer).__name__)
            raise ValueError(f"prompt_ids: the tokenizer {name} has no chat template")
        turns = [
            *([{"role": "system", "content": system}] if system is not None else []),
            *messages,
        ]
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True))
    if prompt is None:
        raise ValueError("prompt_ids: give a prompt or messages")
    return list(tokenizer.encode(prompt, add_bos=bool(getattr(tokenizer, "adds_bos", False))))


PAGE_SIZE = 16  # the paged cache's page of a quantized KV cache here


def _cache_options(kv_cache_dtype: str) -> dict[str, Any]:
    """``generate``'s cache arguments: a quantized cache is a paged one."""
    if kv_cache_dtype == "auto":
        return {}
    return {"kv_cache_dtype": kv_cache_dtype, "page_size": PAGE_SIZE}


def _config(
    model: CausalLM,
    tokenizer: Tokenizer,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    num_beams: int,
) -> GenerationConfig:
    """The model's generation defaults with this call's length and search; EOS from the
    tokenizer when the model names none."""
    if not temperature >= 0:
        raise ValueError(f"generate_text: temperature must be >= 0, got {temperature}")
    config = GenerationConfig.of_model(model)
    changes: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "num_beams": num_beams,
        "do_sample": temperature > 0,
    }
    if temperature > 0:
        changes["temperature"] = temperature
    if top_p is not None:
        changes["top_p"] = top_p
    if top_k is not None:
        changes["top_k"] = top_k
    eos = getattr(tokenizer, "eos_id", None)
    if not config.eos_ids and eos is not None:
        changes["eos_token_id"] = int(eos)
    return config.replace(**changes)


def stream_text(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    system: str | None = None,
    chat: bool = False,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    key: PRNGKeyArray | None = None,
    skip_special_tokens: bool = True,
    kv_cache_dtype: str = "auto",
) -> Iterator[str]:
    """Like :func:`generate_text` (no beam search), yielding the text in pieces as tokens
    are generated (the server's incremental detokenizer,
    :class:`edl.text.detokenize.IncrementalText`: a piece is released once no later token
    can change it); their concatenation is :func:`generate_text`'s text for the same
    arguments whenever decoding more ids only appends text."""
    ids = prompt_ids(tokenizer, prompt, messages=messages, system=system, chat=chat)
    config = _config(
        model,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        num_beams=1,
    )
    eos = set(config.eos_ids)
    stream = IncrementalText(tokenizer, skip_special_tokens=skip_special_tokens)
    cache = _cache_options(kv_cache_dtype)
    for step in generate_stream(
        model, np.asarray([ids], np.int32), key=key, config=config, **cache
    ):
        token = int(step[0])
        if token in eos:
            break
        piece = stream.push([token])
        if piece:
            yield piece
    rest = stream.end()
    if rest:
        yield rest


def generate_text(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    system: str | None = None,
    chat: bool = False,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    num_beams: int = 1,
    key: PRNGKeyArray | None = None,
    skip_special_tokens: bool = True,
    kv_cache_dtype: str = "auto",
) -> str:
    """The model's continuation of ``prompt`` (or its reply to a chat), as text.

    Args:
        model: a causal LM (``edl.from_pretrained``).
        tokenizer: ``edl.text.HFTokenizer`` (``load_tokenizer``) or ``ByteTokenizer``.
        prompt: plain text, encoded as transformers' ``tokenizer(prompt)``; with ``chat``
            (or ``system``) it is sent as one user message.
        messages: a conversation (``{"role", "content"}`` dicts) for the chat template.
        system: a system message put first.
        max_new_tokens: at most this many tokens (the EOS included).
        temperature: 0 is greedy; above 0 samples (with ``top_p`` / ``top_k``, default the
            model's ``generation_config.json`` and else HF's) and needs ``key``.
        num_beams: beam search when > 1 (the best beam's text).
        skip_special_tokens: drop special tokens from the text (the EOS is never in it).
        kv_cache_dtype: the KV cache's storage (``generate``'s); a quantized one decodes
            through the paged cache, pages of ``PAGE_SIZE`` tokens (not with beams).

    Returns the generated text alone: no prompt, no EOS.
    """
    ids = prompt_ids(tokenizer, prompt, messages=messages, system=system, chat=chat)
    config = _config(
        model,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        num_beams=num_beams,
    )
    cache = _cache_options(kv_cache_dtype)
    out = generate(model, np.asarray([ids], np.int32), key=key, config=config, **cache)
    new = np.asarray(out.sequences[0, len(ids) : len(ids) + int(out.num_new[0])]).tolist()
    eos = set(config.eos_ids)
    cut = next((i for i, t in enumerate(new) if t in eos), len(new))
    return decode(tokenizer, new[:cut], skip_special_tokens)
