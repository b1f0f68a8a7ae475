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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

__all__ = [
    "FILE_SUFFIXES",
    "hub_offline",
    "hub_unreachable",
    "is_repo_id",
    "no_such_path",
    "offline_error",
    "repo_id_shaped",
    "unreachable_error",
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


_PROBE_TIMEOUT_S = 10.0


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


_ANSWERS: dict[str, str | None] = {}
""":func:`hub_unreachable`'s answer per endpoint, kept for the process."""


def _probe(endpoint: str) -> str | None:
    if endpoint not in _ANSWERS:
        _ANSWERS[endpoint] = _ask(endpoint)
    return _ANSWERS[endpoint]


def _ask(endpoint: str) -> str | None:
    try:
        request = urllib.request.Request(endpoint, method="HEAD")
        with urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None  # the hub answered: reachable (what it says of a repo is the loader's)
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def hub_unreachable() -> str | None:
    """Why the hub (``HF_ENDPOINT``, default ``https://huggingface.co``) cannot be reached,
    or ``None`` when it answers: ONE request (a ``HEAD`` of the endpoint, 10 s at most,
    proxies from the environment), made once per process and endpoint. The hub libraries
    retry a failed request five times with backoff (about 30 s per file, a minute for a
    model and its tokenizer); edl asks once, before any of them runs."""
    return _probe(_endpoint())


def unreachable_error(
    repo_id: str, reason: str, kind: Literal["model", "dataset"] = "model"
) -> ConnectionError:
    """The error for hub repo ``repo_id`` while :func:`hub_unreachable` gives ``reason``:
    it says whether the repo is in the local Hugging Face cache (then ``HF_HUB_OFFLINE=1``
    reads it from there) or not."""
    from huggingface_hub import constants  # reads the cache's location from the environment

    cached = Path(constants.HF_HUB_CACHE, f"{kind}s--{repo_id.replace('/', '--')}").is_dir()
    fix = (
        "it is in the local Hugging Face cache: rerun with HF_HUB_OFFLINE=1 to read it from there"
        if cached
        else "it is not in the local Hugging Face cache: check the network, or pass a local path"
    )
    return ConnectionError(
        f"{repo_id}: a hub {kind} repo id, but {_endpoint()} cannot be reached ({reason}); {fix}"
    )
