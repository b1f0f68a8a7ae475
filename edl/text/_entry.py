"""A tokenized-cache entry's files (:mod:`edl.text.dataset`): written atomically with the
SHA-256 of each array, checked when read.

An entry is checked, not trusted: reading one hashes every array and bounds every token id
by the tokenizer's vocabulary, so a bit flip, a cut or edited file, or ids the model has no
embedding row for (NaN or wrong embeddings later) are caught before training. The check
reads each array once, ``CHUNK`` rows at a time (bounded memory), and grows with the
tokens: for 10M tokens with labels (80 MB, page-cached) it took 51 ms on a 2-core x86 host
with SHA extensions, against 33 ms to read the two arrays whole and about 1 ms for an open
without it (which read only the offsets); about 5 s per billion tokens, on the order of
reading them cold and nothing beside tokenizing them again. SHA-256 rather than BLAKE2b: with the
SHA instructions of current x86 and ARM servers it is the faster of the two in hashlib
(there, 2.0 vs 1.1 GB/s), and it is the hash of the cache's keys.

Writes go to a temporary name, fsync'd and moved into place (``os.replace``), the JSON
last. ``edl.io.formats.files.atomic_file`` does this for a file object, but safetensors writes to a
path, and importing ``edl.io`` imports jax, which ``edl.text`` does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edl.text.sft import IGNORE_INDEX

CHECKSUM = "sha256"
CHUNK = 1 << 20  # rows per read while checking an entry (4 MiB of ids)
# The arrays holding token ids, and the one value outside the vocabulary each may hold.
TOKEN_ARRAYS: dict[str, int | None] = {"input_ids": None, "labels": IGNORE_INDEX}


def checksum(array: np.ndarray) -> str:
    """``"sha256:<hex>"`` of ``array``'s bytes as safetensors stores them (C order,
    little-endian)."""
    return f"{CHECKSUM}:{hashlib.new(CHECKSUM, _stored_bytes(array)).hexdigest()}"


def _stored_bytes(array: np.ndarray) -> np.ndarray:
    """``array`` laid out as in a safetensors file (a no-op on little-endian hosts)."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def outside_vocab(ids: np.ndarray, vocab_size: int, allowed: int | None) -> int | None:
    """The index of the first of ``ids`` outside ``[0, vocab_size)`` other than
    ``allowed`` (labels' ignore index), or None."""
    if ids.size == 0:
        return None
    # The common case, all in range, in a few fast passes (counting, not masking, past -100).
    negatives = 0 if ids.min() >= 0 else np.count_nonzero(ids < 0)
    if allowed is not None and negatives:
        negatives -= np.count_nonzero(ids == allowed)
    if not negatives and ids.max() < vocab_size:
        return None
    bad = (ids < 0) | (ids >= vocab_size)
    if allowed is not None:
        bad &= ids != allowed
    return int(np.flatnonzero(bad)[0])


def check_arrays(handle: Any, path: Path, recorded: object, vocab_size: int | None) -> None:
    """Hash each array of the open safetensors ``handle`` (the entry ``path``) against
    ``recorded`` (its JSON's ``checksums``) and bound its token ids by ``vocab_size`` (None:
    unbounded), a chunk of rows at a time; ``ValueError`` naming ``path``, the array and
    what differs."""
    names = sorted(handle.keys())
    if not isinstance(recorded, dict) or sorted(recorded) != names:
        raise ValueError(
            f"{path.with_suffix('.json')}: checksums {recorded!r}, expected one for each of {names}"
        )
    for name in names:
        tensor = handle.get_slice(name)
        rows = tensor.get_shape()[0]
        digest = hashlib.new(CHECKSUM)
        for start in range(0, rows, CHUNK):
            chunk = tensor[start : min(rows, start + CHUNK)]
            digest.update(_stored_bytes(chunk))
            if vocab_size is not None and name in TOKEN_ARRAYS:
                at = outside_vocab(chunk, vocab_size, TOKEN_ARRAYS[name])
                if at is not None:
                    raise ValueError(
                        f"{path}: {name}[{start + at}] = {int(chunk[at])} is outside the "
                        f"vocabulary [0, {vocab_size})"
                    )
        found = f"{CHECKSUM}:{digest.hexdigest()}"
        if found != recorded[name]:
            raise ValueError(
                f"{path}: {name} hashes to {found}, but its JSON records {recorded[name]} "
                "(the file changed after it was written)"
            )


def write_entry(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], path: Path) -> None:
    """Write ``arrays`` to ``path`` and ``meta`` with their ``checksums`` to its ``.json``,
    each atomically, the JSON last. When a write fails (``OSError``, safetensors'
    ``SafetensorError``) it raises that error with no temporary file left and the entry's
    files removed (a partial entry would be rebuilt anyway; this frees the space)."""
    from safetensors.numpy import save_file

    checksums = {name: checksum(array) for name, array in arrays.items()}
    meta_text = json.dumps({**meta, "checksums": checksums}, indent=2, sort_keys=True) + "\n"
    meta_path = path.with_suffix(".json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, lambda tmp: save_file(dict(arrays), str(tmp)))
        _write_atomic(meta_path, lambda tmp: tmp.write_text(meta_text, encoding="utf-8"))
    except Exception:
        for target in (path, meta_path):
            with contextlib.suppress(OSError):  # the write's error is the one to report
                os.unlink(target)
        raise


def _write_atomic(target: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` to a temporary name beside ``target``, fsync'd and moved into place;
    the temporary is removed whatever happens."""
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
