"""Training records from text files, JSON Lines / JSON files and Hugging Face ``datasets``.

A :class:`Source` names where records come from and fingerprints their content (the key of
the tokenized cache, :mod:`edl.text.dataset`); :func:`read_records` reads and validates them
for one format:

- ``"text"``: ``{"text": str}``, pretraining documents;
- ``"completion"``: ``{"prompt": str, "completion": str}``;
- ``"chat"``: ``{"messages": [{"role": str, "content": str}, ...]}``, each role one of
  :data:`edl.text.chat.ROLES` (the server's; ``developer`` is read as ``system``);
- ``"preference"``: ``{"prompt", "chosen", "rejected"}``, all strings or all conversations
  (lists of messages), TRL's explicit-prompt preference formats (read and validated here;
  post-training consumes them);
- ``"auto"``: the format of the first record, from its keys (``messages`` -> chat;
  ``chosen`` and ``rejected`` -> preference; ``prompt`` and ``completion`` -> completion;
  ``text`` -> text). Every later record must then have that format's fields.

Every error names the record: ``file:line`` for JSON Lines, ``file[i]`` for a JSON array,
``dataset[split][row]`` for ``datasets``; and the field (``messages[1].role``). Strings
with a lone surrogate (JSON's ``"\\ud800"``: no Unicode text, no tokenizer encodes it) are
refused there, not in the tokenizer. Other keys of a record are kept, unchecked.

Files: a text file (any suffix but ``.jsonl`` / ``.json``) is *one document*, its whole
UTF-8 text (the corpus's own files, e.g. source code, are documents; a corpus of several
documents per file is better written as JSON Lines, whose document boundaries are
explicit). A ``.jsonl`` file holds one JSON object per line (blank lines are skipped); a
``.json`` file holds an array of objects. A JSON Lines line holds at most
:data:`MAX_LINE_BYTES` bytes and nests arrays / objects at most :data:`MAX_JSON_DEPTH` deep
(a ``.json`` file: its array, then as deep in each record); both are checked before the line
is parsed, so a huge or deeply nested line is refused by name rather than exhausting memory
or Python's recursion limit.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edl.text.chat import template_role
from edl.text.tokenizer import checked_text

__all__ = [
    "FORMATS",
    "MAX_JSON_DEPTH",
    "MAX_LINE_BYTES",
    "Source",
    "data_files",
    "detect_format",
    "hf_dataset",
    "json_nests_deeper_than",
    "read_records",
]

Format = Literal["auto", "text", "completion", "chat", "preference"]
PathLike = str | os.PathLike[str]
Record = dict[str, Any]

FORMATS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "completion": ("prompt", "completion"),
    "chat": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
}
"""Each format's required fields."""

_JSON_SUFFIXES = (".jsonl", ".json")

MAX_LINE_BYTES = 64 * 2**20
"""The most bytes a JSON Lines line may hold (not counting its newline): 64 MiB, far above
any real record, low enough that one bad line cannot take all memory (lines are read at most
this much at a time)."""

MAX_JSON_DEPTH = 100
"""How deep arrays and objects may nest in a record (a chat record is 3 deep:
record, ``messages``, message). Python's ``json`` parser recurses once per level, so depth
is checked first, by a scan that does not recurse."""

# A JSON string, escapes included (UTF-8 continuation bytes are >= 0x80, never '"' or '\').
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_OR_STRING = re.compile(rb'[\[\]{}]|"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NESTING = {b"[": 1, b"{": 1, b"]": -1, b"}": -1}
_CHUNK = 2**20


@dataclasses.dataclass(frozen=True)
class Source:
    """Where records come from.

    Attributes:
        description: for messages and the cache's metadata.
        fingerprint: a hex digest that changes whenever the records may (see
            :func:`data_files`, :func:`hf_dataset`).
        records: a function returning an iterator of ``(where, record)`` pairs, ``where``
            naming the record in errors.
    """

    description: str
    fingerprint: str
    records: Callable[[], Iterator[tuple[str, Record]]]


def resolve_files(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    """The files named by ``paths``: files as given, directories walked recursively (sorted,
    hidden entries skipped), anything else a glob (``**`` included, sorted). Keeps the
    order of ``paths``; raises ``FileNotFoundError`` naming a path or glob that matches no
    file."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    found: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += _walk(path)
        else:
            matches = sorted(glob.glob(os.fspath(path), recursive=True))
            files = [f for m in matches for f in ([Path(m)] if Path(m).is_file() else _walk(m))]
            if not files:
                raise FileNotFoundError(f"{item}: no such file or directory, nor files it globs")
            found += files
    return found


def _walk(directory: PathLike) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(root, n) for n in sorted(names) if not n.startswith(".")]
    if not out:
        raise FileNotFoundError(f"{directory}: directory holds no (non-hidden) file")
    return out


def data_files(paths: PathLike | Sequence[PathLike]) -> Source:
    """Records of local files (:func:`resolve_files`): ``.jsonl`` and ``.json`` files hold
    records, every other file is one ``{"text": ...}`` record (the module docstring).

    The fingerprint is the SHA-256 of the files' contents, in order: the same bytes give
    the same records wherever the files lie, and any edit changes it, even one that keeps a
    file's size and modification time. Hashing reads the files once per call (about 1 s per
    GB), far less than tokenizing them.
    """
    files = resolve_files(paths)
    digest = hashlib.sha256(b"edl.text.data_files/1\n")
    for path in files:
        with open(path, "rb") as f:
            file_hash = hashlib.file_digest(f, "sha256").hexdigest()
        kind = "json" if path.suffix in _JSON_SUFFIXES else "text"
        digest.update(f"{kind} {file_hash}\n".encode())

    def records() -> Iterator[tuple[str, Record]]:
        for path in files:
            if path.suffix == ".jsonl":
                yield from _jsonl_records(path)
            elif path.suffix == ".json":
                yield from _json_records(path)
            else:
                yield str(path), {"text": _read_text(path)}

    shown = ", ".join(map(str, files[:3])) + (f", ... ({len(files)} files)" if files[3:] else "")
    return Source(shown, digest.hexdigest(), records)


def _read_text(path: Path, data: bytes | None = None) -> str:
    data = path.read_bytes() if data is None else data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from e


def json_nests_deeper_than(data: bytes, limit: int) -> bool:
    """Whether arrays / objects in the JSON text ``data`` nest deeper than ``limit``
    (brackets inside strings do not count); a scan in numpy, no recursion."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # too few openings to reach past the limit
    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), np.uint8)
    depth = 0
    for start in range(0, brackets.size, _CHUNK):  # chunks: a few MiB at a time
        chunk = brackets[start : start + _CHUNK]
        opens = (chunk == ord("[")) | (chunk == ord("{"))
        running = depth + np.cumsum(np.where(opens, 1, -1), dtype=np.int64)
        if running.max() > limit:
            return True
        depth = int(running[-1])
    return False


def _too_deep_line(data: bytes, limit: int) -> int:
    """The line (from 1) of ``data`` where nesting first passes ``limit``; for the error
    only, after :func:`json_nests_deeper_than` (a Python loop over the brackets up to there)."""
    depth = 0
    for token in _BRACKET_OR_STRING.finditer(data):
        depth += _NESTING.get(token.group(), 0)  # a string: 0
        if depth > limit:
            return data.count(b"\n", 0, token.start()) + 1
    return 1


def _too_deep(where: str) -> ValueError:
    return ValueError(
        f"{where}: arrays / objects nest deeper than MAX_JSON_DEPTH ({MAX_JSON_DEPTH} levels "
        "in a record); refused before parsing"
    )


def _jsonl_records(path: Path) -> Iterator[tuple[str, Record]]:
    with open(path, "rb") as f:
        for number in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES + 1)  # bounded: a huge line is not read whole
            if not raw:
                return
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise ValueError(
                    f"{where}: line longer than MAX_LINE_BYTES ({MAX_LINE_BYTES} bytes, not "
                    "counting its newline); one record per line"
                )
            if json_nests_deeper_than(raw, MAX_JSON_DEPTH):
                raise _too_deep(where)
            line = _read_text(Path(where), raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e.msg} at column {e.colno}") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a record must be a JSON object, got {record!r:.60}")
            yield where, record


def _json_records(path: Path) -> Iterator[tuple[str, Record]]:
    raw = path.read_bytes()
    if json_nests_deeper_than(raw, MAX_JSON_DEPTH + 1):  # + 1: the array of records
        raise _too_deep(f"{path}:{_too_deep_line(raw, MAX_JSON_DEPTH + 1)}")
    try:
        data = json.loads(_read_text(path, raw))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json file must hold an array of records (objects)")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise ValueError(f"{path}[{i}]: a record must be a JSON object, got {record!r:.60}")
        yield f"{path}[{i}]", record


def hf_dataset(
    path: PathLike,
    *,
    split: str = "train",
    name: str | None = None,
    data_files: PathLike | Sequence[PathLike] | Mapping[str, Any] | None = None,
    revision: str | None = None,
    streaming: bool = False,
    cache_dir: PathLike | None = None,
) -> Source:
    """Records of a Hugging Face ``datasets`` dataset (the optional extra ``edl-jax[data]``).

    ``path`` is what ``datasets.load_dataset`` takes (a hub name, a builder such as
    ``"json"`` / ``"parquet"`` / ``"text"`` with ``data_files``, or a local dataset
    directory), or a directory written by ``Dataset.save_to_disk`` (read by
    ``load_from_disk``). Hub datasets come from the local cache when ``HF_DATASETS_OFFLINE``
    is set. ``streaming=True`` reads records one at a time without materializing the
    dataset (``datasets.IterableDataset``). ``cache_dir`` is ``datasets``' own (its Arrow
    files; default ``HF_DATASETS_CACHE``).

    The fingerprint: a loaded dataset's own (``Dataset._fingerprint``, which ``datasets``
    derives from its files and transforms); a streamed one's is the arguments plus the
    SHA-256 of local ``data_files``: a streamed *hub* dataset is keyed by name and
    ``revision`` only, so pin a revision (a commit) when caching it.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError("edl.text.hf_dataset needs datasets: pip install 'edl-jax[data]'") from e
    where = f"{os.fspath(path)}[{split}]"
    local = Path(path).expanduser()
    local_files = None
    if local.is_dir() and any((local / f).is_file() for f in ("state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(local))
        dataset = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        if isinstance(data_files, str | os.PathLike | list | tuple):
            local_files = resolve_files(data_files)
        dataset = datasets.load_dataset(
            os.fspath(path),
            name,
            split=split,
            revision=revision,
            streaming=streaming,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            data_files=data_files if local_files is None else [str(f) for f in local_files],
        )
    fingerprint = getattr(dataset, "_fingerprint", None)
    if streaming or fingerprint is None:
        digest = hashlib.sha256(json.dumps([os.fspath(path), name, split, revision]).encode())
        for file in local_files or []:
            with open(file, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
        fingerprint = digest.hexdigest()

    def records() -> Iterator[tuple[str, Record]]:
        for i, row in enumerate(dataset):
            yield f"{where}[{i}]", dict(row)

    return Source(where, hashlib.sha256(f"hf {fingerprint}".encode()).hexdigest(), records)


def detect_format(record: Mapping[str, Any], where: str) -> str:
    """The format of ``record`` from its keys (the module docstring's ``"auto"`` rule);
    ``ValueError`` naming ``where`` when no format fits."""
    if "messages" in record:
        return "chat"
    if "chosen" in record and "rejected" in record:
        return "preference"
    if "prompt" in record and "completion" in record:
        return "completion"
    if "text" in record:
        return "text"
    raise ValueError(
        f"{where}: cannot tell the record's format from its keys {sorted(record)}: expected "
        "'text', 'prompt' + 'completion', 'messages', or 'prompt' + 'chosen' + 'rejected'"
    )


def _checked_messages(value: Any, where: str, field: str) -> list[Any]:
    """``value``, a conversation, checked (``where: field[i].role`` ...); roles are given
    as the template's (:func:`~edl.text.chat.template_role`), so a new list only when one
    differs (``developer``)."""
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: field {field!r} must be a non-empty list of messages, got {value!r:.60}"
        )
    messages = value
    for i, message in enumerate(value):
        at = f"{where}: {field}[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at} must be a {{role, content}} object, got {message!r:.60}")
        role = template_role(message.get("role"), f"{at}.role")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{at}.content must be a string, got {content!r:.60}")
        checked_text(content, f"{at}.content")
        if role != message["role"]:
            messages = list(messages) if messages is value else messages
            messages[i] = {**message, "role": role}
    return messages


def validate_prompt(prompt: Any, where: str) -> str | list[Any]:
    """A GRPO prompt (text, or a conversation to continue), checked as :func:`validate`
    checks a record's fields; a conversation with a ``developer`` message comes back as a
    copy giving it as ``system``. ``ValueError`` naming ``where`` and what is wrong."""
    if isinstance(prompt, str):
        checked_text(prompt, f"{where}: field 'prompt'")
        return prompt
    if isinstance(prompt, list):
        return _checked_messages(prompt, where, "prompt")
    raise ValueError(
        f"{where}: field 'prompt' must be text or a list of messages, got {prompt!r:.60}"
    )


def validate(record: Mapping[str, Any], format: str, where: str) -> Mapping[str, Any]:
    """``record``, checked to have ``format``'s fields with their types: ``ValueError``
    naming ``where``, the field, and what was expected and found. Strings must be Unicode
    text (no lone surrogate) and roles one of :data:`~edl.text.chat.ROLES`; a record with
    a ``developer`` message comes back as a copy giving it as ``system``, as the server
    does."""
    missing = [f for f in FORMATS[format] if f not in record]
    if missing:
        raise ValueError(
            f"{where}: format {format!r} needs field(s) {missing}; the record has {sorted(record)}"
        )
    conversational = format == "chat" or (
        format == "preference" and isinstance(record["prompt"], list)
    )
    checked = {}
    for field in FORMATS[format]:
        value = record[field]
        if conversational:
            checked[field] = _checked_messages(value, where, field)
        elif isinstance(value, str):
            checked_text(value, f"{where}: field {field!r}")
        else:
            expected = "a string"
            if format == "preference":
                expected += " (or, for all three, a list of messages)"
            raise ValueError(
                f"{where}: field {field!r} must be {expected}, got {type(value).__name__}"
            )
    changed = {k: v for k, v in checked.items() if v is not record[k]}
    return {**record, **changed} if changed else record


def read_records(
    source: Source | PathLike | Sequence[PathLike], *, format: Format = "auto"
) -> Iterator[Record]:
    """The records of ``source`` (a :class:`Source`, or paths for :func:`data_files`), each
    validated for ``format`` (``"auto"``: the first record's); raises ``ValueError`` naming
    the first bad record."""
    if not isinstance(source, Source):
        source = data_files(source)
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"read_records: format must be 'auto' or one of {list(FORMATS)}")
    return (record for _, _, record in validated_records(source, format))


def validated_records(source: Source, format: str) -> Iterator[tuple[str, str, Record]]:
    """``(where, format, record)`` for each record of ``source``, validated (``"auto"``:
    the format of the first record)."""
    for where, record in source.records():
        if format == "auto":
            format = detect_format(record, where)
        yield where, format, validate(record, format, where)
