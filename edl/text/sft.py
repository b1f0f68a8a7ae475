"""Supervised fine-tuning examples: token ids and labels with the loss only where it belongs.

Both encoders return an :class:`Example`, ``input_ids`` and ``labels`` of one shape
``(seq,)``; ``labels`` is ``input_ids`` with :data:`IGNORE_INDEX` where no loss is taken.
Labels are not shifted (Hugging Face's convention, as everywhere in edl: position ``t``
predicts ``labels[t + 1]``).

- :func:`encode_completion`: a prompt / completion pair, the loss on the completion and the
  EOS after it, as TRL's ``SFTTrainer`` does (``completion_only_loss``).
- :func:`encode_chat`: a conversation, the loss on the assistant turns and the token(s)
  ending each, as transformers' ``return_assistant_tokens_mask`` defines it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np
from jaxtyping import Int

from edl.text.hf import HFTokenizer
from edl.text.tokenizer import Tokenizer

__all__ = ["IGNORE_INDEX", "Example", "encode_chat", "encode_completion"]

IGNORE_INDEX = -100
"""Label value that the loss skips (PyTorch's and Hugging Face's ``ignore_index``)."""

# transformers' own test for a template that marks assistant text for
# `return_assistant_tokens_mask`.
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Example(TypedDict):
    """One tokenized training example: ``int32`` arrays of shape ``(seq,)``."""

    input_ids: Int[np.ndarray, " seq"]
    labels: Int[np.ndarray, " seq"]


def _example(input_ids: Sequence[int], loss: Sequence[bool] | np.ndarray) -> Example:
    ids = np.asarray(input_ids, dtype=np.int32).reshape(-1)
    labels = np.where(np.asarray(loss, dtype=bool), ids, np.int32(IGNORE_INDEX)).astype(np.int32)
    return Example(input_ids=ids, labels=labels)


def encode_completion(
    tokenizer: Tokenizer, prompt: str, completion: str, *, add_bos: bool | None = None
) -> Example:
    """``prompt + completion + EOS`` as one token sequence, labelled only after the prompt.

    TRL's ``SFTTrainer`` rule for prompt / completion data (``completion_only_loss``): the
    EOS token is appended to the completion unless it already ends with one, ``prompt +
    completion`` is tokenized as one text (so ids across the boundary are the whole text's),
    and the first ``len(encode(prompt))`` tokens get :data:`IGNORE_INDEX`; the completion
    and its EOS are counted. When the prompt's ids are not a prefix of the whole's (a token
    spans the boundary, e.g. a prompt ending in a space), TRL warns and keeps that count;
    so does this (``UserWarning``).

    ``add_bos=None`` starts with BOS exactly when transformers' default encoding would
    (``tokenizer.adds_bos``, as TRL's ``tokenizer(text)`` does); True / False force it.
    ``tokenizer`` needs an ``eos_id`` (``ValueError`` if it is None).
    """
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise ValueError(f"encode_completion: {tokenizer!r} has no eos_id to end the completion")
    if add_bos is None:
        add_bos = bool(getattr(tokenizer, "adds_bos", False))
    prompt_ids = tokenizer.encode(prompt, add_bos=add_bos)
    ids = tokenizer.encode(prompt + completion, add_bos=add_bos)
    if not ids or ids[-1] != eos:
        ids.append(eos)
    if ids[: len(prompt_ids)] != prompt_ids:
        at = next(i for i, (a, b) in enumerate(zip(prompt_ids, ids, strict=False)) if a != b)
        warnings.warn(
            f"encode_completion: the prompt's tokens are not a prefix of prompt + completion's "
            f"(they differ at token {at} of {len(prompt_ids)}: a token spans the boundary); "
            f"the first {len(prompt_ids)} tokens are masked, as TRL does",
            stacklevel=2,
        )
    loss = np.arange(len(ids)) >= len(prompt_ids)
    return _example(ids, loss)


def encode_chat(
    tokenizer: HFTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Example:
    """A conversation through the tokenizer's chat template, labelled on assistant turns only.

    ``input_ids`` are exactly ``tokenizer.apply_chat_template(messages, tools=tools)``.
    Labels, per template:

    - with ``{% generation %}`` blocks: transformers'
      ``apply_chat_template(..., return_assistant_tokens_mask=True)`` mask, as is (every
      token that overlaps a generation block's text);
    - without: each assistant message ``i``'s text is found by rendering prefixes of the
      conversation (as TRL does for prompt / completion chats): it starts where
      ``messages[:i]`` with the generation prompt ends and runs to where ``messages[:i+1]``
      ends, cut after its last special token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), so
      the labelled tokens decode to the message's text plus its end-of-turn token(s), not the
      newline a template writes between turns. A turn with no special token keeps all of its
      text. Tokens that straddle a boundary are labelled, as in transformers' mask.

    Raises ``ValueError`` naming the message: when the conversation has no assistant
    message; when a rendered prefix is not a prefix of the whole conversation's text (the
    template rewrites earlier turns, e.g. drops past reasoning, or its generation prompt
    differs from how it writes an assistant turn); when an assistant message is the first
    (its header is unknown) or renders to no token; or when a ``{% generation %}`` template
    marks no token.
    """
    messages = list(messages)
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistant:
        roles = [m.get("role") for m in messages]
        raise ValueError(f"encode_chat: no assistant message to learn from (roles {roles})")
    options = {"tools": tools, "template_kwargs": template_kwargs}
    template = tokenizer.chat_template
    if template is not None and _GENERATION_BLOCK.search(template):
        out = tokenizer.hf.apply_chat_template(
            messages,
            tools=None if tools is None else list(tools),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **dict(template_kwargs or {}),
        )
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if not mask.any():
            raise ValueError(
                f"encode_chat: {tokenizer.source}'s chat template has {{% generation %}} blocks "
                f"but marks no token of assistant messages {assistant}"
            )
        return _example(out["input_ids"], mask)

    text = tokenizer.render_chat(messages, **options)
    encoding = tokenizer.hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    special = np.isin(np.asarray(ids, dtype=np.int64), list(tokenizer.special_ids))
    loss = np.zeros(len(ids), dtype=bool)
    for i in assistant:
        start, end = _assistant_span(tokenizer, messages, i, text, options)
        turn = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
        if turn.size and special[turn].any():
            turn = turn[: np.flatnonzero(special[turn])[-1] + 1]  # through its last special
        if not turn.size:
            raise ValueError(f"encode_chat: assistant message {i} renders to no token")
        loss[turn] = True
    return _example(ids, loss)


def _assistant_span(
    tokenizer: HFTokenizer,
    messages: list[Mapping[str, Any]],
    index: int,
    text: str,
    options: dict[str, Any],
) -> tuple[int, int]:
    """Character span ``[start, end)`` of assistant message ``index`` in ``text``, the whole
    conversation's rendering, from the renderings of the messages before and through it."""
    if index == 0:
        raise ValueError(
            "encode_chat: message 0 is an assistant message; with no message before it, "
            "where its header ends is unknown (the template has no {% generation %} blocks)"
        )
    before = tokenizer.render_chat(messages[:index], add_generation_prompt=True, **options)
    through = tokenizer.render_chat(messages[: index + 1], **options)
    for what, prefix in (
        (f"messages[:{index}] with the generation prompt", before),
        (f"messages[:{index + 1}]", through),
    ):
        if not text.startswith(prefix):
            at = next(
                (k for k, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b),
                min(len(prefix), len(text)),
            )
            raise ValueError(
                f"encode_chat: the chat template renders {what} as text that is not a prefix of "
                f"the whole conversation's (they differ at character {at}: "
                f"{prefix[at : at + 40]!r} vs {text[at : at + 40]!r}), so assistant message "
                f"{index} cannot be located; the template rewrites earlier turns or writes its "
                "generation prompt unlike an assistant turn"
            )
    return len(before), len(through)
