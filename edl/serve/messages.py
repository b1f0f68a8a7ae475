"""A chat request's ``messages``, checked and put in the form chat templates read.

Roles are :data:`edl.text.chat.ROLES`' (``developer`` given as ``system``); content is text
or text parts (joined). OpenAI's tool loop goes to the template as HF's and vLLM's
templates take it: an assistant message's ``tool_calls`` with each call's ``arguments`` a
dict (content may then be null), and a ``tool`` message's ``tool_call_id``. Every bad
value is a :class:`~edl.serve.structured.FieldError` naming its place
(``messages[2].tool_calls[0].function.arguments``); text with a lone surrogate, which no
tokenizer encodes, included. Image parts are refused by name: not served yet
(``edl.serve.multimodal``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from edl.serve.structured import FieldError, template_tool_calls
from edl.text.chat import template_role
from edl.text.tokenizer import checked_text

__all__ = ["chat_turns"]

# The fields each role's message may have (OpenAI's; ``name`` is accepted and not rendered).
_FIELDS = {
    "assistant": frozenset({"role", "content", "name", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}
_PLAIN = frozenset({"role", "content", "name"})
# Image content parts (OpenAI chat's, its Responses API's, Anthropic's): refused by name.
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def _text(text: str, where: str) -> str:
    try:
        return checked_text(text, where)
    except ValueError as e:
        raise FieldError(str(e), where) from e


def _content(message: Mapping[str, Any], where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return _text(content, f"{where}.content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
                raise FieldError(
                    f"{where}.content[{j}]: image parts ({part['type']!r}) are not served yet: "
                    "edl serve answers text only (edl.serve.multimodal)",
                    f"{where}.content",
                )
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise FieldError(
                    f"{where}.content[{j}]: only text parts "
                    f"({{'type': 'text', 'text': ...}}) are supported, got {part!r:.200}",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return _text("".join(texts), f"{where}.content")
    raise FieldError(
        f"{where}.content must be a string or a list of text parts, got {content!r:.200}",
        f"{where}.content",
    )


def _turn(message: Any, where: str) -> dict[str, Any]:
    """One message as the template gets it (module docstring)."""
    if not isinstance(message, dict):
        raise FieldError(f"{where} must be an object, got {message!r:.200}", where)
    try:
        role = template_role(message.get("role"), f"{where}.role")
    except ValueError as e:
        raise FieldError(str(e), f"{where}.role") from e
    extra = set(message) - _FIELDS.get(role, _PLAIN)
    if extra:
        raise FieldError(f"{where}: unsupported fields {sorted(extra)} for role {role!r}", where)
    turn: dict[str, Any] = {"role": role}
    if role == "assistant" and message.get("tool_calls") is not None:
        turn["tool_calls"] = template_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        _text(json.dumps(turn["tool_calls"], ensure_ascii=False), f"{where}.tool_calls")
        if message.get("content") is None:
            return {**turn, "content": ""}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            why = f"{where}.tool_call_id must be a non-empty string, got {call_id!r:.100}"
            raise FieldError(why, f"{where}.tool_call_id")
        turn["tool_call_id"] = _text(call_id, f"{where}.tool_call_id")
    turn["content"] = _content(message, where)
    return turn


def chat_turns(messages: Any) -> list[dict[str, Any]]:
    """``messages`` checked, in the template's form (module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise FieldError(f"'messages' must be a non-empty list, got {messages!r:.200}", "messages")
    return [_turn(message, f"messages[{i}]") for i, message in enumerate(messages)]
