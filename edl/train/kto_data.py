"""Unpaired preference data for KTO: ``{"prompt", "completion", "label"}`` records (TRL's
unpaired preference format: ``label`` true for a desirable completion), tokenized as TRL
does and batched with the mismatched pairs of KTO's KL estimate. Pure numpy, resumable.

A batch (what ``edl.train.kto.make_kto_step`` takes) holds ``int32 (rows, max_length)``
``input_ids`` / ``labels`` / ``attention_mask`` (prompt + completion, labels ``-100`` on the
prompt and padding, unshifted), the same three ``kl_*`` for the mismatched rows (row ``i``:
prompt ``i`` with completion ``i - 1``, cyclically within the batch, as TRL's collator
cycles completions by one), and ``label`` ``bool (rows,)``.
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

__all__ = ["KTOBatches", "check_unpaired", "encode_unpaired"]

_FIELDS = ("prompt_ids", "completion_ids", "label")


def check_unpaired(record: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """``record`` checked as an unpaired preference record: ``prompt`` and ``completion``
    both strings or both lists of messages (as ``edl.text``'s preference records, checked
    by its ``validate``), ``label`` a bool; ``ValueError`` naming ``where`` and the field.
    Returns it as ``validate`` does (``developer`` messages given as ``system``)."""
    missing = [k for k in ("prompt", "completion", "label") if k not in record]
    if missing:
        raise ValueError(
            f"{where}: an unpaired preference record needs field(s) {missing}; the record "
            f"has {sorted(record)}"
        )
    if not isinstance(record["label"], bool):
        raise ValueError(
            f"{where}: 'label' must be true (desirable) or false, got {record['label']!r}"
        )
    pair = {"prompt": record["prompt"], "chosen": record["completion"]}
    checked = validate({**pair, "rejected": record["completion"]}, "preference", where)
    return {**record, "prompt": checked["prompt"], "completion": checked["chosen"]}


def encode_unpaired(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = "record"
) -> dict[str, Any]:
    """One ``{"prompt", "completion", "label"}`` record as ``{"prompt_ids", "completion_ids",
    "label"}``: the prompt and completion ids exactly as ``edl.text.encode_preference``
    makes a preference pair's (TRL's rules: strings, or chat messages through the
    template; the completion ends with EOS), ``label`` a bool. Errors name ``where``."""
    record = check_unpaired(record, where)
    pair = {"prompt": record["prompt"], "chosen": record["completion"]}
    encoded = encode_preference(tokenizer, {**pair, "rejected": record["completion"]})
    return {
        "prompt_ids": encoded["prompt_ids"],
        "completion_ids": encoded["chosen_ids"],
        "label": record["label"],
    }


class KTOBatches(EpochCursor):
    """Deterministic, resumable batches of unpaired examples (the module docstring).

    ``documents``: a ``Sequence`` of :func:`encode_unpaired` outputs. Rows are cut to
    ``max_length`` as ``PreferenceBatches`` cuts them (``truncation``, TRL's
    ``keep_start`` by default); an example whose prompt fills ``max_length`` keeps no
    completion token and is skipped (counted in ``dropped``). Order, process split,
    ``repeat`` and ``position`` / ``restore`` are :class:`~edl.train.data.EpochCursor`'s;
    the KL rows cycle within each process's rows. ``repeat=False`` pads the last batch
    with all-padding rows (labels ``-100``: no completion token, a zero log-prob).
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
            "KTOBatches",
            batch_size=batch_size,
            max_length=max_length,
            pad_id=pad_id,
            truncation=truncation,
        )
        if batch_size // process_count < 2:
            raise ValueError(
                f"KTOBatches: need at least 2 rows per process for the KL pairs (TRL refuses "
                f"batch size 1), got batch_size {batch_size} over {process_count} processes"
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

    def _example(self, doc_id: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
        doc, what = self.documents[doc_id], f"documents[{doc_id}]"
        if not isinstance(doc, Mapping) or any(f not in doc for f in _FIELDS):
            keys = sorted(doc) if isinstance(doc, Mapping) else type(doc).__name__
            raise ValueError(f"{what} must be a dict with {list(_FIELDS)}, got {keys}")
        prompt = as_tokens(doc["prompt_ids"], f"{what}['prompt_ids']")
        completion = as_tokens(doc["completion_ids"], f"{what}['completion_ids']")
        _, labels = preference_rows(prompt, completion, self.max_length, self.truncation)
        if not (labels != IGNORE_INDEX).any():
            self.dropped += 1
            return None
        return prompt, completion, bool(doc["label"])

    def current(self) -> tuple[np.ndarray, np.ndarray, bool] | None:  # type: ignore[override]
        """The example at the cursor (skipping dropped ones); None when done."""
        return self.first_kept(
            self._example,
            f"KTOBatches: none of the {len(self.documents)} examples keeps a completion "
            f"token within max_length {self.max_length}",
        )

    def next_batch(self) -> Batch | None:
        """This process's share of the next global batch; None at the end (``repeat=False``)."""
        examples, mine = self.global_batch()
        if not examples:
            return None
        rows = self.batch_size // self.process_count
        prompts = [p for p, _, _ in mine]
        completions = [c for _, c, _ in mine]
        shifted = completions[-1:] + completions[:-1]  # row i: completion i - 1
        label = np.zeros((rows,), bool)
        label[: len(mine)] = [d for _, _, d in mine]
        return {
            **self._side("", prompts, completions, rows),
            **self._side("kl_", prompts, shifted, rows),
            "label": label,
        }

    def _side(self, prefix: str, prompts: list, completions: list, rows: int) -> Batch:
        ids = np.full((rows, self.max_length), self.pad_id, np.int32)
        labels = np.full((rows, self.max_length), IGNORE_INDEX, np.int32)
        mask = np.zeros((rows, self.max_length), np.int32)
        for r, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            row_ids, row_labels = preference_rows(
                prompt, completion, self.max_length, self.truncation
            )
            ids[r, : len(row_ids)], labels[r, : len(row_ids)] = row_ids, row_labels
            mask[r, : len(row_ids)] = 1
        return {
            f"{prefix}input_ids": ids,
            f"{prefix}labels": labels,
            f"{prefix}attention_mask": mask,
        }

    def config_fields(self) -> dict[str, Any]:
        return {**super().config_fields(), "max_length": self.max_length}
