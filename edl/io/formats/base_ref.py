"""The base model an adapter-only checkpoint was trained on: ``BaseReference``.

A LoRA / QLoRA checkpoint need not copy the base model it adapts: it records where the base
was loaded from and a content hash of its weights, and whoever loads the checkpoint finds the
base there and checks the hash (``edl.io.checkpoint.save_state(..., base=...)``,
``edl.io.export.load_model``)::

    ref = reference("HuggingFaceTB/SmolLM2-135M", dtype="float32")   # hashes the weights once
    ref.to_json()  # {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "<commit>",
                   #  "sha256": "...", "files": ["model.safetensors"], "dtype": "float32",
                   #  "quantization": null}

``source`` is the resolved absolute path of a local directory, or a hub repo id with the
commit the hub served (``revision``). The hash (:func:`hash_weights`) covers the weight
files the loader reads, not ``config.json`` or the tokenizer: the same weights under another
name or path are the same base, and one changed weight is another. For QLoRA the reference
is to the unquantized source, with ``quantization`` (``edl.quantize.QuantConfig``'s fields)
and ``dtype`` (what the weights were loaded in before quantizing): the codes are derived
from the base again on load, deterministically, and never saved.

A reference read back from ``state.json`` is data someone else may have written: it is
checked field by field (:meth:`BaseReference.from_json`), and where it leads is decided by
:func:`locate` alone: an absolute path is that directory; a path starting with ``./`` or
``../`` resolves against the checkpoint's own directory (never the working directory, which
differs between commands; edl itself writes absolute paths); anything else must be shaped
like a hub repo id (``edl._hub.repo_id_shaped``), and is fetched from the hub at
``revision``. Whatever is found is used only when its weights hash to ``sha256``
(:func:`verify`): a base that moved is found again by ``base=``, never by guessing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edl._hub import hub_offline, is_repo_id, no_such_path, offline_error, repo_id_shaped
from edl.io.formats import hf
from edl.io.formats.safetensors import CheckpointReader

__all__ = ["BaseReference", "hash_weights", "locate", "reference", "verify", "weight_files"]

WEIGHT_PREFIXES = ("model", "adapter_model", "quantized")
"""The safetensors prefixes a model directory's weights go by (``edl.io.model_files``):
the base, an embedded PEFT adapter, edl's quantized codes. Optimizer state is no weight."""
_SUFFIXES = (".safetensors", ".safetensors.index.json")  # what a safetensors prefix names
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REVISION = re.compile(r"[\w.\-/]{1,256}")
_CHUNK = 1 << 24
_hashes: dict[tuple, str] = {}  # by file identity: a base is hashed once per process


@dataclasses.dataclass(frozen=True)
class BaseReference:
    """Where an adapter-only checkpoint's base model is and what its weights hash to (module
    docstring). ``files``: the weight files hashed, by name (for messages)."""

    source: str
    sha256: str
    revision: str | None = None
    files: tuple[str, ...] = ()
    dtype: str | None = None
    quantization: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["files"] = list(self.files)
        out["quantization"] = None if self.quantization is None else dict(self.quantization)
        return out

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> BaseReference:
        """A reference from ``state.json``'s ``"base"`` (``where`` names it in errors),
        every field checked: ``ValueError`` naming the field and the value."""

        def bad(field: str, why: str) -> ValueError:
            value = data.get(field) if isinstance(data, dict) else data
            return ValueError(f"{where}: base {field} = {value!r} {why}")

        if not isinstance(data, dict):
            raise bad("reference", "must be a JSON object")
        source, sha, revision = data.get("source"), data.get("sha256"), data.get("revision")
        if not isinstance(source, str) or not source or "\0" in source or len(source) > 4096:
            raise bad("source", "must be a path or hub repo id")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise bad("sha256", "must be 64 lowercase hex digits")
        if revision is not None and not (
            isinstance(revision, str) and _REVISION.fullmatch(revision)
        ):
            raise bad("revision", "must be null or a hub revision")
        files = data.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise bad("files", "must be a list of file names")
        dtype = data.get("dtype")
        if dtype is not None and (
            not isinstance(dtype, str) or dtype not in {"float32", "float16", "bfloat16", "float64"}
        ):
            raise bad("dtype", "must be null or a floating dtype name")
        quantization = data.get("quantization")
        if quantization is not None and not isinstance(quantization, dict):
            raise bad("quantization", "must be null or an object of QuantConfig's fields")
        return cls(source, sha, revision, tuple(files), dtype, quantization)

    def describe(self) -> str:
        """``source`` (at ``revision``), for messages."""
        return self.source if self.revision is None else f"{self.source}@{self.revision}"


def weight_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a model directory, in the order hashed: for each prefix of
    :data:`WEIGHT_PREFIXES` it holds, its ``.safetensors`` file or its index and the shards
    the index names (each inside the directory, as ``CheckpointReader`` checks)."""
    directory = Path(directory)
    found = []
    for prefix in WEIGHT_PREFIXES:
        if not any((directory / f"{prefix}{s}").is_file() for s in _SUFFIXES):
            continue
        with CheckpointReader(directory, prefix=prefix) as reader:
            index = [reader.path] if reader.path.name.endswith(".json") else []
            found += [*index, *reader.files]
    if not found:
        raise FileNotFoundError(f"{directory}: holds no model weights (model.safetensors, ...)")
    return found


def hash_weights(directory: str | os.PathLike[str]) -> tuple[str, tuple[str, ...]]:
    """``(sha256 hex, file names)`` of :func:`weight_files`: for each file in turn, its name
    relative to ``directory`` (UTF-8), a NUL byte, its size (8 bytes, little-endian) and its
    bytes. What is hashed is what the loader reads as weights, so one changed weight, a
    missing shard or a renamed tensor all change it, and a copy of the same files elsewhere
    does not. Hashed once per process for files of unchanged size, mtime and inode."""
    directory = Path(directory)
    files = weight_files(directory)
    names = tuple(f.relative_to(directory).as_posix() for f in files)
    stats = [f.stat() for f in files]
    key = (str(directory.resolve()), *((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats))
    if key not in _hashes:
        digest = hashlib.sha256()
        for name, file, stat in zip(names, files, stats, strict=True):
            digest.update(name.encode() + b"\0" + int(stat.st_size).to_bytes(8, "little"))
            with open(file, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
        _hashes[key] = digest.hexdigest()
    return _hashes[key], names


def reference(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    dtype: Any = None,
    quantization: Mapping[str, Any] | None = None,
) -> BaseReference:
    """The reference to the base model at ``source`` (a local model directory, or a hub repo
    id, fetched like ``edl.from_pretrained``), with its weights hashed (:func:`hash_weights`).
    ``dtype``: what the base is loaded in; ``quantization``: the ``QuantConfig`` fields the
    run quantized it with (QLoRA), else ``None``."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_dir():
        directory, text = path.resolve(), str(path.resolve())
    elif is_repo_id(text):
        directory = hf.resolve_directory(text, revision=revision)
        if directory.parent.name == "snapshots":  # the hub cache names it by commit
            revision = directory.name
    else:
        raise no_such_path(text)
    sha, files = hash_weights(directory)
    name = None if dtype is None else np.dtype(dtype).name
    return BaseReference(text, sha, revision, files, name, quantization)


def locate(
    ref: BaseReference, checkpoint: Path, *, base: str | os.PathLike[str] | None = None
) -> Path:
    """The directory of ``ref``'s base for the checkpoint in ``checkpoint`` (module
    docstring: absolute path, ``./`` or ``../`` against ``checkpoint``, else a hub repo id
    at ``ref.revision``), or ``base`` when given (a directory or repo id holding the same
    weights elsewhere). A missing one raises ``FileNotFoundError`` in one line naming the
    reference and the checkpoint's ``state.json``. Not yet verified: :func:`verify`."""
    where = f"{checkpoint / 'state.json'}: base model {ref.describe()}"
    text = ref.source if base is None else os.fspath(base)
    path = Path(text).expanduser()
    if base is not None and path.is_dir():
        return path
    if base is None and (path.is_absolute() or text.startswith(("./", "../"))):
        path = path if path.is_absolute() else checkpoint / path
        if not path.is_dir():
            raise FileNotFoundError(
                f"{where}: no such directory {path}; put the base back there, or pass base= "
                f"(--base) naming a copy of it"
            )
        return path
    if not repo_id_shaped(text):
        raise FileNotFoundError(
            f"{where}: {text!r} is neither an absolute path, a ./ or ../ path, nor a hub repo id"
        )
    try:
        return _snapshot(text, ref.revision if base is None else None)
    except Exception as e:  # the hub's errors: no such repo, offline, no network
        raise FileNotFoundError(f"{where}: the hub could not serve {text}: {e}") from None


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """Hub repo ``repo_id`` at ``revision`` fetched as ``edl.from_pretrained`` fetches it
    (config + safetensors), whatever the working directory holds at that path; with
    ``HF_HUB_OFFLINE=1`` only the local cache is read, and a miss says so."""
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                local_files_only=offline,
                allow_patterns=["*.json", "*.safetensors"],
            )
        )
    except Exception as e:
        if offline:
            raise offline_error(repo_id) from e
        raise


def verify(ref: BaseReference, directory: Path, checkpoint: Path) -> None:
    """Refuse a base in ``directory`` whose weights do not hash to ``ref.sha256``: the
    ``ValueError`` names the reference, the expected and actual hashes and the checkpoint's
    ``state.json``."""
    actual, files = hash_weights(directory)
    if actual != ref.sha256:
        raise ValueError(
            f"{checkpoint / 'state.json'}: base model {ref.describe()} ({directory}) has "
            f"weights sha256 {actual} over {', '.join(files)}, but the checkpoint was trained "
            f"on sha256 {ref.sha256}; refusing a different base"
        )
