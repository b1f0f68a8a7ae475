"""Text side of the data pipeline: the embedded default corpus (the tokenizers live in
``edl.text``; ``Tokenizer`` and ``ByteTokenizer`` are re-exported here).

The default corpus is the Python standard library's own ``.py`` sources, so training runs
with no download. Everything here is deterministic for a given Python installation.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
from collections.abc import Sequence
from typing import TypeVar

from edl.text.tokenizer import ByteTokenizer, Tokenizer

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
