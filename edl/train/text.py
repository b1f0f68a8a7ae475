"""Text side of the data pipeline: a byte-level tokenizer and the embedded default corpus.

The default corpus is the Python standard library's own ``.py`` sources, so training runs
with no download. Everything here is deterministic for a given Python installation.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sysconfig
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

__all__ = [
    "ByteTokenizer",
    "Tokenizer",
    "default_corpus_files",
    "load_corpus",
    "split_corpus",
]

T = TypeVar("T")

# Directory names never descended into by `default_corpus_files`.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


@runtime_checkable
class Tokenizer(Protocol):
    """What the batching code needs from a tokenizer (``ByteTokenizer`` is one).

    ``encode(text, *, add_bos, add_eos)`` returns token ids; ``pad_id`` fills padding.
    """

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: ids ``0..255`` are raw bytes, then ``pad``, ``bos``, ``eos``.

    ``vocab_size == 259``. Every string round-trips: ``decode(encode(s)) == s``.
    """

    pad_id: ClassVar[int] = 256
    bos_id: ClassVar[int] = 257
    eos_id: ClassVar[int] = 258
    vocab_size: ClassVar[int] = 259
    name: ClassVar[str] = "bytes"

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes, optionally framed by ``bos_id`` / ``eos_id``."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (any shape is flattened); special ids are skipped.

        Invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD. Raises
        ``ValueError`` for an id outside ``[0, vocab_size)``.
        """
        array = np.asarray(ids).reshape(-1)
        if array.size and array.dtype.kind not in "iu":
            raise ValueError(f"decode: ids must be integers, got dtype {array.dtype}")
        bad = array[(array < 0) | (array >= self.vocab_size)]
        if bad.size:
            raise ValueError(
                f"decode: id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})"
            )
        data = array[array < 256].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


def default_corpus_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib directory.

    Found via ``sysconfig.get_paths()["stdlib"]``; ``site-packages`` and test directories
    (``test/``, ``tests/``, ``idlelib/idle_test``, ``lib2to3/tests``) are excluded. Raises
    ``RuntimeError`` when no file is found (e.g. a stripped, zip-only Python install).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, pathlib.Path]] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = pathlib.Path(directory, filename)
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise RuntimeError(
            f"default_corpus_files: no .py sources under the stdlib directory {str(root)!r} "
            "(sysconfig.get_paths()['stdlib']); pass corpus files explicitly"
        )
    return [path for _, path in sorted(found)]


def load_corpus(
    files: Sequence[str | os.PathLike[str]] | None = None, *, max_bytes: int | None = None
) -> list[str]:
    """Read ``files`` (default: :func:`default_corpus_files`) as UTF-8 text, in order.

    Undecodable bytes become U+FFFD. With ``max_bytes``, reading stops once that many raw
    bytes are read: the last document is cut at a character boundary, so the documents'
    UTF-8 size totals at most ``max_bytes`` (for valid UTF-8 files). Empty files are skipped.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"load_corpus: max_bytes must be >= 1 or None, got {max_bytes}")
    paths = default_corpus_files() if files is None else [pathlib.Path(f) for f in files]
    documents: list[str] = []
    remaining = max_bytes
    for path in paths:
        if remaining is not None and remaining <= 0:
            break
        with open(path, "rb") as f:
            data = f.read() if remaining is None else f.read(remaining)
            cut = remaining is not None and bool(f.read(1))
        if cut:
            data = _cut_at_char_boundary(data)
        if remaining is not None:
            remaining = 0 if cut else remaining - len(data)
        if data:
            documents.append(data.decode("utf-8", errors="replace"))
    return documents


def _cut_at_char_boundary(data: bytes) -> bytes:
    """Drop a trailing incomplete UTF-8 character (at most 3 bytes) from ``data``."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:  # ASCII: the cut is at a boundary
            return data
        if byte >= 0xC0:  # a lead byte: complete iff its sequence fits in `back` bytes
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if need == back else data[:-back]
    return data  # not UTF-8 near the end: leave it to errors="replace"


def split_corpus(docs: Sequence[T], eval_fraction: float = 0.02) -> tuple[list[T], list[T]]:
    """Split ``docs`` deterministically into ``(train_docs, eval_docs)``, both in input order.

    ``round(len(docs) * eval_fraction)`` documents (at least one when ``eval_fraction > 0``
    and there are two or more documents) go to eval, evenly spaced over the input, so
    eval samples the whole corpus. ``eval_fraction`` must lie in ``[0, 1)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"split_corpus: eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(docs)
    n_eval = min(max(round(n * eval_fraction), 1), n - 1) if eval_fraction > 0 and n >= 2 else 0
    eval_index = {((2 * j + 1) * n) // (2 * n_eval) for j in range(n_eval)}
    train = [d for i, d in enumerate(docs) if i not in eval_index]
    evals = [d for i, d in enumerate(docs) if i in eval_index]
    return train, evals
