"""Collators and batch iterators for causal-LM training: pure numpy, deterministic.

Every batch is a dict of ``int32`` arrays of shape ``(rows, max_length)``:

- ``input_ids``: token ids, ``pad_id`` at padding;
- ``attention_mask``: 1 at real tokens, 0 at padding;
- ``labels``: a document's own labels (SFT examples: ``-100`` outside the completion or
  assistant turns), else its ``input_ids``; ``-100`` at padding. Labels are *not* shifted: the model
  predicts ``labels[:, t + 1]`` from position ``t`` (Hugging Face convention), and edl's
  ``compute_loss`` also skips the first token of each packed segment;
- ``position_ids``: 0, 1, ... over each row's real tokens (per segment when packed), 0 at pads;
- ``segment_ids`` (packed batches): 1, 2, ... per document within a row, 0 at padding.

How documents are cut into rows (pretraining text as one stream, SFT examples whole) is
``edl.train.packing``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

from edl.text import IGNORE_INDEX, ByteTokenizer, Tokenizer
from edl.train.packing import Cursor, Doc, Truncation, as_tokens, assemble, document, next_rows

__all__ = [
    "EpochCursor",
    "Resumable",
    "TokenBatches",
    "batches_from_iterable",
    "pack_sequences",
    "pad_batch",
]

TokenSeq = Sequence[int] | np.ndarray
Document = TokenSeq | str | Mapping[str, Any]
Batch = dict[str, np.ndarray]

_INT32_MAX = int(np.iinfo(np.int32).max)


@runtime_checkable
class Resumable(Protocol):
    """Batches a run resumes exactly: checkpoints store ``position`` (a JSON object, the
    same on every process) and a resumed run hands it to ``restore`` before the first
    batch. Every :class:`EpochCursor` (``TokenBatches``, ``PreferenceBatches``,
    ``PromptBatches``) is one; other iterators restart from their beginning."""

    @property
    def position(self) -> dict[str, Any]: ...

    def restore(self, position: Mapping[str, Any]) -> None: ...


def _check(where: str, **values: Any) -> None:
    """Validate the shared arguments by name (only those passed)."""
    for name in ("max_length", "batch_size"):
        if name in values and values[name] < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {values[name]}")
    if "pad_id" in values and not 0 <= values["pad_id"] <= _INT32_MAX:
        raise ValueError(f"{where}: pad_id must be in [0, 2**31), got {values['pad_id']}")
    if "truncation" in values and values["truncation"] not in ("keep_end", "keep_start"):
        raise ValueError(
            f"{where}: truncation must be 'keep_end' or 'keep_start', got {values['truncation']!r}"
        )
    if "padding_side" in values and values["padding_side"] not in ("right", "left"):
        raise ValueError(
            f"{where}: padding_side must be 'right' or 'left', got {values['padding_side']!r}"
        )


def pad_batch(
    sequences: Sequence[TokenSeq] | np.ndarray,
    max_length: int,
    *,
    pad_id: int,
    truncation: Truncation = "keep_end",
    padding_side: Literal["right", "left"] = "right",
) -> Batch:
    """One row per sequence, truncated and padded to ``max_length``.

    ``truncation="keep_end"`` keeps each sequence's last ``max_length`` tokens, ``"keep_start"``
    its first. Returns ``input_ids``, ``attention_mask``, ``labels`` (``-100`` at padding) and
    ``position_ids`` (0.. from the first real token, 0 at padding), each ``int32 (B, max_length)``
    with ``B = len(sequences)``. An empty sequence gives an all-padding row.
    """
    _check(
        "pad_batch",
        max_length=max_length,
        pad_id=pad_id,
        truncation=truncation,
        padding_side=padding_side,
    )
    if len(sequences) == 0:
        raise ValueError("pad_batch: sequences is an empty batch (need at least one sequence)")
    shape = (len(sequences), max_length)
    input_ids = np.full(shape, pad_id, np.int32)
    attention_mask = np.zeros(shape, np.int32)
    position_ids = np.zeros(shape, np.int32)
    for row, seq in enumerate(sequences):
        tokens = as_tokens(seq, f"pad_batch: sequences[{row}]")
        tokens = tokens[-max_length:] if truncation == "keep_end" else tokens[:max_length]
        start = 0 if padding_side == "right" else max_length - len(tokens)
        real = slice(start, start + len(tokens))
        input_ids[row, real] = tokens
        attention_mask[row, real] = 1
        position_ids[row, real] = np.arange(len(tokens), dtype=np.int32)
    labels = np.where(attention_mask == 1, input_ids, np.int32(IGNORE_INDEX)).astype(np.int32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "position_ids": position_ids,
    }


def pack_sequences(
    sequences: Sequence[TokenSeq] | np.ndarray, max_length: int, *, pad_id: int
) -> Batch:
    """Pack sequences into rows of ``max_length`` tokens, greedy first-fit in input order.

    Each sequence goes into the first row with room for it (else a new row). A sequence
    longer than ``max_length`` is split into ``max_length``-token chunks, each its own
    segment, placed the same way; empty sequences are skipped. Returns ``input_ids``,
    ``segment_ids`` (1, 2, ... per sequence within a row, 0 at padding), ``position_ids``
    (restarting at 0 for each segment), ``labels`` (``-100`` at padding) and
    ``attention_mask`` (``segment_ids > 0``), each ``int32 (R, max_length)``; ``R`` is the
    number of rows used (0 when every sequence is empty).
    """
    _check("pack_sequences", max_length=max_length, pad_id=pad_id)
    rows: list[list[Doc]] = []
    room: list[int] = []
    for i, seq in enumerate(sequences):
        tokens = as_tokens(seq, f"pack_sequences: sequences[{i}]")
        for start in range(0, len(tokens), max_length):
            chunk = tokens[start : start + max_length]
            r = next((r for r, free in enumerate(room) if free >= len(chunk)), len(rows))
            if r == len(rows):
                rows.append([])
                room.append(max_length)
            rows[r].append(Doc(chunk, None, i))
            room[r] -= len(chunk)
    return assemble(rows, max_length, pad_id)


def _check_split(where: str, batch_size: int, process_index: int, process_count: int) -> None:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"{where}: process_index must be in [0, process_count) with process_count >= 1, "
            f"got process_index={process_index}, process_count={process_count}"
        )
    if batch_size % process_count:
        raise ValueError(
            f"{where}: batch_size {batch_size} (the global batch) must be divisible by "
            f"process_count {process_count}"
        )


def _batch(cursor: Cursor, it: TokenBatches | _Options) -> Batch | None:
    """The next batch of ``cursor``'s stream: this process's share of the global rows."""
    rows = next_rows(cursor, it.batch_size, it.max_length, it.pack, it.truncation)
    if rows is None:
        return None
    share = it.batch_size // it.process_count
    mine = rows[it.process_index * share : (it.process_index + 1) * share]
    return assemble(mine, it.max_length, it.pad_id)


class EpochCursor(Cursor):
    """A resumable cursor over ``documents`` in a seeded order per epoch, split over
    processes: what :class:`TokenBatches` and ``edl.train.PreferenceBatches`` share.

    Epoch ``e`` visits the documents in the order
    ``np.random.default_rng((seed, e)).permutation(n)`` (input order if not ``shuffle``);
    ``epoch``, ``index`` (of the next document in that order) and ``offset`` (tokens of
    it already emitted) are the cursor. :attr:`position` is the cursor plus the fields of
    ``config_fields()`` (JSON-serialisable); :meth:`restore` takes it back, so
    ``edl.train.train`` checkpoints and resumes any subclass exactly. Subclasses define
    ``current()`` and ``next_batch()`` (the next batch, or None at the end).
    """

    def __init__(
        self,
        documents: Sequence[Any],
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        repeat: bool,
        process_index: int,
        process_count: int,
    ) -> None:
        where = type(self).__name__
        _check_split(where, batch_size, process_index, process_count)
        if len(documents) == 0:
            raise ValueError(f"{where}: documents is empty")
        if seed < 0:
            raise ValueError(f"{where}: seed must be >= 0, got {seed}")
        self.documents, self.batch_size = documents, batch_size
        self.shuffle, self.seed, self.repeat = shuffle, seed, repeat
        self.process_index, self.process_count = process_index, process_count
        self.epoch, self.index, self.offset = 0, 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def _doc_id(self, epoch: int, index: int) -> int:
        if not self.shuffle:
            return index
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            self._order = (epoch, rng.permutation(len(self.documents)))
        return int(self._order[1][index])

    def first_kept(self, build: Callable[[int], Any], none_kept: str) -> Any:
        """``build(doc_id)`` of the document at the cursor, advancing past documents it
        gives None for (dropped); None when ``repeat=False`` and epoch 0 is done.
        ``ValueError(none_kept)`` when a whole epoch keeps nothing."""
        for _ in range(len(self.documents) + 1):
            if not self.repeat and self.epoch >= 1:
                return None
            item = build(self._doc_id(self.epoch, self.index))
            if item is not None:
                return item
            self.advance()
        raise ValueError(none_kept)

    def advance(self) -> None:
        """Move the cursor to the start of the next document (rolling over to a new epoch)."""
        self.index, self.offset = self.index + 1, 0
        if self.index == len(self.documents):
            self.epoch, self.index = self.epoch + 1, 0

    def next_batch(self) -> Any:
        """The next batch (a subclass's kind: arrays, rows, prompts), or None at the end."""
        raise NotImplementedError

    def global_batch(self) -> tuple[list[Any], list[Any]]:
        """``(items, mine)``: the next global batch's items (``current()`` then ``advance()``,
        ``batch_size`` of them, fewer at the end) and this process's contiguous share."""
        items = []
        for _ in range(self.batch_size):
            item = self.current()
            if item is None:
                break
            items.append(item)
            self.advance()
        share = self.batch_size // self.process_count
        return items, items[self.process_index * share : (self.process_index + 1) * share]

    def __iter__(self) -> EpochCursor:
        return self

    def __next__(self) -> Any:
        saved = (self.epoch, self.index, self.offset)
        try:
            batch = self.next_batch()
        except BaseException:
            self.epoch, self.index, self.offset = saved  # a failed batch consumes nothing
            raise
        if batch is None:
            raise StopIteration
        return batch

    def config_fields(self) -> dict[str, Any]:
        """The settings a saved position is only valid for (checked by :meth:`restore`)."""
        return {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "num_documents": len(self.documents),
        }

    @property
    def position(self) -> dict[str, Any]:
        """The cursor and the config it depends on, as a JSON-serialisable dict."""
        cursor = {"epoch": self.epoch, "index": self.index, "offset": self.offset}
        return {**cursor, **self.config_fields()}

    def restore(self, position: Mapping[str, Any]) -> None:
        """Continue from ``position`` (from :attr:`position`, possibly via JSON).

        Raises ``ValueError`` naming the field when a config field differs from this
        iterator's or a cursor field is missing or out of range.
        """
        where = f"{type(self).__name__}.restore"
        config = self.config_fields()
        for field in (*config, "epoch", "index", "offset"):
            if field not in position:
                raise ValueError(f"{where}: position has no {field!r} field")
        for field, value in config.items():
            if position[field] != value:
                raise ValueError(
                    f"{where}: position field {field!r} is {position[field]!r} "
                    f"but this iterator has {value!r}"
                )
        limits = {"epoch": None, "index": len(self.documents) - 1, "offset": None}
        for field, high in limits.items():
            value = position[field]
            if not isinstance(value, int) or value < 0 or (high is not None and value > high):
                raise ValueError(
                    f"{where}: position field {field!r} must be an int in "
                    f"[0, {'inf' if high is None else high}], got {value!r}"
                )
        self.epoch, self.index, self.offset = (position[f] for f in ("epoch", "index", "offset"))


class TokenBatches(EpochCursor):
    """Deterministic, resumable iterator of ``(batch_size, max_length)`` training batches.

    ``documents`` are token-id sequences, strings (encoded with ``tokenizer``, default
    :class:`ByteTokenizer`, with ``add_bos`` / ``add_eos``), dicts with ``"text"``, or dicts
    with ``"input_ids"`` and optionally ``"labels"`` (an SFT :class:`edl.text.sft.Example`, or
    a record of :func:`edl.text.load_tokenized`); any ``Sequence`` works, e.g. a
    :class:`edl.text.TokenizedDataset` (read one document at a time). They are tokenized
    lazily. Token documents are used as given (no BOS/EOS). Documents with no tokens (after
    BOS/EOS) are skipped. ``pad_id`` defaults to the tokenizer's.

    Epoch ``e`` visits the documents in the order
    ``np.random.default_rng((seed, e)).permutation(n)`` (input order if not ``shuffle``).
    With ``pack`` the epochs form one stream cut into rows of ``max_length`` tokens: a
    document without labels that does not fit continues in the next row as a new segment
    (its positions restart at 0); a document with labels is never split (the row is padded
    and it starts the next one; one longer than ``max_length`` is truncated by
    ``truncation``, counted in ``truncated``, with a warning the first time). Without
    ``pack`` each row is one document, truncated the same way. Every batch holds
    ``input_ids``, ``attention_mask``, ``labels`` (the document's labels, or its ids;
    ``-100`` at padding), ``position_ids`` and ``segment_ids`` (``attention_mask`` when not
    packed), each ``int32 (batch_size // process_count, max_length)``.

    ``process_index`` / ``process_count`` split each global batch of ``batch_size`` rows:
    every process reads the same global stream (so every process tokenizes every document:
    cheap from a :class:`edl.text.TokenizedDataset`) and yields its contiguous block of
    ``batch_size // process_count`` rows; ``position`` is identical on every process.

    ``repeat=False`` stops after epoch 0: the last batch is padded to full shape (padding
    rows: all ``pad_id``, mask 0, labels ``-100``), so no token is dropped; then
    ``StopIteration``.

    ``position`` is a JSON-serialisable dict (``epoch``, ``index`` of the next document in
    that epoch's order, ``offset`` = tokens of that document already emitted, plus config
    fields); after ``restore(position)``, ``next()`` yields exactly the batch that followed
    when it was saved.
    """

    def __init__(
        self,
        documents: Sequence[Document],
        *,
        batch_size: int,
        max_length: int,
        tokenizer: Tokenizer | None = None,
        pack: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        pad_id: int | None = None,
        truncation: Truncation = "keep_end",
        add_bos: bool = False,
        add_eos: bool = True,
        repeat: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        self.tokenizer: Tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.pad_id = int(self.tokenizer.pad_id if pad_id is None else pad_id)
        _check(
            "TokenBatches",
            batch_size=batch_size,
            max_length=max_length,
            pad_id=self.pad_id,
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
        self.max_length, self.pack, self.truncation = max_length, pack, truncation
        self.add_bos, self.add_eos = add_bos, add_eos
        self._doc: Doc | None = None

    def current(self) -> Doc | None:
        """The document at the cursor (skipping empty ones); ``None`` when done."""
        for _ in range(len(self.documents) + 1):
            if not self.repeat and self.epoch >= 1:
                return None
            doc_id = self._doc_id(self.epoch, self.index)
            if self._doc is None or self._doc.index != doc_id:
                doc = self.documents[doc_id]
                self._doc = document(doc, doc_id, self.tokenizer, self.add_bos, self.add_eos)
            if len(self._doc.ids) > self.offset:
                return self._doc
            self.advance()
        raise ValueError(f"TokenBatches: all {len(self.documents)} documents are empty")

    def next_batch(self) -> Batch | None:
        """The next batch, or None when ``repeat=False`` and epoch 0 is done."""
        return _batch(self, self)

    def config_fields(self) -> dict[str, Any]:
        config = super().config_fields()
        return {**config, "max_length": self.max_length, "pack": self.pack}


class _IterableCursor(Cursor):
    def __init__(self, iterable: Iterable[Any], read: Callable[[Any, int], Doc]):
        self._iterator, self._read = iter(iterable), read
        self._doc: Doc | None = None
        self._count = 0

    def current(self) -> Doc | None:
        while self._doc is None or len(self._doc.ids) <= self.offset:
            doc = next(self._iterator, _DONE)
            if doc is _DONE:
                return None
            self._doc, self.offset = self._read(doc, self._count), 0
            self._count += 1
        return self._doc

    def advance(self) -> None:
        self._doc, self.offset = None, 0


_DONE = object()


class _Options(NamedTuple):
    batch_size: int
    max_length: int
    pack: bool
    truncation: Truncation
    pad_id: int
    process_index: int
    process_count: int


def batches_from_iterable(
    iterable: Iterable[Document],
    *,
    batch_size: int,
    max_length: int,
    tokenizer: Tokenizer | None = None,
    pack: bool = True,
    pad_id: int | None = None,
    truncation: Truncation = "keep_end",
    add_bos: bool = False,
    add_eos: bool = True,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
    """Batches from one pass over any iterable (e.g. a stream), in its order.

    Same documents (labels kept), rows, process split and batch dicts as
    :class:`TokenBatches` (no shuffling, one pass, last batch padded to full shape), but
    *not resumable*: the position of an arbitrary iterator cannot be saved. Arguments are
    checked here, not at the first ``next``.
    """
    tok: Tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    pad = int(tok.pad_id if pad_id is None else pad_id)
    _check(
        "batches_from_iterable",
        batch_size=batch_size,
        max_length=max_length,
        pad_id=pad,
        truncation=truncation,
    )
    _check_split("batches_from_iterable", batch_size, process_index, process_count)
    options = _Options(batch_size, max_length, pack, truncation, pad, process_index, process_count)

    def read(doc: Any, index: int) -> Doc:
        return document(doc, index, tok, add_bos, add_eos)

    def generate() -> Iterator[Batch]:
        cursor = _IterableCursor(iterable, read)
        while (batch := _batch(cursor, options)) is not None:
            yield batch

    return generate()
