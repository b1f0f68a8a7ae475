"""``CheckpointReader``: validated headers up front, then one tensor at a time by
positioned reads, optionally straight into a preallocated buffer."""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edl.io.formats.files import UnsafePathError, inside
from edl.io.formats.safetensors.format import (
    CheckpointError,
    MissingTensorError,
    StrPath,
    TensorInfo,
    _read_header,
    _read_index,
    byte_view,
)


def _pread_into(fd: int, view: memoryview, offset: int, lock: threading.Lock) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    with lock:  # no positioned reads (Windows): seek + read, serialised
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def _shard(index: Path, name: str, key: str) -> Path:
    """The shard ``name`` that ``index``'s ``weight_map[key]`` names, checked to stay inside
    the index's directory after resolving symlinks (``edl.io.formats.files.inside``): a checkpoint
    whose shard links to ``~/.cache/huggingface/token`` must not be read as its weights. An
    index that is a link (the Hugging Face cache's snapshots) may name shards that resolve
    beside the file it links to."""
    try:
        return inside(index.parent, name, source=index, entry=f"weight_map[{key!r}]")
    except UnsafePathError as e:
        shard = index.parent / name
        if index.is_symlink() and index.resolve().parent in shard.resolve().parents:
            return shard
        raise CheckpointError(str(e)) from None


class CheckpointReader:
    """Random access to the tensors of a safetensors checkpoint, one tensor at a time.

    ``path`` is a directory holding ``{prefix}.safetensors`` or
    ``{prefix}.safetensors.index.json`` (the single file wins if both exist, as in
    transformers), a ``.safetensors`` file, or an index ``.json``. Every header is parsed and
    validated on open; data is read only by ``read``/``read_into``, with positioned reads that
    are safe to issue from several threads. Use as a context manager (or call ``close``) to
    release the file descriptors.

    Shard files must lie next to the index and, after resolving symlinks, inside its directory
    (or, for an index that is itself a link, inside the directory it resolves into: the
    Hugging Face cache links each file of a snapshot to its ``blobs/`` folder); a
    ``weight_map`` entry that leads elsewhere raises ``CheckpointError`` naming the index and
    the entry. Tensors a shard holds but the index does not list are still served. ``keys()``
    is in on-disk order (file, then offset), the order that reads the files sequentially.
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
            files = [_shard(p, fname, by_file[fname][0]) for fname in sorted(by_file)]
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
        self._read_bytes(info, byte_view(out))
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
            self._read_bytes(info, byte_view(out))
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
