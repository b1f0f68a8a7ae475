"""Streaming reader and writer for safetensors checkpoints, single-file or HF-sharded.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(space-padded to a multiple of 8)::

    {"__metadata__": {"format": "pt"},
     "wte": {"dtype": "F32", "shape": [32, 16], "data_offsets": [0, 2048]}, ...}

then the tensors' raw little-endian C-order bytes, contiguous and without holes
(``data_offsets`` count from the end of the header). A sharded Hugging Face checkpoint is
``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json``::

    {"metadata": {"total_size": 123}, "weight_map": {"wte": "model-00001-of-00003.safetensors"}}

Nothing here holds a whole file in memory. ``CheckpointReader`` parses and validates every
header when it opens (so corruption surfaces before any data is read) and then reads one tensor
at a time with positioned reads, straight into a preallocated buffer if asked
(``read_into``); ``save_tensors`` plans shards from shapes and dtypes alone and materialises one
tensor at a time while writing, so values may be ``LazyTensor``s produced on demand. Every file
is written to a temporary file in the target directory and moved into place with
``os.replace``. All format problems raise ``CheckpointError`` naming the file and the tensor.
No pickle is involved anywhere. This module depends on nothing else in edl.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPES",
    "MAX_HEADER_SIZE",
    "CheckpointError",
    "CheckpointReader",
    "LazyTensor",
    "MissingTensorError",
    "SupportsArray",
    "TensorInfo",
    "TensorLike",
    "load_file",
    "open_checkpoint",
    "parse_size",
    "save_file",
    "save_tensors",
]

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


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


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


def _read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse and fully validate ``path``'s header; tensors come back in on-disk order."""
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

    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(f"{path}: __metadata__ must map str to str, got {meta!r}")

    data_start = 8 + n
    entries: list[tuple[int, int, str, np.dtype, tuple[int, ...]]] = []
    for name, entry in header.items():
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
        entries.append((start, end, name, dtype, tuple(shape)))

    entries.sort(key=lambda e: (e[0], e[1]))
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
    return infos, dict(meta)


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
        ):
            raise CheckpointError(
                f"{index}: weight_map[{key!r}] must be a file name in the index's directory, "
                f"got {fname!r}"
            )
    return weight_map


def _pread_into(fd: int, view: memoryview, offset: int, lock: threading.Lock) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    with lock:  # no positioned reads (Windows): seek + read, serialised
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def _byte_view(arr: np.ndarray) -> np.ndarray:
    """The C-contiguous ``arr``'s memory as a flat writeable/readable uint8 array (no copy)."""
    return arr.reshape(-1).view(np.uint8)


class CheckpointReader:
    """Random access to the tensors of a safetensors checkpoint, one tensor at a time.

    ``path`` is a directory holding ``{prefix}.safetensors`` or
    ``{prefix}.safetensors.index.json`` (the single file wins if both exist, as in
    transformers), a ``.safetensors`` file, or an index ``.json``. Every header is parsed and
    validated on open; data is read only by ``read``/``read_into``, with positioned reads that
    are safe to issue from several threads. Use as a context manager (or call ``close``) to
    release the file descriptors.

    Shard files must lie next to the index. Tensors a shard holds but the index does not list
    are still served. ``keys()`` is in on-disk order (file, then offset), the order that reads
    the files sequentially.
    """

    def __init__(self, path: StrPath, *, prefix: str = "model") -> None:
        p = Path(path)
        if p.is_dir():
            single = p / f"{prefix}.safetensors"
            index = p / f"{prefix}.safetensors.index.json"
            if single.is_file():
                p = single
            elif index.is_file():
                p = index
            else:
                raise CheckpointError(f"{p}: holds neither {single.name} nor {index.name}")
        elif not p.exists():
            raise CheckpointError(f"{p}: no such file or directory")
        self.path: Path = p
        self._infos: dict[str, TensorInfo] = {}
        self._metadata: dict[str, str] = {}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._closed = False

        if p.name.endswith(".json"):
            weight_map = _read_index(p)
            by_file: dict[str, list[str]] = {}
            for key, fname in weight_map.items():
                by_file.setdefault(fname, []).append(key)
            files = [p.parent / fname for fname in sorted(by_file)]
            for file in files:
                if not file.is_file():
                    keys = by_file[file.name]
                    raise CheckpointError(
                        f"{p}: shard {file.name!r} is missing (it should hold {len(keys)} "
                        f"tensors, e.g. {', '.join(map(repr, keys[:3]))})"
                    )
        else:
            weight_map, files = None, [p]

        for file in files:
            infos, meta = _read_header(file)
            for info in infos:
                if info.name in self._infos:
                    raise CheckpointError(
                        f"{p}: tensor {info.name!r} is in two shards, "
                        f"{self._infos[info.name].file.name} and {file.name}"
                    )
                self._infos[info.name] = info
            for k, v in meta.items():
                self._metadata.setdefault(k, v)
        if weight_map is not None:
            for key, fname in weight_map.items():
                found = self._infos.get(key)
                if found is None or found.file.name != fname:
                    actual = f" (it is in {found.file.name})" if found is not None else ""
                    raise CheckpointError(
                        f"{p}: tensor {key!r} is listed in shard {fname} but that file does "
                        f"not contain it{actual}"
                    )
        self._files = files

    @classmethod
    def open(cls, path: StrPath, *, prefix: str = "model") -> CheckpointReader:
        """Same as ``CheckpointReader(path, prefix=prefix)``."""
        return cls(path, prefix=prefix)

    # -- container protocol ------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Tensor names in on-disk order."""
        return list(self._infos)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def __repr__(self) -> str:
        return (
            f"CheckpointReader({str(self.path)!r}, {len(self)} tensors, {len(self._files)} files)"
        )

    @property
    def metadata(self) -> dict[str, str]:
        """The files' ``__metadata__`` merged (the first file wins on conflicts); a copy."""
        return dict(self._metadata)

    @property
    def files(self) -> list[Path]:
        """The safetensors files, in shard order."""
        return list(self._files)

    @property
    def total_size(self) -> int:
        """Total tensor bytes (what an index's ``metadata.total_size`` should say)."""
        return sum(info.nbytes for info in self._infos.values())

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and location of tensor ``name``; ``MissingTensorError`` if absent."""
        info = self._infos.get(name)
        if info is None:
            close = difflib.get_close_matches(name, self._infos, n=5, cutoff=0.6)
            hint = (
                f"; close names: {', '.join(map(repr, close))}"
                if close
                else f"; it holds {len(self)} tensors"
            )
            raise MissingTensorError(f"{self.path}: no tensor named {name!r}{hint}")
        return info

    # -- reading ------------------------------------------------------------------------------

    def _fd(self, file: Path) -> int:
        with self._lock:
            if self._closed:
                raise CheckpointError(f"{self.path}: reader is closed")
            fd = self._fds.get(file)
            if fd is None:
                try:
                    fd = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                except OSError as e:
                    raise CheckpointError(f"{file}: cannot open: {e}") from e
                self._fds[file] = fd
            return fd

    def _read_bytes(self, info: TensorInfo, dest: np.ndarray) -> None:
        if info.nbytes == 0:
            return
        fd = self._fd(info.file)
        view = memoryview(dest)
        done = 0
        while done < info.nbytes:
            try:
                got = _pread_into(fd, view[done:], info.offset + done, self._lock)
            except OSError as e:
                raise CheckpointError(f"{info.file}: reading tensor {info.name!r}: {e}") from e
            if got == 0:
                raise CheckpointError(
                    f"{info.file}: file ended while reading tensor {info.name!r} (truncated "
                    "after it was opened?)"
                )
            done += got

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a fresh, writeable array of its stored dtype and shape."""
        info = self.info(name)
        out = np.empty(info.shape, info.dtype)
        self._read_bytes(info, _byte_view(out))
        return out

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        """Read tensor ``name`` into ``out`` (e.g. ``stacked[3]``) and return ``out``.

        ``out`` must have the stored shape. When it is C-contiguous with the stored dtype the
        bytes go straight into it; otherwise the tensor is read into a temporary and cast like
        ``ndarray.astype`` (``casting="unsafe"``).
        """
        info = self.info(name)
        if tuple(out.shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {info.shape} but the destination has "
                f"shape {tuple(out.shape)}"
            )
        if not out.flags.writeable:
            raise CheckpointError(f"{info.file}: destination for tensor {name!r} is read-only")
        if out.dtype == info.dtype and out.flags.c_contiguous:
            self._read_bytes(info, _byte_view(out))
        else:
            np.copyto(out, self.read(name), casting="unsafe")
        return out

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the open file descriptors; idempotent."""
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def open_checkpoint(path: StrPath, *, prefix: str = "model") -> CheckpointReader:
    """Open a checkpoint for reading; see ``CheckpointReader``."""
    return CheckpointReader(path, prefix=prefix)


def load_file(path: StrPath, *, prefix: str = "model") -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as numpy arrays (for small files and tests)."""
    with CheckpointReader(path, prefix=prefix) as reader:
        return {name: reader.read(name) for name in reader}


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Planned:
    name: str
    value: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    code: str
    nbytes: int


def _plan(tensors: Mapping[str, TensorLike]) -> list[_Planned]:
    """Names, dtypes, shapes and sizes, without materialising anything."""
    planned, seen = [], set()
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor names must be non-empty strings, got {name!r}")
        if name == "__metadata__":
            raise CheckpointError("'__metadata__' is reserved and cannot name a tensor")
        if name in seen:
            raise CheckpointError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            shape = tuple(int(d) for d in value.shape)
            dtype = np.dtype(value.dtype)
        except (AttributeError, TypeError) as e:
            raise CheckpointError(
                f"tensor {name!r}: cannot read a numpy shape and dtype from a "
                f"{type(value).__name__} ({e}); pass numpy/jax arrays or LazyTensor"
            ) from e
        code = _CODES.get(dtype.name)
        if code is None or dtype.fields is not None:
            raise CheckpointError(
                f"tensor {name!r}: dtype {dtype} has no safetensors equivalent "
                f"(supported: {', '.join(sorted(_CODES))})"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        planned.append(_Planned(name, value, shape, dtype, code, nbytes))
    return planned


def _materialise(p: _Planned, file: Path) -> np.ndarray:
    """``p``'s value as a C-contiguous little-endian array, checked against the plan."""
    value = p.value.load() if isinstance(p.value, LazyTensor) else p.value
    arr = np.asarray(value)
    if arr.shape != p.shape or arr.dtype.name != p.dtype.name:
        raise CheckpointError(
            f"{file}: tensor {p.name!r} was planned as {p.dtype} {p.shape} from its "
            f"shape/dtype but materialised as {arr.dtype} {arr.shape}"
        )
    order = arr.dtype.byteorder
    if order == ">" or (order == "=" and sys.byteorder == "big" and arr.dtype.itemsize > 1):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[Any]:
    """A binary file object writing to a temporary next to ``path``, moved there on success."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    # os.open with 0o666 honours the umask, unlike tempfile.mkstemp's 0o600.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_safetensors(path: Path, planned: Sequence[_Planned], metadata: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for p in planned:
        header[p.name] = {
            "dtype": p.code,
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with _atomic_file(path) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for p in planned:
            arr = _materialise(p, path)
            if arr.size:
                f.write(memoryview(_byte_view(arr)))
            del arr


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    return meta


def _aligned(shard: list[_Planned]) -> list[_Planned]:
    # Widest items first, so every tensor's offset is a multiple of its itemsize (the data
    # section starts 8-aligned), as the official writer does.
    return sorted(shard, key=lambda p: -p.dtype.itemsize)


def save_tensors(
    tensors: Mapping[str, TensorLike],
    directory: StrPath,
    *,
    max_shard_size: int | str = "2GB",
    metadata: Mapping[str, str] | None = None,
    prefix: str = "model",
) -> list[Path]:
    """Write ``tensors`` to ``directory`` in Hugging Face layout; return the files written.

    One ``{prefix}.safetensors`` if everything fits in ``max_shard_size`` (``parse_size``
    syntax, tensor bytes only), else ``{prefix}-00001-of-0000N.safetensors`` ... plus
    ``{prefix}.safetensors.index.json`` (written last). Shards fill greedily in the mapping's
    order; a tensor larger than the limit gets a shard of its own. Each file's ``__metadata__``
    is ``metadata`` plus ``"format": "pt"`` unless it names a format (transformers requires
    one). Only shapes and dtypes are inspected up front; values are materialised one at a time
    as they are written (``np.asarray``, or ``LazyTensor.load``). Every file is written
    atomically; afterwards files of an earlier save with the same prefix that are not part of
    this one (``{prefix}.safetensors``, ``{prefix}-NNNNN-of-NNNNN.safetensors``, the index) are
    deleted.
    """
    if not prefix or "/" in prefix or "\\" in prefix:
        raise ValueError(f"prefix must be a plain file name stem, got {prefix!r}")
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    meta = _check_metadata(metadata)
    planned = _plan(tensors)

    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    names = (
        [f"{prefix}.safetensors"]
        if n == 1
        else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    written = []
    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(out / name, _aligned(shard), meta)
        written.append(out / name)
    if n > 1:
        weight_map = {
            p.name: name for name, shard in zip(names, shards, strict=True) for p in shard
        }
        index = {
            "metadata": {"total_size": sum(p.nbytes for p in planned)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        path = out / f"{prefix}.safetensors.index.json"
        with _atomic_file(path) as f:
            f.write((json.dumps(index, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        written.append(path)

    stale = re.compile(
        rf"{re.escape(prefix)}(?:\.safetensors(?:\.index\.json)?|-\d{{5,}}-of-\d{{5,}}\.safetensors)"
    )
    keep = {p.name for p in written}
    for old in out.iterdir():
        if stale.fullmatch(old.name) and old.name not in keep and old.is_file():
            old.unlink()
    return written


def save_file(
    tensors: Mapping[str, TensorLike],
    path: StrPath,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` to the single safetensors file ``path`` (atomically); return it.

    ``metadata`` gets ``"format": "pt"`` unless it names a format, as in ``save_tensors``.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    planned = _plan(tensors)
    _write_safetensors(p, _aligned(planned), _check_metadata(metadata))
    return p
