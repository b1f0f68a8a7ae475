"""OpenAI's response shapes: whole ``/v1/completions`` and ``/v1/chat/completions``
replies, their server-sent-event chunks, usage counts and ids (requests are validated by
:mod:`edl.serve.protocol`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

__all__ = [
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "new_id",
    "usage",
]


def new_id(kind: str) -> str:
    """A reply's id: ``chatcmpl-`` or ``cmpl-`` and 32 hex digits, as OpenAI's."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(id: str, object: str, model: str, choices: list, **extra: Any) -> dict[str, Any]:
    return {
        "id": id,
        "object": object,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def completion_response(
    id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole ``/v1/completions`` reply (``object: text_completion``) with its usage."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(
        id, "text_completion", model, [choice], usage=usage(prompt_tokens, completion_tokens)
    )


def chat_response(
    id: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole ``/v1/chat/completions`` reply (``object: chat.completion``) with its usage;
    ``tool_calls`` (``edl.serve.structured.parse_tool_calls``) go in the message."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    return _envelope(
        id, "chat.completion", model, [choice], usage=usage(prompt_tokens, completion_tokens)
    )


def _chunk(
    id: str,
    object: str,
    model: str,
    field: str,
    payload: Any,
    finish_reason: str | None,
    usage: dict[str, int] | None,
    logprobs: dict[str, Any] | None,
    index: int,
) -> dict[str, Any]:
    """A stream chunk of choice ``index`` holding ``payload`` as ``field``; ``payload=None``
    is the usage-only last chunk (no choices)."""
    choice = {"index": index, field: payload, "logprobs": logprobs, "finish_reason": finish_reason}
    extra = {} if usage is None else {"usage": usage}
    return _envelope(id, object, model, [] if payload is None else [choice], **extra)


def completion_chunk(
    id: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    usage: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A ``/v1/completions`` stream chunk of choice ``index``; ``text=None`` is the
    usage-only last chunk (no choices)."""
    args = (text, finish_reason, usage, logprobs, index)
    return _chunk(id, "text_completion", model, "text", *args)


def chat_chunk(
    id: str,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None,
    usage: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` stream chunk of choice ``index``; ``delta=None`` is the
    usage-only last chunk (no choices)."""
    args = (delta, finish_reason, usage, logprobs, index)
    return _chunk(id, "chat.completion.chunk", model, "delta", *args)
