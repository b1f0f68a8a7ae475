"""How documents become rows: the building blocks of ``edl.train.data``'s iterators.

A document is read into a :class:`Doc` (token ids, and labels when it carries its own), a
:class:`Cursor` walks a stream of them, :func:`next_rows` cuts the next batch's rows from
the stream (packed or one document per row) and :func:`assemble` writes rows into arrays.

Packing rules (``pack=True``):

- a document *without* labels (pretraining text) is part of one continuous token stream:
  it fills the rest of a row and continues in the next one as a new segment;
- a document *with* labels (an SFT example) is never split across rows: when it does not
  fit in the room left, the row is padded and the example starts the next row. An example
  longer than ``max_length`` gets a row of its own, truncated by ``truncation``
  (``"keep_end"``: its last ``max_length`` tokens, ``"keep_start"``: its first); the
  cursor counts it in ``truncated`` and warns the first time.

Without packing every document is one row, truncated the same way (and counted).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from edl.text import IGNORE_INDEX, Tokenizer

_INT32_MAX = int(np.iinfo(np.int32).max)

Truncation = Literal["keep_end", "keep_start"]


class Doc(NamedTuple):
    """One document's ``int32 (n,)`` token ids, and its labels (``None``: the ids are the
    labels, a pretraining document); ``index`` names it in errors and warnings."""

    ids: np.ndarray
    labels: np.ndarray | None
    index: int


def as_tokens(seq: Any, what: str) -> np.ndarray:
    """``seq`` as a 1-D ``int32`` array of token ids; errors name ``what``."""
    array = np.asarray(seq)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, np.int32)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer token ids, got dtype {array.dtype}")
    if array.min() < 0 or array.max() > _INT32_MAX:
        bad = array.min() if array.min() < 0 else array.max()
        raise ValueError(f"{what} holds token id {int(bad)}, outside [0, 2**31)")
    return array.astype(np.int32, copy=False)


def _as_labels(seq: Any, what: str) -> np.ndarray:
    """``seq`` as 1-D ``int32`` labels: token ids or ``IGNORE_INDEX``."""
    array = np.asarray(seq)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of labels, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer labels, got dtype {array.dtype}")
    bad = array[((array < 0) & (array != IGNORE_INDEX)) | (array > _INT32_MAX)]
    if bad.size:
        raise ValueError(f"{what} holds label {int(bad[0])}: not a token id nor {IGNORE_INDEX}")
    return array.astype(np.int32)


def document(doc: Any, index: int, tokenizer: Tokenizer, add_bos: bool, add_eos: bool) -> Doc:
    """Read document ``index``: text is encoded (with BOS/EOS as asked), token lists and
    ``{"input_ids"[, "labels"]}`` dicts are taken as they are."""
    what = f"documents[{index}]"
    if isinstance(doc, Mapping):
        if "input_ids" in doc:
            ids = as_tokens(doc["input_ids"], f"{what}['input_ids']")
            if "labels" not in doc:
                return Doc(ids, None, index)
            labels = _as_labels(doc["labels"], f"{what}['labels']")
            if labels.shape != ids.shape:
                raise ValueError(
                    f"{what}: 'labels' has {labels.size} entries but 'input_ids' has {ids.size}"
                )
            return Doc(ids, labels, index)
        if "labels" in doc:
            raise ValueError(f"{what} has 'labels' but no 'input_ids': {list(doc)}")
        if "text" not in doc:
            raise ValueError(f"{what} is a dict with neither 'input_ids' nor 'text': {list(doc)}")
        doc = doc["text"]
    if isinstance(doc, str):
        return Doc(
            as_tokens(tokenizer.encode(doc, add_bos=add_bos, add_eos=add_eos), what), None, index
        )
    return Doc(as_tokens(doc, what), None, index)


class Cursor:
    """A position in a document stream: ``current()`` and ``offset`` tokens into it.

    ``current`` skips exhausted and empty documents and returns ``None`` at the end of the
    stream; ``advance`` moves to the next document. ``truncated`` counts the documents cut
    to ``max_length`` (see the module docstring).
    """

    offset: int = 0
    truncated: int = 0

    def current(self) -> Doc | None:
        raise NotImplementedError

    def advance(self) -> None:
        raise NotImplementedError

    def cut(self, doc: Doc, max_length: int, truncation: Truncation) -> Doc:
        """``doc`` from the cursor's offset, truncated to ``max_length`` (counted)."""
        ids = doc.ids[self.offset :]
        labels = None if doc.labels is None else doc.labels[self.offset :]
        if len(ids) <= max_length:
            return Doc(ids, labels, doc.index)
        if not self.truncated:
            kept = "last" if truncation == "keep_end" else "first"
            warnings.warn(
                f"documents[{doc.index}] has {len(ids)} tokens, more than max_length "
                f"{max_length}: its {kept} {max_length} are kept (truncation={truncation!r}); "
                "later truncations are counted in .truncated without a warning",
                stacklevel=4,
            )
        self.truncated += 1
        keep = slice(-max_length, None) if truncation == "keep_end" else slice(max_length)
        return Doc(ids[keep], None if labels is None else labels[keep], doc.index)


def _packed_row(cursor: Cursor, max_length: int, truncation: Truncation) -> list[Doc]:
    pieces: list[Doc] = []
    room = max_length
    while room > 0 and (doc := cursor.current()) is not None:
        if doc.labels is not None:  # an example: whole in one row, never split
            if len(doc.ids) - cursor.offset > room and room < max_length:
                break
            pieces.append(cursor.cut(doc, max_length, truncation))
            room -= len(pieces[-1].ids)
            cursor.advance()
            continue
        piece = doc.ids[cursor.offset : cursor.offset + room]
        pieces.append(Doc(piece, None, doc.index))
        room -= len(piece)
        cursor.offset += len(piece)
        if cursor.offset >= len(doc.ids):
            cursor.advance()
    return pieces


def next_rows(
    cursor: Cursor, batch_size: int, max_length: int, pack: bool, truncation: Truncation
) -> list[list[Doc]] | None:
    """The next ``batch_size`` rows of the stream, each a list of segments (padding rows
    are empty); ``None`` when the stream holds no more tokens."""
    rows: list[list[Doc]] = []
    for _ in range(batch_size):
        if pack:
            rows.append(_packed_row(cursor, max_length, truncation))
        elif (doc := cursor.current()) is not None:
            rows.append([cursor.cut(doc, max_length, truncation)])
            cursor.advance()
        else:
            rows.append([])
    return rows if rows[0] else None


def assemble(rows: Sequence[Sequence[Doc]], max_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """The batch arrays of ``rows`` (each a list of segments), ``int32 (len(rows),
    max_length)``: ``input_ids``, ``attention_mask``, ``labels`` (a segment's own labels or
    its ids, ``-100`` at padding), ``position_ids`` (from 0 per segment), ``segment_ids``."""
    shape = (len(rows), max_length)
    input_ids = np.full(shape, pad_id, np.int32)
    labels = np.full(shape, IGNORE_INDEX, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    position_ids = np.zeros(shape, np.int32)
    for r, pieces in enumerate(rows):
        start = 0
        for s, piece in enumerate(pieces):
            span = slice(start, start + len(piece.ids))
            input_ids[r, span] = piece.ids
            labels[r, span] = piece.ids if piece.labels is None else piece.labels
            segment_ids[r, span] = s + 1
            position_ids[r, span] = np.arange(len(piece.ids), dtype=np.int32)
            start += len(piece.ids)
    return {
        "input_ids": input_ids,
        "attention_mask": (segment_ids > 0).astype(np.int32),
        "labels": labels,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
    }
