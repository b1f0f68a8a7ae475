"""Local path or Hugging Face Hub repo id: the one rule every ``--model`` / ``--data`` value
(and ``from_pretrained`` / ``load_tokenizer`` / ``hf_dataset``) goes by, and the hub's
offline switch.

A value is a hub repo id only when it is shaped like one (``"name"`` or ``"owner/name"``,
the characters ``huggingface_hub`` accepts), has no file extension (``nope.jsonl``), and
names nothing on disk. Everything else is a local path: a missing one fails at once with
:func:`no_such_path`, without a network round trip. Imports nothing heavy (no jax, no
``huggingface_hub``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "FILE_SUFFIXES",
    "hub_offline",
    "is_repo_id",
    "no_such_path",
    "offline_error",
    "repo_id_shaped",
]

# A hub repo id as huggingface_hub validates it: "name" or "namespace/name" of letters,
# digits, "-", "_", ".", neither part starting or ending with "-" or ".", no "--" or "..";
# so "." / ".." parts (relative paths), "/x", "~/x" and "a/b/c" never match.
_REPO_ID = re.compile(r"(?!.*(--|\.\.))\w([\w.-]*\w)?(/\w([\w.-]*\w)?)?")
_REPO_ID_MAX = 96

FILE_SUFFIXES = frozenset(
    (
        ".jsonl",
        ".json",
        ".txt",
        ".text",
        ".md",
        ".csv",
        ".tsv",
        ".parquet",
        ".arrow",
        ".gz",
        ".zst",
        ".bz2",
        ".xz",
        ".zip",
        ".tar",
        ".safetensors",
        ".bin",
        ".pt",
        ".npz",
        ".npy",
        ".toml",
        ".yaml",
        ".yml",
        ".py",
    )
)
"""File extensions that make a value a local path (``Qwen2.5-0.5B``'s ``.5-0`` is none)."""


def is_repo_id(text: str) -> bool:
    """Whether ``text`` names a hub repo rather than a local path: repo-id-shaped
    (``"name"`` or ``"owner/name"``, at most 96 characters; no leading ``/``, ``./``,
    ``~``), no file extension of :data:`FILE_SUFFIXES`, and nothing at that path."""
    return repo_id_shaped(text) and not Path(text).expanduser().exists()


def repo_id_shaped(text: str) -> bool:
    """:func:`is_repo_id` without looking at the disk: the shape alone, for names read from
    metadata, which the working directory must not decide (``edl.io.formats.base_ref``)."""
    if len(text) > _REPO_ID_MAX or not _REPO_ID.fullmatch(text):
        return False
    return Path(text).suffix.lower() not in FILE_SUFFIXES


def no_such_path(text: str) -> FileNotFoundError:
    """The error for a local path ``text`` that does not exist (never sent to the hub); it
    names the nearest missing part when a parent directory exists."""
    path = Path(text).expanduser()
    parent = path.parent
    near = f" ({parent} exists)" if parent != Path(".") and parent.is_dir() else ""
    return FileNotFoundError(f"{text}: no such file or directory{near} (and not a hub repo id)")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids network access, read
    now (``huggingface_hub`` reads it once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_error(repo_id: str, what: str = "repo") -> FileNotFoundError:
    """The error for hub repo ``repo_id`` missing from the local cache while
    :func:`hub_offline`: it names the repo and the variable."""
    return FileNotFoundError(
        f"{repo_id}: hub {what} not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
        "forbids downloading it (unset HF_HUB_OFFLINE, or pass a local path)"
    )
