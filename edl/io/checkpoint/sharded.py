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

Every reader takes the index through :func:`edl.io.checkpoint.shard_index.read_index`, which checks
all of it before a value is read (field types, process ids, bounds, each piece's tensor
name, the pieces of every array tiling it exactly) and raises ``CheckpointError`` naming
``shards.json`` and the entry; opening a section (:class:`StoredArrays`) also checks every
piece file's header against the index.

Why not orbax-checkpoint: its files are OCDBT / Zarr through tensorstore, and edl keeps its
files safetensors + JSON, readable by anything that reads safetensors; the pieces and an
index are all a multi-process checkpoint needs. Every piece is written by exactly one
process (of an array replicated over devices, the first device in device-id order holding
that region), so nothing is gathered to one host and nothing is written twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from edl.io.checkpoint.shard_index import (
    INDEX_NAME,
    KINDS,
    Piece,
    ShardIndex,
    StoredArray,
    file_prefix,
    missing_file,
    read_index,
)
from edl.io.formats.files import write_json_atomic
from edl.io.formats.safetensors import CheckpointError, CheckpointReader, LazyTensor, save_tensors

__all__ = [  # the index's names too: edl.io.checkpoint.sharded is the module the rest of edl uses
    "INDEX_NAME",
    "KINDS",
    "Piece",
    "ShardIndex",
    "StoredArray",
    "StoredArrays",
    "file_prefix",
    "missing_file",
    "pieces",
    "read_index",
    "read_pieces",
    "verify_pieces",
    "write_index",
    "write_pieces",
]


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
    for device, index in sorted(
        sharding.devices_indices_map(shape).items(), key=lambda item: item[0].id
    ):
        by_region.setdefault(_bounds(index, shape), device)
    return [(Piece(d.process_index, *region), d) for region, d in sorted(by_region.items())]


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
            "shape": list(x.shape),
            "dtype": want.name,
            "pieces": [
                {
                    "process": p.process,
                    "start": list(p.start),
                    "stop": list(p.stop),
                    "tensor": p.tensor_name(path),
                }
                for p, _ in blocks
            ],
        }
        local = {s.device: s for s in getattr(x, "addressable_shards", ())}
        for piece, device in blocks:
            if piece.process != me:
                continue
            data = x if device is None else local[device].data

            def load(data: Any = data, want: np.dtype = want) -> np.ndarray:
                return np.asarray(data).astype(want, copy=False)

            tensors[piece.tensor_name(path)] = LazyTensor(piece.shape, want, load)
    save_tensors(tensors, directory, prefix=file_prefix(kind, me))
    return index


def write_index(directory: Path, sections: Mapping[str, Any]) -> None:
    """``shards.json``: the process count and every section's arrays and pieces."""
    write_json_atomic(directory / INDEX_NAME, {"process_count": jax.process_count(), **sections})


def _open_files(checkpoint: Path, index: ShardIndex, kind: str) -> list[CheckpointReader]:
    """Every process's piece file of ``kind``, its header checked against the index: each
    piece's tensor present with the recorded shape and dtype (no tensor data is read)."""
    arrays = index.section(kind)
    readers: list[CheckpointReader] = []
    try:
        for process in range(index.process_count):
            readers.append(CheckpointReader(checkpoint, prefix=file_prefix(kind, process)))
        for path, array in arrays.items():
            for i, piece in enumerate(array.pieces):
                reader, name = readers[piece.process], piece.tensor_name(path)
                want = f"{array.dtype.name} {list(piece.shape)}"
                got = reader.info(name) if name in reader else None
                if got is None or (got.dtype, got.shape) != (array.dtype, piece.shape):
                    actual = "none" if got is None else f"{got.dtype.name} {list(got.shape)}"
                    raise CheckpointError(
                        f"{reader.path}: tensor {name!r} ({index.path.name}'s "
                        f"{kind}[{path!r}].pieces[{i}]): expected {want}, got {actual}"
                    )
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers


def verify_pieces(checkpoint: Path, kinds: Sequence[str]) -> ShardIndex:
    """Check a sharded checkpoint without reading tensor data: its index
    (:func:`read_index`) holds every kind of ``kinds``, and every process's file of each
    holds its pieces with the recorded shapes and dtypes. Returns the index."""
    index = read_index(checkpoint)
    for kind in kinds:
        for reader in _open_files(checkpoint, index, kind):
            reader.close()
    return index


class StoredArrays:
    """The arrays of one section (``kind``) of a sharded checkpoint, read block by block
    across the processes' files (a context manager: closes the files). ``arrays`` is the
    validated section of ``shards.json`` (:func:`read_index`): path -> :class:`StoredArray`;
    every file's header is checked against it on opening."""

    def __init__(self, checkpoint: Path, kind: str) -> None:
        index = read_index(checkpoint)
        self.arrays: Mapping[str, StoredArray] = index.section(kind)
        self.readers = _open_files(checkpoint, index, kind)
        self._read: dict[str, np.ndarray] = {}  # the pieces of the array being filled

    def _piece(self, path: str, piece: Piece) -> np.ndarray:
        name = piece.tensor_name(path)
        if name not in self._read:
            self._read[name] = self.readers[piece.process].read(name)
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
        out = np.empty(shape, self.arrays[path].dtype)
        self.fill(path, start, out)
        return out

    def fill(self, path: str, start: tuple[int, ...], out: np.ndarray) -> None:
        """``out`` = the stored array ``path``'s block beginning at ``start``."""
        stop = tuple(a + n for a, n in zip(start, out.shape, strict=True))
        covered = 0
        for piece in self.arrays[path].pieces:
            lo = [max(a, b) for a, b in zip(start, piece.start, strict=True)]
            hi = [min(a, b) for a, b in zip(stop, piece.stop, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self._piece(path, piece)
            source = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, piece.start, strict=True))
            dest = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))
            out[dest] = data[source]
            covered += int(np.prod([b - a for a, b in zip(lo, hi, strict=True)]))
        if covered != out.size:
            raise CheckpointError(
                f"sharded checkpoint: the pieces of {path!r} cover "
                f"{covered} of the {out.size} values asked for"
            )


def _check_targets(
    where: str, stored: Mapping[str, StoredArray], targets: Mapping[str, Any]
) -> None:
    both = [p for p in targets if p in stored]
    kinds = [
        f"  {p}: expected {np.dtype(targets[p].dtype)} vs stored {stored[p].dtype}"
        for p in both
        if jnp.issubdtype(targets[p].dtype, jnp.inexact)
        != jnp.issubdtype(stored[p].dtype, jnp.inexact)
    ]
    shapes = [
        f"  {p}: expected {tuple(targets[p].shape)} vs stored {stored[p].shape}"
        for p in both
        if tuple(targets[p].shape) != stored[p].shape
    ]
    lines = [
        *(f"  missing: {p}" for p in sorted(set(targets) - set(stored))),
        *(f"  unexpected: {p}" for p in sorted(set(stored) - set(targets))),
        *shapes,
        *kinds,
    ]
    if lines:
        raise ValueError(
            f"{where}: the checkpoint does not fit (expected vs stored):\n" + "\n".join(lines)
        )


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
