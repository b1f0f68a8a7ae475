"""Tokenized datasets, cached on disk: tokenize a corpus once, start every later run at once.

:func:`load_tokenized` reads a :class:`~edl.text.sources.Source`'s records, tokenizes them
by format and returns a :class:`TokenizedDataset`, a random-access ``Sequence`` of
documents that :class:`edl.train.TokenBatches` takes directly (so shuffling, packing,
process split and resumption are ``TokenBatches``'s):

- ``"text"``: ``tokenizer.encode(text, add_bos=..., add_eos=True)``, documents
  ``{"input_ids"}`` (pretraining: packed as one stream, EOS between documents);
- ``"completion"``: :func:`~edl.text.encode_completion`, ``{"input_ids", "labels"}``;
- ``"chat"``: :func:`~edl.text.encode_chat` (an :class:`~edl.text.HFTokenizer` with a
  chat template), ``{"input_ids", "labels"}``;
- ``"preference"``: :func:`~edl.text.encode_preference` (TRL's DPO tokenization),
  ``{"prompt_ids", "chosen_ids", "rejected_ids"}``, the documents that
  ``edl.train.PreferenceBatches`` batches.

The cache (``cache_dir``, default :func:`default_cache_dir`) holds one entry per key, the
SHA-256 of the source's fingerprint (its content), the tokenizer's
(:func:`tokenizer_fingerprint`), the format and the options: ``<key>.safetensors``
(``input_ids`` ``int32 (tokens,)``, ``labels`` ``int32 (tokens,)`` for labelled formats,
``offsets`` ``int64 (documents + 1,)``: document ``i`` is ``[offsets[i], offsets[i+1])``;
for preference records ``input_ids`` holds each pair's prompt, chosen and rejected ids one
after another and ``field_lengths`` ``int64 (documents, 3)`` their lengths) and
``<key>.json`` (what it was made from, its sizes, the tokenizer's ``vocab_size`` and the
SHA-256 of each array's bytes). Each file is written to a temporary name and moved into
place (``os.replace``), the JSON last: an entry without its JSON, or whose arrays disagree
with it, is not read, so a killed write never leaves a readable partial entry.

An entry is checked, not trusted (:mod:`edl.text._entry`): opening one hashes every array
and bounds every token id by the vocabulary, and one that fails (damaged, partial, of an
older version) is rebuilt with a warning naming it and what was wrong. A failed write (a
full disk, a read-only cache) leaves no temporary file or partial entry and warns naming
the entry; the run goes on with the documents in memory. Arrays are read lazily, a
document at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Int

from edl.text._entry import TOKEN_ARRAYS, check_arrays, outside_vocab, write_entry
from edl.text.hf import HFTokenizer
from edl.text.preference import encode_preference
from edl.text.sft import encode_chat, encode_completion
from edl.text.sources import Format, PathLike, Source, data_files, validated_records
from edl.text.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["TokenizedDataset", "load_tokenized", "tokenizer_fingerprint"]

# The entry's layout; 2 added `vocab_size` and `checksums` to the JSON. Entries of another
# version are rebuilt in place: the key has its own version (bumped only when the same inputs
# would tokenize differently), so an older entry sits at the path its rebuild takes.
_VERSION = 2
_KEY_VERSION = 1
# The fields a preference document is cut into (the cache's `field_lengths` columns).
PREFERENCE_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")


def default_cache_dir() -> Path:
    """``$EDL_CACHE/tokenized`` when ``EDL_CACHE`` is set, else
    ``$XDG_CACHE_HOME/edl/tokenized`` (``~/.cache/edl/tokenized``)."""
    if os.environ.get("EDL_CACHE"):
        return Path(os.environ["EDL_CACHE"]).expanduser() / "tokenized"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root).expanduser() / "edl" / "tokenized"


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A hex digest that changes whenever ``tokenizer``'s encodings may.

    :class:`ByteTokenizer`: a constant. :class:`HFTokenizer`: the SHA-256 of its
    ``tokenizers`` JSON (``backend_tokenizer.to_str()``: vocabulary, merges, normalizer,
    added tokens), chat template, special ids and ``adds_bos``. Any other tokenizer must
    have a string ``fingerprint`` attribute (``ValueError`` otherwise).
    """
    if type(tokenizer) is ByteTokenizer:
        return "edl.ByteTokenizer/1"
    if isinstance(tokenizer, HFTokenizer):
        specials = [tokenizer.bos_id, tokenizer.eos_id, tokenizer.hf.pad_token_id]
        parts = [
            tokenizer.hf.backend_tokenizer.to_str(),
            tokenizer.chat_template or "",
            json.dumps([specials, tokenizer.adds_bos]),
        ]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if not isinstance(fingerprint, str):
        raise ValueError(
            f"cannot key the tokenized cache on {tokenizer!r}: give it a string `fingerprint` "
            "attribute that changes with its encodings, or pass cache=False"
        )
    return fingerprint


class TokenizedDataset(Sequence[dict[str, np.ndarray]]):
    """Tokenized documents: ``dataset[i]`` is ``{"input_ids": int32 (n_i,)}``, plus
    ``"labels"`` (``int32 (n_i,)``, ``-100`` where no loss) for labelled formats; for
    preference data ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (``int32``, each of
    its own length).

    Attributes:
        meta: what the dataset was made from (source, tokenizer and its ``vocab_size``,
            format, options) and its sizes (``num_documents``, ``num_tokens``,
            ``has_labels``; ``fields``, the field names, for preference data); a cache
            entry's also has ``checksums``, each array's ``"sha256:<hex>"``.
        path: the cache entry's ``.safetensors`` file, or None when held in memory.
    """

    def __init__(
        self,
        input_ids: Int[np.ndarray, " tokens"] | Any,
        labels: Int[np.ndarray, " tokens"] | Any | None,
        offsets: Int[np.ndarray, " documents_plus_1"],
        meta: Mapping[str, Any],
        path: Path | None = None,
        field_lengths: Int[np.ndarray, "documents fields"] | None = None,
    ) -> None:
        """Documents cut from flat ``input_ids`` / ``labels`` (arrays, or safetensors
        slices read on access) at ``offsets``, each cut further into ``meta["fields"]`` by
        ``field_lengths`` when given; use :func:`load_tokenized` or :meth:`open`."""
        self._ids, self._labels, self.offsets = input_ids, labels, offsets
        self.field_lengths = field_lengths
        self.meta, self.path = dict(meta), path

    @classmethod
    def open(cls, path: PathLike, *, vocab_size: int | None = None) -> TokenizedDataset:
        """The cache entry at ``path`` (``<key>.safetensors`` beside ``<key>.json``), checked.

        Every array's SHA-256 must be the one the JSON records, and every token id
        (``input_ids``, and ``labels`` other than ``-100``) must lie in ``[0, vocab_size)``
        (by default the ``vocab_size`` the entry records, its tokenizer's; unbounded when
        that is null). Raises ``FileNotFoundError`` when either file is missing, and
        ``ValueError`` naming the file and what is wrong when the entry is of another
        version (before 2, without checksums), its arrays or sizes disagree with its JSON (a
        partial or foreign entry), an array's checksum differs (the file changed after it
        was written) or an id is outside the vocabulary.
        """
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        meta_path = path.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except ValueError as e:  # not UTF-8 or not JSON
            raise ValueError(f"{meta_path}: not a JSON entry ({e})") from e
        if not isinstance(meta, dict) or meta.get("version") != _VERSION:
            found = meta.get("version") if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(
                f"{meta_path}: not an edl tokenized-dataset entry of version {_VERSION} "
                f"(version {found!r}; entries before 2 carry no checksums)"
            )
        if vocab_size is None:
            vocab_size = meta.get("vocab_size")
        if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
            raise ValueError(f"{meta_path}: vocab_size must be a positive int, got {vocab_size!r}")
        try:
            handle = safe_open(str(path), framework="np")
            keys = set(handle.keys())
            fields = meta.get("fields")
            want = {"input_ids", "offsets"} | ({"labels"} if meta.get("has_labels") else set())
            want |= {"field_lengths"} if fields else set()
            if keys != want:
                raise ValueError(f"{path}: arrays {sorted(keys)}, expected {sorted(want)}")
            check_arrays(handle, path, meta.get("checksums"), vocab_size)
            offsets = handle.get_tensor("offsets")
            ids = handle.get_slice("input_ids")
            labels = handle.get_slice("labels") if meta.get("has_labels") else None
            field_lengths = handle.get_tensor("field_lengths") if fields else None
        except SafetensorError as e:  # its messages name no file
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
        sizes = {"num_documents": len(offsets) - 1, "num_tokens": ids.get_shape()[0]}
        for field, value in sizes.items():
            if meta.get(field) != value:
                raise ValueError(
                    f"{path}: {field} is {value}, but {meta_path} says {meta.get(field)}"
                )
        end = sizes["num_tokens"]
        if offsets[0] != 0 or offsets[-1] != end or (np.diff(offsets) < 0).any():
            raise ValueError(f"{path}: offsets do not cut [0, {end}) into documents")
        if field_lengths is not None and (
            field_lengths.shape != (sizes["num_documents"], len(fields))
            or (field_lengths < 0).any()
            or (field_lengths.sum(axis=1) != np.diff(offsets)).any()
        ):
            raise ValueError(f"{path}: field_lengths do not cut its documents into {fields}")
        return cls(ids, labels, offsets, meta, path, field_lengths)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int | np.integer) -> dict[str, np.ndarray]:
        """Document ``index`` (negative counts from the end); ``IndexError`` outside."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"TokenizedDataset: index {index} out of range for {len(self)}")
        index = int(index) % len(self)
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        if self.field_lengths is not None:
            tokens = np.asarray(self._ids[start:stop], dtype=np.int32)
            cuts = np.cumsum(self.field_lengths[index])[:-1]
            return dict(zip(self.meta["fields"], np.split(tokens, cuts), strict=True))
        doc = {"input_ids": np.asarray(self._ids[start:stop], dtype=np.int32)}
        if self._labels is not None:
            doc["labels"] = np.asarray(self._labels[start:stop], dtype=np.int32)
        return doc

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents."""
        return int(self.offsets[-1])

    def __repr__(self) -> str:
        where = self.path or "memory"
        return f"TokenizedDataset({len(self)} documents, {self.num_tokens} tokens, {where})"


def _encode(
    tokenizer: Tokenizer, format: str, record: Mapping[str, Any], add_bos: bool, add_eos: bool
) -> tuple[list[int] | np.ndarray, np.ndarray | list[int] | None]:
    """A record's token ids and its labels (None for text); for preference records the
    three fields' ids one after another and, in place of labels, their lengths."""
    if format == "text":
        return tokenizer.encode(record["text"], add_bos=add_bos, add_eos=add_eos), None
    if format == "preference":
        pair = encode_preference(tokenizer, record, add_bos=add_bos, add_eos=add_eos)
        parts = [pair[field] for field in PREFERENCE_FIELDS]  # type: ignore[literal-required]
        return np.concatenate(parts), [len(p) for p in parts]
    if format == "completion":
        example = encode_completion(
            tokenizer, record["prompt"], record["completion"], add_bos=add_bos
        )
    else:
        example = encode_chat(tokenizer, record["messages"])  # type: ignore[arg-type]
    return example["input_ids"], example["labels"]


def load_tokenized(
    source: Source | PathLike | Sequence[PathLike],
    tokenizer: Tokenizer,
    *,
    format: Format = "auto",
    cache_dir: PathLike | None = None,
    cache: bool = True,
    add_bos: bool | None = None,
    add_eos: bool = True,
    progress: bool = True,
) -> TokenizedDataset:
    """``source``'s records (a :class:`Source`, or paths for :func:`data_files`), tokenized
    for ``format`` (the module docstring), from the cache when an entry has the same key.

    ``add_bos=None`` starts documents with BOS exactly when the tokenizer's default
    encoding does (``tokenizer.adds_bos``); ``add_eos`` ends each text document with EOS
    (completions always end with one) and each preference response with EOS (TRL's rule:
    :func:`~edl.text.encode_preference`). Progress (records, rate) goes to stderr, at most
    once a second, unless ``progress=False``. ``cache=False`` tokenizes into memory.

    An entry that fails its checks (:meth:`TokenizedDataset.open`; ids are bounded by
    ``tokenizer.vocab_size`` where the tokenizer has one) is rebuilt with a warning naming
    it and what was wrong. When the entry cannot be written (``OSError``, e.g. a full disk,
    or safetensors' ``SafetensorError``) a warning names it and the documents are returned
    from memory (``path`` None), with no temporary file or partial entry left behind.
    Raises ``ValueError`` naming the record (``file:line``) for a bad record, for a
    ``"chat"`` record or a conversational ``"preference"`` record with a tokenizer that is
    not an :class:`HFTokenizer`, and naming the document for an id the tokenizer gave
    outside its vocabulary; the tokenizer's errors of other types (a chat template's own)
    keep their type, with a note naming the record.
    """
    if not isinstance(source, Source):
        source = data_files(source)
    if add_bos is None:
        add_bos = bool(getattr(tokenizer, "adds_bos", False))
    vocab_size = getattr(tokenizer, "vocab_size", None)
    vocab_size = vocab_size if type(vocab_size) is int else None
    keyed = {
        "source_fingerprint": source.fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer) if cache else None,
        "format": format,
        "add_bos": add_bos,
        "add_eos": add_eos,
    }
    made_from = {
        "version": _VERSION,
        "source": source.description,
        "tokenizer": str(getattr(tokenizer, "name", tokenizer)),
        "vocab_size": vocab_size,
        **keyed,
    }
    args = (source, tokenizer, format, add_bos, add_eos, progress, made_from)
    if not cache:
        return _tokenize(*args)
    key_text = json.dumps({**keyed, "version": _KEY_VERSION}, sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    path = Path(default_cache_dir() if cache_dir is None else cache_dir) / f"{key}.safetensors"
    if os.path.exists(path) or os.path.exists(path.with_suffix(".json")):  # False on errors
        try:
            return TokenizedDataset.open(path, vocab_size=vocab_size)
        except (OSError, ValueError) as e:  # partial, damaged or older: rebuilt
            why = str(e).removeprefix(f"{path}: ")
            warnings.warn(f"load_tokenized: rebuilding the cache entry {path}: {why}", stacklevel=2)
    dataset = _tokenize(*args)
    from safetensors import SafetensorError

    try:
        _write(dataset, path)
    except (OSError, SafetensorError) as e:
        warnings.warn(
            f"load_tokenized: could not write the cache entry {path} ({type(e).__name__}: "
            f"{e}); using the tokenized documents from memory, uncached",
            stacklevel=2,
        )
        return dataset
    return TokenizedDataset.open(path, vocab_size=vocab_size)


def _tokenize(
    source: Source,
    tokenizer: Tokenizer,
    format: str,
    add_bos: bool,
    add_eos: bool,
    progress: bool,
    made_from: Mapping[str, Any],
) -> TokenizedDataset:
    """Tokenize every record of ``source`` into one in-memory dataset."""
    from tqdm import tqdm

    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    field_lengths: list[list[int]] = []
    warned: list[str] = []
    formats: set[str] = set()
    bar = tqdm(
        validated_records(source, format),
        desc=f"tokenizing {source.description}",
        unit=" records",
        file=sys.stderr,
        mininterval=1.0,
        disable=not progress,
    )
    for where, kind, record in bar:
        chat = kind == "chat" or (kind == "preference" and isinstance(record["prompt"], list))
        if chat and not isinstance(tokenizer, HFTokenizer):
            raise ValueError(
                f"{where}: chat records need an HFTokenizer with a chat template, got {tokenizer!r}"
            )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tokens, labelled = _encode(tokenizer, kind, record, add_bos, add_eos)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        except Exception as e:  # a tokenizer's or template's own error type, kept: say where
            e.add_note(f"while tokenizing {where}")
            raise
        for w in caught:  # the encoders' per-record warnings are summed up below
            if str(w.message).startswith("encode_"):
                warned.append(f"{where}: {w.message}")
            else:
                warnings.warn(w.message, w.category, stacklevel=2)
        formats.add(kind)
        ids.append(np.asarray(tokens, dtype=np.int32))
        if kind == "preference":
            field_lengths.append(labelled)  # type: ignore[arg-type]
        elif labelled is not None:
            labels.append(labelled)  # type: ignore[arg-type]
    if not ids:
        raise ValueError(f"load_tokenized: {source.description} holds no record")
    if warned:
        warnings.warn(
            f"load_tokenized: {len(warned)} of {len(ids)} records warned; the first, {warned[0]}",
            stacklevel=3,
        )
    lengths = np.array([len(a) for a in ids], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    has_labels = bool(labels)
    meta = {
        **made_from,
        "num_documents": len(ids),
        "num_tokens": int(offsets[-1]),
        "has_labels": has_labels,
        "formats": sorted(formats),
    }
    lengths_array = None
    if field_lengths:
        meta["fields"] = list(PREFERENCE_FIELDS)
        lengths_array = np.asarray(field_lengths, dtype=np.int64)
    flat_ids = np.concatenate(ids)
    flat_labels = np.concatenate(labels) if has_labels else None
    _check_tokenized(tokenizer, source, flat_ids, flat_labels, offsets, made_from["vocab_size"])
    return TokenizedDataset(flat_ids, flat_labels, offsets, meta, field_lengths=lengths_array)


def _check_tokenized(
    tokenizer: Tokenizer,
    source: Source,
    ids: np.ndarray,
    labels: np.ndarray | None,
    offsets: np.ndarray,
    vocab_size: int | None,
) -> None:
    """``ValueError`` naming the document when ``tokenizer`` gave an id outside its own
    vocabulary: a tokenizer's bug, named here rather than as a damaged cache entry."""
    for name, flat in (("input_ids", ids), ("labels", labels)):
        if flat is None or vocab_size is None:
            continue
        at = outside_vocab(flat, vocab_size, TOKEN_ARRAYS[name])
        if at is not None:
            document = int(np.searchsorted(offsets, at, side="right")) - 1
            raise ValueError(
                f"load_tokenized: {tokenizer!r} gave document {document} of "
                f"{source.description} the {name} {int(flat[at])}, outside its vocabulary "
                f"[0, {vocab_size})"
            )


def _write(dataset: TokenizedDataset, path: Path) -> None:
    """Write ``dataset`` as the cache entry ``path`` (:func:`edl.text._entry.write_entry`)."""
    arrays = {"input_ids": np.asarray(dataset._ids), "offsets": dataset.offsets}
    if dataset._labels is not None:
        arrays["labels"] = np.asarray(dataset._labels)
    if dataset.field_lengths is not None:
        arrays["field_lengths"] = dataset.field_lengths
    write_entry(arrays, dataset.meta, path)
