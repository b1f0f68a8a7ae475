"""Checkpoint arrays written where they lie: each process saves the pieces of every array its
devices hold, and a reader assembles any other placement from those pieces.

The layout (``model_format: "sharded"`` in ``state.json``, see ``edl.io.checkpoint``):

- ``{kind}.process-{p:05d}.safetensors`` (or sharded with an index, as ``save_tensors``
  writes it): process ``p``'s pieces, ``kind`` being ``model`` or ``optimizer``. A piece of
  array ``path`` covering ``[start, stop)`` on each axis is the tensor
  ``"{path}@{start}:{stop},..."`` (``"{path}@"`` for a scalar).
- ``shards.json``: for every array its global shape, dtype and pieces (process, tensor
  name, start, stop). Written by process 0, which can list every process's pieces itself:
  they follow from each array's sharding alone (:func:`pieces`).

Why not orbax-checkpoint: its files are OCDBT / Zarr through tensorstore, and edl keeps its
files safetensors + JSON, readable by anything that reads safetensors; the pieces and an
index are all a multi-process checkpoint needs. Every piece is written by exactly one
process (of an array replicated over devices, the first device in device-id order holding
that region), so nothing is gathered to one host and nothing is written twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from edl.io.files import read_json, write_json_atomic
from edl.io.safetensors import CheckpointError, CheckpointReader, LazyTensor, save_tensors

__all__ = [
    "INDEX_NAME",
    "Piece",
    "StoredArrays",
    "file_prefix",
    "pieces",
    "read_pieces",
    "write_index",
    "write_pieces",
]

INDEX_NAME = "shards.json"


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stored block of an array: ``[start, stop)`` per axis, written by ``process``."""

    process: int
    start: tuple[int, ...]
    stop: tuple[int, ...]

    def tensor_name(self, path: str) -> str:
        return f"{path}@" + ",".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True))


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    start = tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))
    stop = tuple(s.indices(n)[1] for s, n in zip(index, shape, strict=True))
    return start, stop


def pieces(x: Any) -> list[tuple[Piece, Any]]:
    """The distinct blocks of array ``x`` with their writers, in a fixed order, each with the
    device that holds it (``(piece, device)``); a host array is one block of process 0."""
    shape = tuple(x.shape)
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return [(Piece(0, (0,) * len(shape), shape), None)]
    by_region: dict[tuple, Any] = {}
    for device, index in sorted(sharding.devices_indices_map(shape).items(),
                                key=lambda item: item[0].id):  # fmt: skip
        by_region.setdefault(_bounds(index, shape), device)
    return [(Piece(d.process_index, *region), d) for region, d in sorted(by_region.items())]


def file_prefix(kind: str, process: int) -> str:
    """The file-name stem of process ``process``'s pieces of ``kind``."""
    return f"{kind}.process-{process:05d}"


def write_pieces(
    directory: Path, kind: str, arrays: Mapping[str, Any], dtype: DTypeLike | None
) -> dict[str, Any]:
    """Write this process's pieces of ``arrays`` (floats cast to ``dtype`` when given) into
    ``directory``; return the index entries of all processes' pieces (``shards.json``'s
    ``kind`` section)."""
    me = jax.process_index()
    tensors: dict[str, LazyTensor] = {}
    index: dict[str, Any] = {}
    for path, x in arrays.items():
        cast = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        want = np.dtype(dtype if cast else x.dtype)
        blocks = pieces(x)
        index[path] = {
            "shape": list(x.shape), "dtype": want.name,
            "pieces": [{"process": p.process, "start": list(p.start), "stop": list(p.stop),
                        "tensor": p.tensor_name(path)} for p, _ in blocks],
        }  # fmt: skip
        local = {s.device: s for s in getattr(x, "addressable_shards", ())}
        for piece, device in blocks:
            if piece.process != me:
                continue
            data = x if device is None else local[device].data

            def load(data: Any = data, want: np.dtype = want) -> np.ndarray:
                return np.asarray(data).astype(want, copy=False)

            tensors[piece.tensor_name(path)] = LazyTensor(
                tuple(b - a for a, b in zip(piece.start, piece.stop, strict=True)), want, load
            )
    save_tensors(tensors, directory, prefix=file_prefix(kind, me))
    return index


def write_index(directory: Path, sections: Mapping[str, Any]) -> None:
    """``shards.json``: the process count and every section's arrays and pieces."""
    write_json_atomic(directory / INDEX_NAME,
                      {"process_count": jax.process_count(), **sections})  # fmt: skip


class StoredArrays:
    """The arrays of one section (``kind``) of a sharded checkpoint, read block by block
    across the processes' files (a context manager: closes the files). ``arrays`` is the
    section of ``shards.json``: path -> shape, dtype, pieces."""

    def __init__(self, checkpoint: Path, kind: str) -> None:
        index = read_json(checkpoint / INDEX_NAME, what="sharded checkpoint index")
        if kind not in index:
            raise CheckpointError(f"{checkpoint / INDEX_NAME}: has no {kind!r} section")
        self.arrays: dict[str, Any] = index[kind]
        self.readers = [CheckpointReader(checkpoint, prefix=file_prefix(kind, p))
                        for p in range(int(index["process_count"]))]  # fmt: skip
        self._read: dict[str, np.ndarray] = {}  # the pieces of the array being filled

    def _piece(self, entry: Mapping[str, Any]) -> np.ndarray:
        name = entry["tensor"]
        if name not in self._read:
            self._read[name] = self.readers[entry["process"]].read(name)
        return self._read[name]

    def done(self) -> None:
        """Forget the pieces read so far (call between arrays: one array's worth at most)."""
        self._read.clear()

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> StoredArrays:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def block(self, path: str, start: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The stored array ``path``'s block of ``shape`` at ``start``, in its stored dtype."""
        out = np.empty(shape, np.dtype(self.arrays[path]["dtype"]))
        self.fill(path, start, out)
        return out

    def fill(self, path: str, start: tuple[int, ...], out: np.ndarray) -> None:
        """``out`` = the stored array ``path``'s block beginning at ``start``."""
        stop = tuple(a + n for a, n in zip(start, out.shape, strict=True))
        covered = 0
        for entry in self.arrays[path]["pieces"]:
            lo = [max(a, b) for a, b in zip(start, entry["start"], strict=True)]
            hi = [min(a, b) for a, b in zip(stop, entry["stop"], strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self._piece(entry)
            source = tuple(
                slice(a - s, b - s) for a, b, s in zip(lo, hi, entry["start"], strict=True)
            )
            dest = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))
            out[dest] = data[source]
            covered += int(np.prod([b - a for a, b in zip(lo, hi, strict=True)]))
        if covered != out.size:
            raise CheckpointError(f"sharded checkpoint: the pieces of {path!r} cover "
                                  f"{covered} of the {out.size} values asked for")  # fmt: skip


def _check_targets(where: str, stored: Mapping[str, Any], targets: Mapping[str, Any]) -> None:
    kinds = [f"  {p}: expected {np.dtype(t.dtype)} vs stored {stored[p]['dtype']}"
             for p, t in targets.items() if p in stored
             and jnp.issubdtype(t.dtype, jnp.inexact)
             != jnp.issubdtype(np.dtype(stored[p]["dtype"]), jnp.inexact)]  # fmt: skip
    missing = sorted(set(targets) - set(stored))
    unexpected = sorted(set(stored) - set(targets))
    shapes = [f"  {p}: expected {tuple(t.shape)} vs stored {tuple(stored[p]['shape'])}"
              for p, t in targets.items()
              if p in stored and tuple(t.shape) != tuple(stored[p]["shape"])]  # fmt: skip
    if missing or unexpected or shapes or kinds:
        lines = [*(f"  missing: {p}" for p in missing),
                 *(f"  unexpected: {p}" for p in unexpected), *shapes, *kinds]  # fmt: skip
        raise ValueError(f"{where}: the checkpoint does not fit (expected vs stored):\n"
                         + "\n".join(lines))  # fmt: skip


def read_pieces(checkpoint: Path, kind: str, targets: Mapping[str, Any]) -> dict[str, jax.Array]:
    """``kind``'s arrays placed as ``targets`` (array-likes: shape, dtype and, where they have
    one, sharding): each process reads only the blocks its own devices need, whatever mesh
    and process count wrote them. Checked against ``targets`` before any data is read."""
    stored = StoredArrays(checkpoint, kind)
    try:
        _check_targets(f"checkpoint {checkpoint} ({kind})", stored.arrays, targets)
        out = {}
        for path, target in targets.items():
            dtype = np.dtype(target.dtype)
            shape = tuple(target.shape)
            sharding = getattr(target, "sharding", None)
            if sharding is None:
                buffer = np.empty(shape, dtype)
                stored.fill(path, (0,) * len(shape), buffer)
                out[path] = jax.device_put(buffer)
                stored.done()
                continue
            blocks = []
            for device, index in sharding.addressable_devices_indices_map(shape).items():
                start, stop = _bounds(index, shape)
                buffer = np.empty([b - a for a, b in zip(start, stop, strict=True)], dtype)
                stored.fill(path, start, buffer)
                blocks.append(jax.device_put(buffer, device))
            out[path] = jax.make_array_from_single_device_arrays(shape, sharding, blocks)
            stored.done()
    finally:
        stored.close()
    return out
