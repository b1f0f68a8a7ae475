"""The directory of a run's checkpoints: ``checkpoint-N`` names, which are complete
(``state.json`` is written last), listing, atomic replacement of a re-saved step and pruning;
and what a checkpoint's ``state.json`` says: :func:`check_named_files`, which keeps the files
it names inside the checkpoint, :func:`verify_checkpoint`, which checks them whole, and
:func:`read_manifest`, the model it holds. Saving and loading a checkpoint is
:mod:`edl.io.checkpoint.train_state`'s."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edl.io.checkpoint.shard_index import KINDS, missing_file
from edl.io.checkpoint.sharded import verify_pieces
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.files import fsync, inside, read_json
from edl.io.formats.hf import CONFIG_NAME, load_config
from edl.io.formats.manifest import Manifest
from edl.io.formats.safetensors import CheckpointError, CheckpointReader

__all__ = [
    "STATE_NAME",
    "check_named_files",
    "latest_checkpoint",
    "list_checkpoints",
    "read_manifest",
    "verify_checkpoint",
]

logger = logging.getLogger("edl")

STATE_NAME = "state.json"
"""The file that marks a checkpoint complete (written last)."""

_PREFIX_LISTS = ("model_files", "optimizer_files")  # safetensors prefixes
_FILE_LISTS = ("tokenizer_files",)  # file names
_SUFFIXES = (".safetensors", ".safetensors.index.json")  # what a prefix names
_NAME = re.compile(r"checkpoint-(\d+)(\.old)?")
_OLD = ".old"  # step N's previous checkpoint while a re-save of step N replaces it
_TMP = ".tmp-checkpoint-"
_MODEL, _OPTIMIZER = KINDS  # the model's and the optimizer state's safetensors prefixes

# -- small file-system helpers -------------------------------------------------------------


def _remove(path: Path) -> None:
    """Delete ``path``; a checkpoint is first renamed away so it is never seen half-deleted."""
    try:
        if path.is_dir() and not path.name.startswith(_TMP):
            doomed = path.with_name(f"{_TMP}{path.name}-{uuid.uuid4().hex[:8]}-old")
            os.replace(path, doomed)
            path = doomed
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as e:
        logger.warning("checkpoint: could not delete %s: %s", path, e)


def _read_info(checkpoint: Path) -> dict[str, Any] | None:
    """``state.json`` of ``checkpoint`` if it exists and parses, else ``None``."""
    try:
        info = json.loads((checkpoint / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(info, dict) and isinstance(info.get("step"), int) and "format" in info
    return info if ok else None


def check_named_files(checkpoint: Path, info: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``state.json`` (``info``) names a file outside it.

    Every entry of ``"model_files"`` and ``"optimizer_files"`` (safetensors prefixes: the
    prefix itself, then the ``.safetensors`` and ``.safetensors.index.json`` files it names)
    and of ``"tokenizer_files"`` must be a relative name that stays inside ``checkpoint``
    after resolving symlinks (``edl.io.formats.files.inside``): ``state.json`` is data, and one that
    named ``/home/me/.cache/huggingface/token`` or ``../../secret`` must not make edl read
    or export that file. Raises ``UnsafePathError`` (a ``ValueError``) naming ``state.json``
    and the entry (``tokenizer_files[2]``), or ``ValueError`` when a list is not a list.
    """
    source = checkpoint / STATE_NAME
    for key in (*_PREFIX_LISTS, *_FILE_LISTS):
        names = info.get(key, [])
        if not isinstance(names, list):
            raise ValueError(f"{source}: {key} must be a list of file names, got {names!r}")
        for i, name in enumerate(names):
            inside(checkpoint, name, source=source, entry=f"{key}[{i}]")
            if key in _PREFIX_LISTS:
                for suffix in _SUFFIXES:
                    inside(checkpoint, name + suffix, source=source, entry=f"{key}[{i}]'s file")


def _lacking(checkpoint: Path, info: dict[str, Any]) -> str | None:
    """What a checkpoint whose ``state.json`` parses still lacks: a sharded checkpoint's
    index or a process's piece file (existence checks only; ``verify_checkpoint`` reads the
    headers). ``None`` when nothing."""
    return missing_file(checkpoint) if info.get("model_format") == "sharded" else None


def _complete(checkpoint: Path) -> bool:
    info = _read_info(checkpoint)
    return info is not None and _lacking(checkpoint, info) is None


def _step_of(path: Path) -> int:
    m = _NAME.fullmatch(path.name)
    assert m is not None
    return int(m.group(1))


def _named_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()]


# -- public: finding checkpoints -----------------------------------------------------------


def _superseded(path: Path) -> bool:
    """``checkpoint-N.old`` once a complete ``checkpoint-N`` has replaced it."""
    if not path.name.endswith(_OLD):
        return False
    return _complete(path.with_name(path.name.removesuffix(_OLD)))


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints under ``directory``, oldest (lowest step) first.

    Temporary directories and checkpoints without a readable ``state.json`` are skipped, and
    so (with a logged warning) are sharded checkpoints missing their ``shards.json`` or a
    process's piece file. A ``checkpoint-N.old`` (step N's previous save, left by a re-save
    of step N that was killed) counts unless a complete ``checkpoint-N`` exists. A missing
    ``directory`` gives ``[]``."""
    found = []
    for path in _named_dirs(Path(directory)):
        info = _read_info(path)
        if info is None or _superseded(path):
            continue
        lacking = _lacking(path, info)
        if lacking is not None:
            logger.warning("checkpoint: skipping %s, which is incomplete: %s", path, lacking)
            continue
        found.append(path)
    return sorted(found, key=lambda p: (_step_of(p), p.name))


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``directory`` (highest step), or ``None``."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _replace_atomically(new: Path, final: Path) -> None:
    """Move the complete checkpoint ``new`` to ``final`` so that a complete checkpoint of
    that step exists at every instant: an existing ``final`` is first renamed to
    ``final.old`` (which :func:`list_checkpoints` counts until ``final`` is back)."""
    old = final.with_name(final.name + _OLD)
    if final.exists() and old.exists():
        # A re-save killed after its rename left both; keep whichever is complete.
        _remove(old if _complete(final) else final)
    if final.exists() or final.is_symlink():
        os.replace(final, old)
        fsync(final.parent)
    try:
        os.replace(new, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    fsync(final.parent)
    if old.exists():
        _remove(old)


def _prune(root: Path, current: Path, keep: int | None) -> None:
    complete = []
    for path in _named_dirs(root):
        if path == current:
            continue
        info = _read_info(path)
        if info is None:
            logger.warning("checkpoint: deleting incomplete checkpoint %s", path)
            _remove(path)
        elif _superseded(path):
            _remove(path)
        elif (lacking := _lacking(path, info)) is not None:
            # Saves never leave this (state.json comes last): a damaged checkpoint, kept for
            # whoever can repair it, but not counted toward ``keep``.
            logger.warning("checkpoint: keeping damaged checkpoint %s: %s", path, lacking)
        else:
            complete.append(path)
    for path in root.iterdir():
        if path.name.startswith(_TMP):
            _remove(path)
    if keep is not None:
        complete.sort(key=_step_of, reverse=True)
        for path in complete[keep - 1 :]:
            _remove(path)
    fsync(root)


# -- a checkpoint's contents -----------------------------------------------------------


def verify_checkpoint(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that a checkpoint's files are whole, without reading tensor data; return its
    ``state.json``.

    ``state.json`` (and a HF-layout model's ``config.json``, and its manifest) must parse,
    the files it names
    stay inside the checkpoint (``check_named_files``), and every safetensors file must be
    present with a valid header and exactly the length that header promises (a sharded
    file's index must name existing shards, inside, holding its tensors). A sharded
    checkpoint's ``shards.json`` must be valid (``edl.io.checkpoint.shard_index.read_index``)
    and every process's piece file present, holding each piece with the recorded shape and
    dtype.
    Raises ``CheckpointError`` naming the file (and entry) and what is wrong. Values are not
    checksummed: a flipped bit inside tensor data passes.
    """
    path = Path(checkpoint)
    info = _read_info(path)
    if info is None:
        try:
            read_json(path / STATE_NAME, what="checkpoint state")
        except (OSError, ValueError) as e:
            raise CheckpointError(str(e)) from None
        raise CheckpointError(f"{path / STATE_NAME}: lacks an integer 'step' or a 'format'")
    try:
        check_named_files(path, info)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    prefixes = [*info.get("model_files", [_MODEL])]
    if info.get("has_optimizer"):
        prefixes += info.get("optimizer_files", [_OPTIMIZER])
    if info.get("model_format") == "sharded":  # the index, and every piece in its file
        kinds = (_MODEL, _OPTIMIZER) if info.get("has_optimizer") else (_MODEL,)
        verify_pieces(path, kinds)
    for prefix in prefixes:
        with CheckpointReader(path, prefix=prefix):
            pass  # opening validates every header against its file's length
    try:
        if info.get("model_format") == "hf":
            read_json(path / CONFIG_NAME, what="model config")
        if "manifest" in info:
            read_manifest(path, info)
        if "base" in info:  # an adapter-only checkpoint's reference: checked, not followed
            BaseReference.from_json(info["base"], where=str(path / STATE_NAME))
    except (OSError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    return info


def read_manifest(checkpoint: Path, info: Mapping[str, Any]) -> Manifest:
    """The manifest of the model in ``checkpoint`` (``info``: its ``state.json``): the one
    ``state.json`` holds, or, for a checkpoint written before manifests, the one its
    ``config.json`` (a Hugging Face-layout model, or a sharded one with a config) and
    ``"layers"`` say, as they were read then. ``ValueError`` / ``FileNotFoundError`` name
    the file."""
    state = checkpoint / STATE_NAME
    if "manifest" in info:
        return Manifest.from_json(info["manifest"], where=f"{state}: manifest")
    layers = info.get("layers") or {}
    model_format = info.get("model_format")
    if model_format == "hf" or (model_format == "sharded" and (checkpoint / CONFIG_NAME).is_file()):
        return Manifest.from_hf_config(load_config(checkpoint), layers, where=f"{state} 'layers'")
    return Manifest(None, None, None, None, None, layers)
