"""``read_json``: a JSON object from a file, with errors that name the file.

``json.load`` reports a broken file as ``Expecting ',' delimiter: line 3 column 5 (char
41)``, without saying which file, and returns lists or numbers as happily as objects.
Every JSON file edl reads (``config.json``, ``adapter_config.json``, ``state.json``)
goes through ``read_json`` instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json"]


def read_json(path: str | os.PathLike[str], *, what: str = "JSON file") -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises ``ValueError`` naming ``path`` (and ``what`` it is, e.g. ``"model config"``)
    when the file is not UTF-8 text, not valid JSON (with the line and column of the
    error) or holds something other than an object at the top level. A missing or
    unreadable file raises the ``OSError`` from opening it, which names the path.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {what} is not UTF-8 text ({e})") from e
    try:
        data = json.loads(text)
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
