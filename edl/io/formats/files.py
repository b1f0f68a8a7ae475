"""edl's small files: atomic writes, and JSON objects read with errors that name the file.

Writes go to a temporary file next to the target, fsync'd, then ``os.replace``: a reader
never sees a half-written file, and a write killed midway leaves the previous file in
place. Files get the permissions a plain ``open`` would give (``0o666`` less the umask),
unlike ``tempfile.mkstemp``'s owner-only ``0o600``.

``json.load`` reports a broken file as ``Expecting ',' delimiter: line 3 column 5 (char
41)``, without saying which file, and returns lists or numbers as happily as objects. Every
JSON file edl reads (``config.json``, ``adapter_config.json``, ``state.json``) goes through
:func:`read_json` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

__all__ = [
    "UnsafePathError",
    "atomic_file",
    "inside",
    "read_json",
    "write_chunked",
    "write_json_atomic",
    "write_share",
    "write_text_atomic",
]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary file object writing to a temporary next to ``path``, moved there when the
    block ends without an exception (else the temporary is deleted)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
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


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file, or a directory's entries, to disk (directories: where the OS can)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not path.is_dir():
            raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented, key-sorted JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(
    path: str | os.PathLike[str], *, what: str = "JSON file", unique_keys: bool = False
) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises ``ValueError`` naming ``path`` (and ``what`` it is, e.g. ``"model config"``)
    when the file is not UTF-8 text, not valid JSON (with the line and column of the
    error) or holds something other than an object at the top level; with
    ``unique_keys``, also when an object holds a key twice (``json`` keeps the last one
    silently: for edl's own files, which never repeat a key, a repeat is tampering). A
    missing or unreadable file raises the ``OSError`` from opening it, which names the path.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {what} is not UTF-8 text ({e})") from e

    def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in pairs:
            if key in data:
                raise ValueError(f"{path}: {what} holds the key {key!r} twice")
            data[key] = value
        return data

    try:
        data = json.loads(text, object_pairs_hook=once if unique_keys else None)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: {what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: {what} must hold a JSON object at the top level, got {_json_type(data)}"
        )
    return data


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    names = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return f"the number {value!r}" if isinstance(value, int | float) else type(value).__name__


class UnsafePathError(ValueError):
    """A path read from a file's metadata that leaves its directory."""


def inside(
    directory: str | os.PathLike[str],
    name: object,
    *,
    source: str | os.PathLike[str],
    entry: str,
) -> Path:
    """``directory / name`` for a ``name`` read from metadata (``source``, at ``entry``, e.g.
    ``state.json``'s ``tokenizer_files[2]``), checked to stay inside ``directory``.

    ``name`` must be a non-empty relative POSIX path without ``.`` / ``..`` components,
    backslashes, drive letters or NUL bytes, and the path it names, after resolving every
    symlink, must lie inside ``directory`` (also resolved). The file need not exist. Raises
    :class:`UnsafePathError` (a ``ValueError``) naming ``source``, ``entry`` and the value.
    Metadata is data an attacker may have written: a checkpoint or export that named
    ``/home/me/.cache/huggingface/token`` or ``../../secret`` must not make edl read, copy or
    publish that file.
    """

    def refuse(why: str) -> UnsafePathError:
        return UnsafePathError(
            f"{source}: {entry} = {name!r} {why}; a file named by metadata must be a "
            f"relative name inside {directory}"
        )

    if not isinstance(name, str) or not name:
        raise refuse("is not a non-empty string")
    if "\\" in name or "\0" in name or ":" in name.split("/", 1)[0]:
        raise refuse("holds a backslash, a NUL byte or a drive")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise refuse("is absolute or has an empty, '.' or '..' component")
    root = Path(directory).resolve()
    target = (root / name).resolve()
    if target != root and root not in target.parents:
        raise refuse(f"resolves to {target}, outside the directory")
    return Path(directory) / name


_pacing = threading.local()
WRITE_CHUNK = 8 * 2**20  # bytes per write call when pacing


@contextlib.contextmanager
def write_share(share: float) -> Iterator[None]:
    """Within the block, this thread's large writes (``write_chunked``: the safetensors
    writer's tensor data) take at most ``share`` of its wall time: after each chunk it
    sleeps ``1 / share - 1`` times as long as the chunk took. A background checkpoint so
    leaves the cores and memory bandwidth to the training step most of the time, at the
    price of taking ``1 / share`` times as long (``benchmarks/RESULTS.md``, "train:
    checkpoints written in the background")."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"write_share: share must be in (0, 1], got {share!r}")
    previous = getattr(_pacing, "share", 1.0)
    _pacing.share = share
    try:
        yield
    finally:
        _pacing.share = previous


def write_chunked(f: IO[bytes], data: memoryview) -> None:
    """``f.write(data)``, paced by the calling thread's ``write_share``."""
    share = getattr(_pacing, "share", 1.0)
    if share >= 1.0:
        f.write(data)
        return
    data = data.cast("B")
    for start in range(0, len(data), WRITE_CHUNK):
        began = time.perf_counter()
        f.write(data[start : start + WRITE_CHUNK])
        time.sleep((time.perf_counter() - began) * (1.0 / share - 1.0))
