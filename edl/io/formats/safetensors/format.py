"""The safetensors format: dtypes, errors, sizes, tensor descriptions, header and index
parsing with validation (every problem a ``CheckpointError`` naming the file and tensor)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

StrPath = str | os.PathLike

#: Header lengths above this are treated as corruption (the official library's limit).
MAX_HEADER_SIZE = 100_000_000

#: safetensors dtype string -> numpy dtype of the stored (little-endian) data.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "C64": np.dtype("<c8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# Keyed by dtype name, which ignores byte order ('>f4' and '<f4' are both 'float32').
_CODES: dict[str, str] = {dt.name: code for code, dt in DTYPES.items()}

_UNITS = {
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "B": 1,
}
_SIZE_RE = re.compile(r"\s*(\d+)\s*([a-zA-Z]*)\s*")


class CheckpointError(ValueError):
    """A safetensors file, index or tensor request is invalid; the message names file and key."""


class MissingTensorError(CheckpointError, KeyError):
    """``CheckpointReader.read``/``info`` for a name the checkpoint does not hold.

    Both a ``CheckpointError`` and a ``KeyError``; the message lists close names.
    """

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0]) if self.args else ""


def parse_size(size: int | str) -> int:
    """Bytes in ``size``, with Hugging Face's ``max_shard_size`` semantics.

    ``"2GB"`` is ``2 * 10**9``, ``"500MB"``/``"100KB"`` likewise decimal, ``"2GiB"`` is
    ``2 * 2**30`` (``"MiB"``, ``"KiB"`` likewise); units are case-insensitive except that, as in
    transformers, a decimal unit ending in a lowercase ``b`` (``"8Gb"``) counts bits. Plain ints
    and digit strings (``"1000"``, ``"1000B"``) are bytes. Anything else raises ``ValueError``.
    """
    if isinstance(size, bool):
        raise ValueError(f"size must be an int or a string like '2GB', got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size must be non-negative, got {size}")
        return size
    m = _SIZE_RE.fullmatch(size)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in (*_UNITS, ""):
        raise ValueError(
            f"cannot parse size {size!r}: use an integer followed by one of B, KB, MB, GB, TB, "
            "KiB, MiB, GiB, TiB (e.g. '2GB', '500MiB')"
        )
    n = int(m.group(1)) * _UNITS.get(unit, 1)
    if unit in ("KB", "MB", "GB", "TB") and m.group(2).endswith("b"):
        n //= 8  # transformers' convert_file_size_to_int: "Gb" is gigabits
    return n


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a stored tensor lives: ``nbytes`` raw bytes at absolute byte ``offset`` of ``file``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


@runtime_checkable
class SupportsArray(Protocol):
    """Anything with a ``shape``, a numpy-compatible ``dtype`` and ``__array__`` (jax, numpy)."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor produced on demand: ``load()`` returns an array of ``shape`` and ``dtype``.

    ``save_tensors`` plans shards from ``shape``/``dtype`` and calls ``load`` exactly once, when
    the tensor is written (e.g. ``LazyTensor(w.shape[1:], w.dtype, lambda: np.asarray(w[3]))``
    for one layer of a stacked array). ``shape`` is stored as a tuple, ``dtype`` as ``np.dtype``.
    """

    shape: Sequence[int]
    dtype: np.dtype | type | str
    load: Callable[[], Any]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"LazyTensor shape must be non-negative, got {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


TensorLike = np.ndarray | LazyTensor | SupportsArray


def _no_duplicate_keys(where: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{where}: key {k!r} appears twice in the JSON")
            out[k] = v
        return out

    return hook


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_raw_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """The header JSON of ``path`` as a dict, the data region's start, and the file size."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: file has {file_size} bytes, too few for the 8-byte header length"
                )
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_SIZE:
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit "
                    "(corrupt header length, or not a safetensors file)"
                )
            if 8 + n > file_size:
                raise CheckpointError(
                    f"{path}: header length {n} runs past the end of the {file_size}-byte file "
                    "(corrupt header length, or truncated file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(str(path)))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n, file_size


# One header entry, validated on its own: (start, end, name, dtype, shape), offsets relative
# to the data region.
_Entry = tuple[int, int, str, np.dtype, tuple[int, ...]]


def _parse_entry(path: Path, name: str, entry: Any) -> _Entry:
    """Validate one tensor's header entry: dtype known, shape sane, offsets span its bytes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry must be a JSON object, got {entry!r}")
    code = entry.get("dtype")
    if code not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {code!r} (known: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints: {shape!r}")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(
            f"{where}: data_offsets must be [start, end] with 0 <= start <= end: {offsets!r}"
        )
    dtype = DTYPES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    start, end = offsets
    if nbytes != end - start:
        raise CheckpointError(
            f"{where}: dtype {code} and shape {shape} need {nbytes} bytes but "
            f"data_offsets {offsets} span {end - start}"
        )
    return start, end, name, dtype, tuple(shape)


def _lay_out(
    path: Path, entries: list[_Entry], data_start: int, file_size: int
) -> list[TensorInfo]:
    """Check that the entries tile the data region exactly (no overlap, hole, truncation or
    trailing bytes); return them as ``TensorInfo``s in on-disk order."""
    entries = sorted(entries, key=lambda e: (e[0], e[1]))
    expected, prev = 0, None
    infos = []
    for start, end, name, dtype, shape in entries:
        if start < expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} (data bytes {start}..{end}) overlaps tensor {prev!r} "
                f"(which ends at {expected})"
            )
        if start > expected:
            after = f"after tensor {prev!r} " if prev is not None else ""
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at data byte {start}, leaving a hole of "
                f"{start - expected} bytes {after}(the data must be contiguous)"
            )
        infos.append(TensorInfo(name, dtype, shape, path, data_start + start, end - start))
        expected, prev = end, name
    need = data_start + expected
    if file_size < need:
        raise CheckpointError(
            f"{path}: file is truncated: tensor {prev!r} ends at byte {need} but the file has "
            f"only {file_size} bytes"
        )
    if file_size > need:
        last = f"tensor {prev!r}" if prev is not None else "the header"
        raise CheckpointError(
            f"{path}: {file_size - need} unexpected bytes after {last}, which should end the "
            f"file at byte {need} (offsets out of range, or a corrupt file)"
        )
    return infos


def _read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse and fully validate ``path``'s header; tensors come back in on-disk order."""
    header, data_start, file_size = _read_raw_header(path)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(f"{path}: __metadata__ must map str to str, got {meta!r}")
    entries = [_parse_entry(path, name, entry) for name, entry in header.items()]
    return _lay_out(path, entries, data_start, file_size), dict(meta)


def _read_index(index: Path) -> dict[str, str]:
    try:
        text = index.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: cannot read index: {e}") from e
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys(str(index)))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: index is not valid JSON ({e})") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: index must be a JSON object with a 'weight_map' object")
    for key, fname in weight_map.items():
        if (
            not isinstance(fname, str)
            or not fname
            or fname in (".", "..")
            or "/" in fname
            or "\\" in fname
            or "\0" in fname
        ):
            raise CheckpointError(
                f"{index}: weight_map[{key!r}] must be a file name in the index's directory, "
                f"got {fname!r}"
            )
    return weight_map


def byte_view(arr: np.ndarray) -> np.ndarray:
    """The C-contiguous ``arr``'s memory as a flat writeable/readable uint8 array (no copy)."""
    return arr.reshape(-1).view(np.uint8)
