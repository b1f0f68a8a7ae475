"""Tool calls read out of a model's turn, one parser per chat-template tool format
(:data:`TOOL_FORMATS`), for tool-use rollouts (``edl.train.environments``).

- ``"hermes"``: the format Hermes' and Qwen's (2.5, 3) chat templates teach when rendered
  with ``tools=``: any number of ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the text before the first being the message's content. Written here (a regular
  expression and ``json.loads``) because the tokenizers of those models ship no response
  parser.
- ``"template"``: the tokenizer's own response parser, transformers' ``parse_response``
  (5.x; it reads the tokenizer's ``response_template``), for templates that declare one.
  Its calls are taken as it returns them; a tokenizer without a ``response_template`` is an
  error naming it.
- ``"auto"`` (``ToolEnvironment``'s default): ``"template"`` for a tokenizer that declares a
  ``response_template``, else ``"hermes"``. transformers 5.24 has the parser, but a
  tokenizer must declare the template it reads, and many do not (TRL's GRPO trainer adds
  its own for the chat templates it knows), so ``"hermes"`` is often what runs.

A parser never raises on the model's text: a malformed call (not JSON, no ``name``,
``arguments`` not an object, an unclosed block) becomes an entry of
:attr:`ParsedTurn.errors`, which the environment sends back to the model as a tool message,
so the rollout goes on and the model learns the format from its mistakes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from edl._registry import Registry
from edl.text.sources import json_nests_deeper_than

__all__ = ["TOOL_FORMATS", "ParsedTurn", "ToolCall", "ToolFormat", "parse_hermes", "parse_template"]

MAX_ARGUMENTS_DEPTH = 64  # Python's json recurses per level: refuse deeper text before parsing


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: Mapping[str, Any]

    def template(self) -> dict[str, Any]:
        """The call as chat templates take an assistant message's ``tool_calls`` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn read by a tool format: ``content`` (the text before the first call, or
    all of it), the well-formed ``calls`` in order, and one message per malformed call."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    def message(self) -> dict[str, Any]:
        """The assistant message (``tool_calls`` only when there are calls)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [c.template() for c in self.calls]
        return out


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """A registry entry: ``parse(text, tokenizer) -> ParsedTurn`` and ``close``, the text
    that ends a call (a rollout may stop generating there when it is one token)."""

    name: str
    parse: Callable[[str, Any], ParsedTurn]
    close: str | None = None


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


def _call(text: str, index: int) -> ToolCall | str:
    """The call in one block's ``text``, or the message saying why it is malformed."""
    where = f"tool call {index}"
    if json_nests_deeper_than(text.encode("utf-8", "surrogatepass"), MAX_ARGUMENTS_DEPTH):
        return f"{where}: nested deeper than {MAX_ARGUMENTS_DEPTH} levels"
    try:
        call = json.loads(text)
    except ValueError as e:  # not JSON, or an int past Python's digit limit
        return f"{where}: not JSON ({e}): {text.strip()!r:.200}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        shape = '{"name": <function-name>, "arguments": {...}}'
        return f"{where}: expected {shape}, got {text.strip()!r:.200}"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(ValueError):  # not JSON: refused as not an object below
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return f"{where} ({call['name']}): arguments must be a JSON object, got {arguments!r:.200}"
    return ToolCall(call["name"], arguments)


def parse_hermes(text: str, tokenizer: Any = None) -> ParsedTurn:
    """``text`` (a model turn, without its end-of-turn token) in the Hermes / Qwen format:
    the calls of its ``<tool_call>...</tool_call>`` blocks; an opening tag never closed is
    an error too. ``tokenizer`` is unused (the registry's signature)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, block in enumerate(_BLOCK.finditer(text)):
        parsed = _call(block.group(1), i)
        (errors if isinstance(parsed, str) else calls).append(parsed)
    rest = _BLOCK.sub("", text)
    if _OPEN in rest:
        errors.append(f"an opening {_OPEN} without {_CLOSE}: {rest[rest.index(_OPEN) :]!r:.200}")
    first = text.find(_OPEN)
    content = text if first < 0 else text[:first]
    return ParsedTurn(content.strip(), tuple(calls), tuple(errors))


def parse_template(text: str, tokenizer: Any) -> ParsedTurn:
    """``text`` through the tokenizer's own parser (transformers' ``parse_response`` and
    the tokenizer's ``response_template``); ``ValueError`` naming the tokenizer when it
    declares none."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if not has_response_template(tokenizer):
        raise ValueError(
            f"tool_format='template': the tokenizer {getattr(tokenizer, 'name', tokenizer)!r} "
            "has no response_template (transformers' parse_response); use tool_format='hermes' "
            "or another entry of edl.train.tool_formats.TOOL_FORMATS"
        )
    message = hf.parse_response(text, prefix="")
    calls, errors = [], []
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function", call)
        name, arguments = function.get("name"), function.get("arguments", {})
        if isinstance(name, str) and name and isinstance(arguments, dict):
            calls.append(ToolCall(name, arguments))
        else:
            errors.append(
                f"tool call {i}: expected a name and an arguments object, got {call!r:.200}"
            )
    return ParsedTurn(str(message.get("content") or "").strip(), tuple(calls), tuple(errors))


def has_response_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (an ``HFTokenizer`` or a transformers one) declares a response
    parser (transformers' ``response_template``)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    return getattr(hf, "response_template", None) is not None and hasattr(hf, "parse_response")


def parse_auto(text: str, tokenizer: Any) -> ParsedTurn:
    """The tokenizer's own parser where it declares one (:func:`parse_template`), else the
    Hermes / Qwen format (:func:`parse_hermes`)."""
    if tokenizer is not None and has_response_template(tokenizer):
        return parse_template(text, tokenizer)
    return parse_hermes(text)


TOOL_FORMATS: Registry[ToolFormat] = Registry(
    "tool format",
    [
        ToolFormat("auto", parse_auto, _CLOSE),
        ToolFormat("hermes", parse_hermes, _CLOSE),
        ToolFormat("template", parse_template),
    ],
)
