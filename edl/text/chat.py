"""The chat roles edl accepts, in one table.

Training records (:func:`edl.text.read_records`: chat and conversational preference
records) and the server's ``/v1/chat/completions`` (``edl.serve.protocol``) both check each
message's role with :func:`template_role`, so a role is accepted, renamed or refused the
same way in training data and in requests, with the same error.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["ROLES"]

ROLES: Mapping[str, str] = MappingProxyType(
    {
        "system": "system",
        "developer": "system",
        "user": "user",
        "assistant": "assistant",
        "tool": "tool",
    }
)
"""Each accepted role and the role the chat template is given for it: the standard system /
user / assistant, OpenAI's ``developer`` (its newer name for the system prompt), given
as ``system`` since chat templates know that one, and ``tool`` (a tool's result, which
templates with a tool format render; the server also takes its ``tool_call_id``). Other
roles (the deprecated ``function``, made-up ones) are refused."""


def template_role(role: Any, where: str) -> str:
    """The role the chat template is given for a message's ``role`` (:data:`ROLES`).

    Raises ``ValueError`` naming ``where`` (e.g. ``"data.jsonl:3: messages[1].role"``),
    the allowed roles and the value found.
    """
    if isinstance(role, str) and role in ROLES:
        return ROLES[role]
    raise ValueError(f"{where} must be one of {list(ROLES)}, got {role!r:.60}")
