"""Atomic file writes: a temporary file next to the target, fsync'd, then ``os.replace``.

A reader never sees a half-written file, and a write killed midway leaves the previous
file in place. Files get the permissions a plain ``open`` would give (``0o666`` less the
umask), unlike ``tempfile.mkstemp``'s owner-only ``0o600``.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_file", "write_json_atomic", "write_text_atomic"]


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


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented, key-sorted JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
