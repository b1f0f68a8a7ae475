"""``shards.json``, the index of a sharded checkpoint (:mod:`edl.io.checkpoint.sharded`): its names,
and :func:`read_index`, the one reader of it, which validates all of it before any of it is
used.

The index is data a damaged or hostile checkpoint may hold anything in. Unchecked, a bad
``process_count`` or process id, a negative start or a piece past its array's end surface
as ``KeyError`` / ``IndexError`` / numpy errors that name no file, and two pieces with
swapped tensor names load silently into each other's places. :func:`read_index` instead
raises one ``CheckpointError`` naming ``shards.json``, the entry
(``model['w'].pieces[3].start``), the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edl.io.formats.files import read_json
from edl.io.formats.safetensors.format import DTYPES, CheckpointError

__all__ = [
    "INDEX_NAME",
    "KINDS",
    "Piece",
    "ShardIndex",
    "StoredArray",
    "file_prefix",
    "missing_file",
    "read_index",
]

INDEX_NAME = "shards.json"
KINDS = ("model", "optimizer")
"""The sections an index may hold (each ``kind`` also names its files, :func:`file_prefix`)."""

_DTYPES = {dtype.name: dtype for dtype in DTYPES.values()}  # what safetensors stores, by name
_ARRAY_FIELDS = ("shape", "dtype", "pieces")
_PIECE_FIELDS = ("process", "start", "stop", "tensor")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stored block of an array: ``[start, stop)`` per axis, written by ``process``."""

    process: int
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    def tensor_name(self, path: str) -> str:
        """The block's tensor name in its process's file: ``"{path}@{start}:{stop},..."``."""
        return f"{path}@" + ",".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True))


def file_prefix(kind: str, process: int) -> str:
    """The file-name stem of process ``process``'s pieces of ``kind``."""
    return f"{kind}.process-{process:05d}"


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """One array of an index section: global shape, stored dtype and the pieces that tile it
    exactly (each region once)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """A validated ``shards.json`` (:func:`read_index`) at ``path``: ``sections`` maps each
    kind of :data:`KINDS` it holds to its arrays by path."""

    path: Path
    process_count: int
    sections: Mapping[str, Mapping[str, StoredArray]]

    def section(self, kind: str) -> Mapping[str, StoredArray]:
        """The arrays of ``kind``; ``CheckpointError`` if the index has no such section."""
        if kind not in self.sections:
            held = ", ".join(self.sections) or "none"
            raise CheckpointError(f"{self.path}: has no {kind!r} section (it holds: {held})")
        return self.sections[kind]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _fail(index: Path, entry: str, expected: str, actual: str) -> CheckpointError:
    return CheckpointError(f"{index}: {entry}: expected {expected}, got {actual}")


def _fields(index: Path, entry: str, value: Any, names: Sequence[str]) -> None:
    if not isinstance(value, dict) or set(value) != set(names):
        got = f"the fields {sorted(value)}" if isinstance(value, dict) else _show(value)
        raise _fail(index, entry, f"an object with the fields {list(names)}", got)


def _ints(
    index: Path, entry: str, value: Any, low: Sequence[int], high: Sequence[int]
) -> tuple[int, ...]:
    """``value`` as ``len(low)`` integers, the one on axis ``a`` within ``[low[a], high[a]]``."""
    fits = isinstance(value, list) and len(value) == len(low)
    if not fits or not all(
        type(v) is int and lo <= v <= hi for v, lo, hi in zip(value, low, high, strict=True)
    ):
        expected = f"{len(low)} integers from {list(low)} to {list(high)}"
        raise _fail(index, entry, expected, _show(value))
    return tuple(value)


def _piece(
    index: Path, entry: str, value: Any, path: str, shape: tuple[int, ...], processes: int
) -> Piece:
    _fields(index, entry, value, _PIECE_FIELDS)
    process = value["process"]
    if type(process) is not int or not 0 <= process < processes:
        expected = f"a process id in [0, {processes}) (process_count is {processes})"
        raise _fail(index, f"{entry}.process", expected, _show(process))
    start = _ints(index, f"{entry}.start", value["start"], (0,) * len(shape), shape)
    stop = _ints(index, f"{entry}.stop", value["stop"], start, shape)
    piece = Piece(process, start, stop)
    name = piece.tensor_name(path)
    if value["tensor"] != name:  # else two swapped names would load into each other's places
        expected = f"{name!r} (the name of the block it describes)"
        raise _fail(index, f"{entry}.tensor", expected, _show(value["tensor"]))
    return piece


def _meet(a: Piece, b: Piece) -> bool:
    """Whether two blocks share a cell."""
    return all(
        max(a0, b0) < min(a1, b1)
        for a0, b0, a1, b1 in zip(a.start, b.start, a.stop, b.stop, strict=True)
    )


def _overlapping(pieces: Sequence[Piece]) -> tuple[int, int] | None:
    """Two pieces that share a cell (their indices, ascending), or ``None``. A sweep along
    the axis with the most distinct starts compares each piece only with the earlier ones
    still open there (a grid's row), not every pair."""
    if not pieces or not pieces[0].start:  # a scalar: any two pieces hold its one cell
        return (0, 1) if len(pieces) > 1 else None
    axis = max(range(len(pieces[0].start)), key=lambda a: len({p.start[a] for p in pieces}))
    open_: list[int] = []
    for k in sorted(range(len(pieces)), key=lambda k: pieces[k].start[axis]):
        open_ = [i for i in open_ if pieces[i].stop[axis] > pieces[k].start[axis]]
        for i in open_:
            if _meet(pieces[i], pieces[k]):
                return min(i, k), max(i, k)
        open_.append(k)
    return None


def _region(piece: Piece) -> str:
    return f"{list(piece.start)}..{list(piece.stop)}"


def _array(index: Path, entry: str, value: Any, path: str, processes: int) -> StoredArray:
    _fields(index, entry, value, _ARRAY_FIELDS)
    shape = value["shape"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _fail(index, f"{entry}.shape", "a list of non-negative integers", _show(shape))
    shape = tuple(shape)
    if not isinstance(value["dtype"], str) or value["dtype"] not in _DTYPES:
        raise _fail(index, f"{entry}.dtype", f"one of {sorted(_DTYPES)}", _show(value["dtype"]))
    if not isinstance(value["pieces"], list):
        raise _fail(index, f"{entry}.pieces", "a list", _show(value["pieces"]))
    pieces = tuple(
        _piece(index, f"{entry}.pieces[{i}]", p, path, shape, processes)
        for i, p in enumerate(value["pieces"])
    )
    pair = _overlapping(pieces)
    if pair is not None:
        i, k = pair
        actual = f"{_region(pieces[k])}, which overlaps pieces[{i}]'s {_region(pieces[i])}"
        raise _fail(index, f"{entry}.pieces[{k}]", "a block no other piece holds", actual)
    cells, total = sum(math.prod(p.shape) for p in pieces), math.prod(shape)
    if cells != total:
        expected = f"pieces covering all {total} values of shape {list(shape)}"
        raise _fail(index, f"{entry}.pieces", expected, f"{cells} values covered")
    return StoredArray(shape, _DTYPES[value["dtype"]], pieces)


def _read_raw(index: Path) -> dict[str, Any]:
    try:
        return read_json(index, what="sharded checkpoint index", unique_keys=True)
    except OSError as e:
        why = e.strerror or str(e)
        raise CheckpointError(
            f"{index}: the sharded checkpoint's index cannot be read ({why})"
        ) from e
    except ValueError as e:  # read_json's message names the file
        raise CheckpointError(str(e)) from e


def _process_count(index: Path, raw: Mapping[str, Any]) -> int:
    processes = raw.get("process_count")
    if type(processes) is not int or processes < 1:
        raise _fail(index, "process_count", "a positive integer", _show(processes))
    return processes


def read_index(checkpoint: Path) -> ShardIndex:
    """``checkpoint``'s ``shards.json``, validated whole before any of it is used.

    Checked: the type of every field (no field missing or unknown); sections among
    :data:`KINDS`; ``process_count`` a positive integer and every piece's process in
    ``[0, process_count)``; every piece inside its array, one bound per axis
    (``0 <= start <= stop <= shape``); every piece's tensor named as
    :meth:`Piece.tensor_name` names its block; the pieces of each array tiling it exactly,
    no two sharing a value (the writer stores each region once) and none missing; dtypes
    among those safetensors stores. Raises ``CheckpointError`` naming ``shards.json``, the
    entry, the expected and the actual value.
    """
    index = checkpoint / INDEX_NAME
    raw = _read_raw(index)
    processes = _process_count(index, raw)
    unknown = sorted(set(raw) - {"process_count", *KINDS})
    if unknown:
        expected = f"only the keys {['process_count', *KINDS]}"
        raise _fail(index, "the top level", expected, f"also {unknown}")
    sections = {}
    for kind in (k for k in KINDS if k in raw):
        if not isinstance(raw[kind], dict):
            raise _fail(index, kind, "an object of arrays by path", _show(raw[kind]))
        sections[kind] = {
            path: _array(index, f"{kind}[{path!r}]", value, path, processes)
            for path, value in raw[kind].items()
        }
    return ShardIndex(index, processes, sections)


def missing_file(checkpoint: Path) -> str | None:
    """What a sharded checkpoint lacks, found cheaply (the index's ``process_count`` and
    file existence; no array entry validated, no tensor file opened): its index, readable,
    or a process's file of one of the index's sections. ``None`` when nothing is missing
    (:func:`edl.io.checkpoint.verify_checkpoint` checks the rest)."""
    index = checkpoint / INDEX_NAME
    try:
        raw = _read_raw(index)
        processes = _process_count(index, raw)
    except CheckpointError as e:
        return str(e)
    for kind in (k for k in KINDS if k in raw):
        for process in range(processes):
            stem = file_prefix(kind, process)
            ends = (".safetensors", ".safetensors.index.json")
            if not any((checkpoint / f"{stem}{end}").is_file() for end in ends):
                where = f"{INDEX_NAME} records {processes} processes"
                return f"{checkpoint / stem}.safetensors is missing ({where})"
    return None
