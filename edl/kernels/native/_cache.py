"""The native kernels' library cache: a private directory whose libraries are written
atomically, each with a JSON record of its SHA-256 and build key, verified before anything
loads it (``dlopen`` of a truncated library dies of SIGBUS; hashing it first does not).

Temporary files are named ``.build-<host>-<pid>-<random><suffix>``, so a later build can
tell a killed build's leftovers (its process is gone, or it is over an hour old) from a
concurrent process's build in progress."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

TEMP_PREFIX = ".build-"
ORPHAN_AGE_S = 3600.0  # a build takes seconds; a temporary this old is a leftover anywhere
_TEMP_NAME = re.compile(r"\.build-(?P<host>[A-Za-z0-9._]*)-(?P<pid>\d+)-")


class UnsafeCacheError(RuntimeError):
    """A cache directory or file that another user could have written; the message names it."""


def _user() -> int:
    """This process's user id (one function, so tests can pretend to be someone else)."""
    if not hasattr(os, "getuid"):  # not POSIX: no owner to compare, so nothing is trusted
        raise UnsafeCacheError("cannot check who owns the kernel cache on this system")
    return os.getuid()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def check_private(path: Path, what: str) -> None:
    """Raise ``UnsafeCacheError`` naming ``path`` (a ``what``) unless this user owns it and
    neither its group nor others can write it."""
    info = os.stat(path)
    if info.st_uid != _user():
        raise UnsafeCacheError(
            f"refusing the {what} {path}: owned by uid {info.st_uid}, not by this user "
            f"(uid {_user()}); anyone who can write it can plant code that edl would load"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(
            f"refusing the {what} {path}: writable by its group or others (mode "
            f"{stat.S_IMODE(info.st_mode):#o}); make it private (chmod go-w) or remove it"
        )


def private_dir(path: Path) -> Path:
    """``path``, created with any missing parents as private directories (0700), then checked
    with :func:`check_private`."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)  # exist_ok: another process may race us
    if not path.is_dir():
        raise RuntimeError(f"the kernel cache {path} is not a directory")
    check_private(path, "kernel cache directory")
    return path


def sha256(path: Path) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():  # some systems cannot fsync a directory; files must sync
            raise
    finally:
        os.close(fd)


def temporary(directory: Path, suffix: str) -> Path:
    """A new empty private file in ``directory`` named for this host and process."""
    prefix = f"{TEMP_PREFIX}{_host()}-{os.getpid()}-"
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(name)


def commit(tmp: Path, target: Path, mode: int) -> None:
    """Give ``tmp`` ``mode``, flush it to disk, rename it onto ``target`` and flush the
    directory: readers see the old file or the whole new one, also after a crash."""
    os.chmod(tmp, mode)
    _fsync(tmp)
    os.replace(tmp, target)
    _fsync(target.parent)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON to ``path`` atomically (private, 0600)."""
    tmp = temporary(path.parent, ".json")
    try:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        commit(tmp, path, 0o600)
    finally:
        tmp.unlink(missing_ok=True)


def problem(library: Path, record: Path, key: str) -> str | None:
    """Why the existing ``library`` cannot be loaded as the build ``key`` that ``record``
    describes, or None when it can: the record is missing, unreadable or for another key, or
    the library's SHA-256 differs from the recorded one. Raises ``UnsafeCacheError`` for a
    library or record another user could have written (see :func:`check_private`)."""
    if not record.exists():
        return f"it has no record {record.name}"
    check_private(library, "kernel library")
    check_private(record, "kernel library record")
    try:
        data = json.loads(record.read_text())
    except ValueError as error:  # UnicodeDecodeError included
        return f"its record {record.name} is not JSON ({error})"
    if not isinstance(data, dict) or data.get("key") != key:
        recorded = data.get("key") if isinstance(data, dict) else data
        return f"its record {record.name} is for build key {recorded!r}, not {key!r}"
    digest = sha256(library)
    if data.get("sha256") != digest:
        return (
            f"its SHA-256 {digest} differs from the {data.get('sha256')!r} recorded in "
            f"{record.name} (a truncated or replaced file)"
        )
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def clean_orphans(directory: Path, *, max_age_s: float = ORPHAN_AGE_S) -> list[Path]:
    """Remove temporary builds in ``directory`` that no process is still writing: those of
    this host whose process is gone, and any older than ``max_age_s`` (other hosts sharing
    the directory, names of other versions). Returns the removed paths."""
    removed, now = [], time.time()
    for path in directory.glob(f"{TEMP_PREFIX}*"):
        match = _TEMP_NAME.match(path.name)
        try:
            age = now - path.lstat().st_mtime
        except FileNotFoundError:
            continue  # its build finished or another process cleaned it meanwhile
        dead = match is not None and match["host"] == _host() and not _alive(int(match["pid"]))
        if dead or age > max_age_s:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed
