"""Batches of preference pairs for DPO and reward-model training: pure numpy, resumable.

Every batch is a dict of ``int32`` arrays of shape ``(rows, max_length)``, one row per pair
for each side:

- ``chosen_input_ids`` / ``rejected_input_ids``: prompt + response token ids, right-padded
  with ``pad_id``;
- ``chosen_attention_mask`` / ``rejected_attention_mask``: 1 at real tokens, 0 at padding;
- ``chosen_labels`` / ``rejected_labels``: the input ids on the response, ``-100``
  (:data:`~edl.text.IGNORE_INDEX`) on the prompt and on padding. Not shifted (Hugging
  Face's convention: position ``t`` predicts ``labels[:, t + 1]``; the loss shifts).

Row ``i`` of the chosen arrays and row ``i`` of the rejected arrays are the same pair.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from jaxtyping import Int

from edl.text import IGNORE_INDEX
from edl.train.data import Batch, EpochCursor, _check
from edl.train.packing import as_tokens

__all__ = ["PREFERENCE_KEYS", "PreferenceBatches"]

PREFERENCE_KEYS = (
    "chosen_input_ids",
    "chosen_labels",
    "chosen_attention_mask",
    "rejected_input_ids",
    "rejected_labels",
    "rejected_attention_mask",
)
"""The keys of every preference batch."""

_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")


def _read_pair(doc: Any, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    what = f"documents[{index}]"
    if not isinstance(doc, Mapping) or any(f not in doc for f in _FIELDS):
        keys = sorted(doc) if isinstance(doc, Mapping) else type(doc).__name__
        raise ValueError(f"{what} must be a dict with {list(_FIELDS)}, got {keys}")
    prompt, chosen, rejected = (as_tokens(doc[f], f"{what}[{f!r}]") for f in _FIELDS)
    return prompt, chosen, rejected


def preference_rows(
    prompt_ids: Int[np.ndarray, " prompt"],
    response_ids: Int[np.ndarray, " response"],
    max_length: int,
    truncation: Literal["keep_start", "keep_end"] = "keep_start",
    max_prompt_length: int | None = None,
) -> tuple[Int[np.ndarray, " n"], Int[np.ndarray, " n"]]:
    """One side of a pair as a row: ``(input_ids, labels)``, ``int32 (n,)``, ``n <=
    max_length``, labels ``-100`` on the prompt.

    ``max_prompt_length`` first keeps the prompt's last ``max_prompt_length`` tokens; then
    ``prompt + response`` longer than ``max_length`` keeps its first ``max_length`` tokens
    (``"keep_start"``, TRL's ``DataCollatorForPreference`` default: the response's end is
    cut) or its last (``"keep_end"``: the prompt's start is cut first).
    """
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[len(prompt_ids) - min(len(prompt_ids), max_prompt_length) :]
    ids = np.concatenate([prompt_ids, response_ids]).astype(np.int32)
    labels = ids.copy()
    labels[: len(prompt_ids)] = IGNORE_INDEX
    keep = slice(None, max_length) if truncation == "keep_start" else slice(-max_length, None)
    return ids[keep], labels[keep]


class PreferenceBatches(EpochCursor):
    """Deterministic, resumable iterator of preference batches (the module docstring),
    each side ``int32 (batch_size // process_count, max_length)``.

    ``documents``: any ``Sequence`` of ``{"prompt_ids", "chosen_ids", "rejected_ids"}``
    (token-id sequences): a :class:`edl.text.TokenizedDataset` of preference records
    (``load_tokenized(..., format="preference")``), or :func:`edl.text.encode_preference`
    outputs. Each pair fills one row of each side: ``prompt + chosen`` and ``prompt +
    rejected``, cut to ``max_length`` by :func:`preference_rows` with ``truncation`` /
    ``max_prompt_length``. A row that is cut counts in ``truncated``. With
    ``"keep_start"`` a pair whose (cut) prompt alone fills ``max_length`` has no response
    token left: it is skipped (TRL drops it), counted in ``dropped``, with a warning the
    first time. ``pad_id`` is the tokenizer's (``tokenizer.pad_id``).

    Order, process split, ``repeat`` and ``position`` / ``restore`` are
    :class:`~edl.train.data.EpochCursor`'s, as for :class:`~edl.train.TokenBatches`: epoch ``e``
    visits the pairs in ``np.random.default_rng((seed, e)).permutation(n)`` order; every
    process reads the same global batch of ``batch_size`` pairs and yields its contiguous
    block of ``batch_size // process_count``; ``offset`` is always 0. ``repeat=False``
    stops after epoch 0, padding the last batch to full shape with all-padding rows (mask
    0, labels ``-100`` on both sides: a loss should give pairs with no label token zero
    weight).
    """

    def __init__(
        self,
        documents: Sequence[Mapping[str, Any]],
        *,
        batch_size: int,
        max_length: int,
        pad_id: int,
        truncation: Literal["keep_start", "keep_end"] = "keep_start",
        max_prompt_length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        repeat: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        _check(
            "PreferenceBatches",
            batch_size=batch_size,
            max_length=max_length,
            pad_id=pad_id,
            truncation=truncation,
        )
        if max_prompt_length is not None and max_prompt_length < 0:
            raise ValueError(
                f"PreferenceBatches: max_prompt_length must be None or >= 0, "
                f"got {max_prompt_length}"
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
        self.max_prompt_length = max_prompt_length
        self.truncated = self.dropped = 0

    def _rows(self, doc_id: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The pair's chosen and rejected rows; None when it is to be skipped."""
        prompt, *responses = _read_pair(self.documents[doc_id], doc_id)
        rows = [
            preference_rows(prompt, r, self.max_length, self.truncation, self.max_prompt_length)
            for r in responses
        ]
        if any(not (labels != IGNORE_INDEX).any() for _, labels in rows):
            self.dropped += 1
            if self.dropped == 1:
                warnings.warn(
                    f"PreferenceBatches: documents[{doc_id}] keeps no response token within "
                    f"max_length {self.max_length} (its prompt has {len(prompt)} tokens): it "
                    "is skipped, as TRL drops it; later ones are counted in .dropped",
                    stacklevel=4,
                )
            return None
        lengths = [len(prompt) + len(r) for r in responses]
        self.truncated += int(any(len(ids) < n for (ids, _), n in zip(rows, lengths, strict=True)))
        return rows

    def current(self) -> list[tuple[np.ndarray, np.ndarray]] | None:  # type: ignore[override]
        """The rows of the pair at the cursor (skipping dropped pairs); None when done."""
        return self.first_kept(
            self._rows,
            f"PreferenceBatches: none of the {len(self.documents)} pairs keeps a response "
            f"token within max_length {self.max_length}",
        )

    def next_batch(self) -> Batch | None:
        """This process's share of the next global batch; None when ``repeat=False`` and
        epoch 0 is done."""
        pairs, mine = self.global_batch()
        if not pairs:
            return None
        return self._assemble(mine, self.batch_size // self.process_count)

    def _assemble(self, pairs: list[list[tuple[np.ndarray, np.ndarray]]], rows: int) -> Batch:
        batch: Batch = {}
        for side, name in enumerate(("chosen", "rejected")):
            ids = np.full((rows, self.max_length), self.pad_id, np.int32)
            labels = np.full((rows, self.max_length), IGNORE_INDEX, np.int32)
            mask = np.zeros((rows, self.max_length), np.int32)
            for r, pair in enumerate(pairs):
                row_ids, row_labels = pair[side]
                ids[r, : len(row_ids)], labels[r, : len(row_ids)] = row_ids, row_labels
                mask[r, : len(row_ids)] = 1
            batch |= {
                f"{name}_input_ids": ids,
                f"{name}_labels": labels,
                f"{name}_attention_mask": mask,
            }
        return batch

    def config_fields(self) -> dict[str, Any]:
        config = super().config_fields()
        return {**config, "max_length": self.max_length}
