"""Preference pairs as token ids, the way TRL's ``DPOTrainer`` (trl 1.16) tokenizes them.

:func:`encode_preference` turns one ``{"prompt", "chosen", "rejected"}`` record (all strings
or all conversations, :func:`~edl.text.read_records`'s ``"preference"`` format) into a
:class:`Preference`: ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``, so that
``prompt_ids + chosen_ids`` is the chosen sequence and ``prompt_ids + rejected_ids`` the
rejected one (``edl.train.PreferenceBatches`` batches them; the loss is taken on the
responses only).

TRL's rule (``DPOTrainer._prepare_dataset``), followed step for step:

- strings: EOS is appended to ``chosen`` / ``rejected`` (as text, unless they already end
  with it); ``prompt``, ``prompt + chosen`` and ``prompt + rejected`` are each tokenized as
  one text with the tokenizer's default special tokens (BOS for Llama-like tokenizers:
  ``add_bos``);
- conversations: ``prompt`` through the chat template with the generation prompt, ``prompt
  + chosen`` and ``prompt + rejected`` through it without (so the responses end with the
  template's end-of-turn text, e.g. ``<|im_end|>\\n``);
- the prompt is the longest common prefix of the tokenized prompt with *both* tokenized
  sequences; each response is the rest of its sequence. When that prefix is shorter than
  the tokenized prompt (a token spans the boundary, or the template writes the prompt
  alone differently), the prompt's tail is dropped, with a ``UserWarning`` (TRL logs one).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np
from jaxtyping import Int

from edl.text.hf import HFTokenizer
from edl.text.tokenizer import Tokenizer

__all__ = ["Preference", "encode_preference"]


class Preference(TypedDict):
    """One tokenized preference pair: ``int32`` token ids, each of its own length."""

    prompt_ids: Int[np.ndarray, " prompt"]
    chosen_ids: Int[np.ndarray, " chosen"]
    rejected_ids: Int[np.ndarray, " rejected"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def encode_preference(
    tokenizer: Tokenizer,
    record: Mapping[str, Any],
    *,
    add_bos: bool | None = None,
    add_eos: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Preference:
    """``record``'s prompt, chosen and rejected token ids, as TRL 1.16 makes them (the
    module docstring).

    String records: ``add_bos=None`` starts the prompt with BOS exactly when the tokenizer's
    default encoding does (``tokenizer.adds_bos``, TRL's ``tokenizer(text)``); ``add_eos``
    ends each response with ``eos_id`` unless its text already ends with it (TRL always
    does; ``False`` leaves responses as written). Any :class:`Tokenizer` with an ``eos_id``
    works. Conversation records need an :class:`HFTokenizer` with a chat template;
    ``tools`` / ``template_kwargs`` go to the template (``add_bos`` / ``add_eos`` do not
    apply: the template writes its own special tokens).

    Raises ``ValueError`` for a record that is neither form, a conversation with another
    tokenizer, or a response that tokenizes to nothing after the shared prompt.
    """
    prompt, chosen, rejected = (record[k] for k in ("prompt", "chosen", "rejected"))
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        if add_bos is None:
            add_bos = bool(getattr(tokenizer, "adds_bos", False))
        eos = getattr(tokenizer, "eos_id", None)
        if add_eos and eos is None:
            raise ValueError(f"encode_preference: {tokenizer!r} has no eos_id to end responses")

        def encode(text: str, response: bool) -> list[int]:
            ids = tokenizer.encode(text, add_bos=add_bos)
            if response and add_eos and (not ids or ids[-1] != eos):
                ids.append(eos)  # TRL appends the EOS text: the same id, it is a special token
            return ids

        prompt_ids = encode(prompt, False)
        sequences = [encode(prompt + chosen, True), encode(prompt + rejected, True)]
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        if not isinstance(tokenizer, HFTokenizer):
            raise ValueError(
                "encode_preference: conversation records need an HFTokenizer with a chat "
                f"template, got {tokenizer!r}"
            )
        options = {"tools": tools, "template_kwargs": template_kwargs}
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **options)
        sequences = [
            tokenizer.apply_chat_template(prompt + response, **options)
            for response in (chosen, rejected)
        ]
    else:
        kinds = {k: type(record[k]).__name__ for k in ("prompt", "chosen", "rejected")}
        raise ValueError(
            f"encode_preference: prompt, chosen and rejected must be all strings or all lists "
            f"of messages, got {kinds}"
        )
    shared = min(_common_prefix(prompt_ids, s) for s in sequences)
    if shared < len(prompt_ids):
        warnings.warn(
            f"encode_preference: the prompt's {len(prompt_ids)} tokens are not a prefix of "
            f"prompt + response's (they share {shared}: a token spans the boundary, or the "
            "template writes the prompt alone differently); the responses start where they "
            "diverge and the prompt's last tokens are left out, as TRL does",
            stacklevel=2,
        )
    chosen_ids, rejected_ids = (s[shared:] for s in sequences)
    for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        if not ids:
            raise ValueError(f"encode_preference: the {name} response tokenizes to no token")
    return Preference(
        prompt_ids=np.asarray(prompt_ids[:shared], dtype=np.int32).reshape(-1),
        chosen_ids=np.asarray(chosen_ids, dtype=np.int32).reshape(-1),
        rejected_ids=np.asarray(rejected_ids, dtype=np.int32).reshape(-1),
    )
