"""``save_tensors`` / ``save_file``: shards planned from shapes and dtypes, one tensor
materialised at a time, each file written atomically."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edl.io.formats.files import atomic_file, write_chunked
from edl.io.formats.safetensors.format import (
    _CODES,
    CheckpointError,
    LazyTensor,
    StrPath,
    TensorLike,
    byte_view,
    parse_size,
)


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
    with atomic_file(path) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for p in planned:
            arr = _materialise(p, path)
            if arr.size:
                write_chunked(f, memoryview(byte_view(arr)))
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
        with atomic_file(path) as f:
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
