"""Distillation data: TRL's GKD records, ``{"messages": [...]}`` (the last message, an
assistant turn, is the completion; the ones before it the prompt) or ``{"prompt",
"completion"}`` (strings, or lists of chat messages), tokenized as TRL does and batched for
``edl.train.distill.make_distill_step``. Pure numpy, resumable.

A batch holds ``int32 (rows, max_length)`` ``input_ids`` / ``labels`` / ``attention_mask``
(prompt + completion right-padded, labels ``-100`` on the prompt and padding, unshifted: the
off-policy data) and ``int32 (rows, max_length)`` ``prompt_ids`` / ``prompt_mask``: the same
rows' prompts left-padded, what on-policy steps sample completions from (``edl.generate``
expects left padding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from edl.text import IGNORE_INDEX, encode_preference
from edl.text.sources import validate
from edl.text.tokenizer import Tokenizer
from edl.train.data import Batch, EpochCursor, _check
from edl.train.packing import as_tokens
from edl.train.preference_data import preference_rows

__all__ = ["DistillBatches", "check_distill_record", "encode_distill"]


def check_distill_record(record: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``record`` as ``{"prompt", "completion"}``: a ``messages`` record split before its last
    message (which must be the assistant's), or a prompt / completion record checked as
    ``edl.text``'s preference records are; ``ValueError`` naming ``where`` and the field."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise ValueError(
                f"{where}: 'messages' must be a list of at least 2 chat messages (a prompt and "
                f"the assistant's completion), got {str(messages)[:80]!r}"
            )
        last = messages[-1]
        if not isinstance(last, Mapping) or last.get("role") != "assistant":
            raise ValueError(
                f"{where}: the last of 'messages' must be the assistant's completion, got "
                f"{str(last)[:80]!r}"
            )
        record = {"prompt": messages[:-1], "completion": [last]}
    missing = [k for k in ("prompt", "completion") if k not in record]
    if missing:
        raise ValueError(
            f"{where}: a distillation record needs 'messages' or 'prompt' and 'completion'; "
            f"missing {missing}, the record has {sorted(record)}"
        )
    pair = {"prompt": record["prompt"], "chosen": record["completion"]}
    checked = validate({**pair, "rejected": record["completion"]}, "preference", where)
    return {"prompt": checked["prompt"], "completion": checked["chosen"]}


def encode_distill(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = "record"
) -> dict[str, Any]:
    """One record (module docstring) as ``{"prompt_ids", "completion_ids"}``, exactly as
    ``edl.text.encode_preference`` tokenizes a preference pair's prompt and chosen side (chat
    messages through the template with the generation prompt; the completion ends with EOS).
    Errors name ``where``."""
    record = check_distill_record(record, where)
    pair = {"prompt": record["prompt"], "chosen": record["completion"]}
    encoded = encode_preference(tokenizer, {**pair, "rejected": record["completion"]})
    return {"prompt_ids": encoded["prompt_ids"], "completion_ids": encoded["chosen_ids"]}


class DistillBatches(EpochCursor):
    """Deterministic, resumable batches of prompt / completion examples (module docstring).

    ``documents``: a ``Sequence`` of :func:`encode_distill` outputs. Rows are cut to
    ``max_length`` as ``PreferenceBatches`` cuts them (``truncation``); an example whose
    prompt fills ``max_length`` keeps no completion token and is skipped (counted in
    ``dropped``). Order, process split, ``repeat`` and ``position`` / ``restore`` are
    :class:`~edl.train.data.EpochCursor`'s. ``repeat=False`` pads the last batch with
    all-padding rows (no counted token).
    """

    def __init__(
        self,
        documents: Sequence[Mapping[str, Any]],
        *,
        batch_size: int,
        max_length: int,
        pad_id: int,
        truncation: Literal["keep_start", "keep_end"] = "keep_start",
        shuffle: bool = True,
        seed: int = 0,
        repeat: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        _check(
            "DistillBatches",
            batch_size=batch_size,
            max_length=max_length,
            pad_id=pad_id,
            truncation=truncation,
        )
        super().__init__(
            documents,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            repeat=repeat,
            process_index=process_index,
            process_count=process_count,
        )
        self.max_length, self.pad_id, self.truncation = max_length, pad_id, truncation
        self.dropped = 0

    def _example(self, doc_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        doc, what = self.documents[doc_id], f"documents[{doc_id}]"
        if not isinstance(doc, Mapping) or "prompt_ids" not in doc or "completion_ids" not in doc:
            keys = sorted(doc) if isinstance(doc, Mapping) else type(doc).__name__
            raise ValueError(
                f"{what} must be a dict with prompt_ids and completion_ids, got {keys}"
            )
        prompt = as_tokens(doc["prompt_ids"], f"{what}['prompt_ids']")
        completion = as_tokens(doc["completion_ids"], f"{what}['completion_ids']")
        ids, labels = preference_rows(prompt, completion, self.max_length, self.truncation)
        if not (labels != IGNORE_INDEX).any():
            self.dropped += 1
            return None
        return ids, labels

    def current(self) -> tuple[np.ndarray, np.ndarray] | None:  # type: ignore[override]
        """The example at the cursor (skipping dropped ones); None when done."""
        return self.first_kept(
            self._example,
            f"DistillBatches: none of the {len(self.documents)} examples keeps a completion "
            f"token within max_length {self.max_length}",
        )

    def next_batch(self) -> Batch | None:
        """This process's share of the next global batch; None at the end (``repeat=False``)."""
        examples, mine = self.global_batch()
        if not examples:
            return None
        rows, width = self.batch_size // self.process_count, self.max_length
        ids = np.full((rows, width), self.pad_id, np.int32)
        labels = np.full((rows, width), IGNORE_INDEX, np.int32)
        mask = np.zeros((rows, width), np.int32)
        prompt_ids = np.full((rows, width), self.pad_id, np.int32)
        prompt_mask = np.zeros((rows, width), np.int32)
        for r, (row_ids, row_labels) in enumerate(mine):
            n = len(row_ids)
            ids[r, :n], labels[r, :n], mask[r, :n] = row_ids, row_labels, 1
            p = int(np.argmax(row_labels != IGNORE_INDEX))  # the prompt's tokens in the row
            if p:
                prompt_ids[r, width - p :], prompt_mask[r, width - p :] = row_ids[:p], 1
        return {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": mask,
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
        }

    def config_fields(self) -> dict[str, Any]:
        return {**super().config_fields(), "max_length": self.max_length}
