"""Structured output and tool calls as OpenAI's API has them: ``response_format``, ``tools``
and ``tool_choice`` checked and turned into grammars (:mod:`edl.serve.grammar`), and tool
calls read back out of the model's text.

- ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (JSON matching ``schema``; constrained whether ``strict`` or not).
- ``tools``: OpenAI function tools (``{"type": "function", "function": {"name",
  "description", "parameters", "strict"}}``), given to the chat template's ``tools``
  argument as they are. ``tool_choice``: ``"none"`` (no tools rendered), ``"auto"`` (the
  default with tools: the model may call), ``"required"`` or ``{"type": "function",
  "function": {"name"}}``: the reply is constrained to calls in the Hermes / Qwen format
  below: one or more for ``"required"`` (exactly one with ``parallel_tool_calls: false``),
  one of the named function.
- Tool calls are read from the reply in the Hermes / Qwen format that their chat templates
  teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with any
  text before the first as the message's content (:func:`parse_tool_calls`). Streamed, the
  text from ``<tool_call>`` on is held back (:class:`ToolText`) and sent as
  ``delta.tool_calls`` when the reply ends.

Errors are :class:`FieldError` (a ``ValueError`` naming the request's field), which
``edl.serve.protocol`` answers as a 400. No jax, no web framework.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from edl.serve.grammar import JSON_OPTIONS, any_json_grammar, json_schema_grammar, lark_grammar
from edl.text.sources import json_nests_deeper_than

__all__ = ["FieldError", "ToolText", "Tools", "parse_tool_calls", "template_tool_calls"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_ARGUMENTS_DEPTH = 64  # as a request body's (edl.serve.protocol.MAX_BODY_DEPTH)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


class FieldError(ValueError):
    """A bad value of the request field ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def response_format_grammar(value: Any) -> str | None:
    """The grammar of a ``response_format`` (None: plain text); ``FieldError`` naming it."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return any_json_grammar()
    if kind != "json_schema":
        raise FieldError(
            "'response_format' must be {'type': 'text' | 'json_object'} or {'type': "
            f"'json_schema', 'json_schema': {{...}}}}, got {value!r:.200}",
            "response_format",
        )
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise FieldError(f"'{where}' must be an object, got {spec!r:.200}", where)
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise FieldError(f"'{where}': unknown fields {sorted(extra)}", where)
    if not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
        raise FieldError(
            f"'{where}.name' must be 1-64 letters, digits, '_' or '-', got {spec.get('name')!r}",
            f"{where}.name",
        )
    if not isinstance(spec.get("strict", False), bool | None):
        raise FieldError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    try:
        return json_schema_grammar(spec.get("schema", {}), f"'{where}.schema'")
    except ValueError as e:
        raise FieldError(str(e), f"{where}.schema") from e


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's checked ``tools`` and ``tool_choice`` (``"none"``, ``"auto"``,
    ``"required"``, or ``"function"`` with ``name``), ``parallel``: whether a forced
    ``"required"`` reply may hold several calls."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """What the chat template's ``tools`` gets: None for ``tool_choice: "none"``."""
        return None if self.choice == "none" else [dict(t) for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def grammar(self) -> str | None:
        """The grammar of a forced choice's reply (None unless forced): Hermes-format
        calls, each ``{"name", "arguments"}`` matching one tool's parameters."""
        if not self.forced:
            return None
        schemas = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
            if self.name in (None, t["function"]["name"])
        ]
        schema = {"anyOf": schemas, "x-guidance": JSON_OPTIONS}
        lark = (
            f"start: call{'+' if self.choice == 'required' and self.parallel else ''}\n"
            f'call: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
        )
        return lark_grammar(lark, "'tools'")


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or set(tool)
        - {
            "type",
            "function",
        }
    ):
        raise FieldError(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
    fn = tool.get("function")
    if not isinstance(fn, dict) or set(fn) - {"name", "description", "parameters", "strict"}:
        raise FieldError(
            f"'{where}.function' must be an object of name, description, parameters, strict; "
            f"got {fn!r:.200}",
            f"{where}.function",
        )
    if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
        raise FieldError(
            f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-', got "
            f"{fn.get('name')!r}",
            f"{where}.function.name",
        )
    if not isinstance(fn.get("description", ""), str):
        raise FieldError(f"'{where}.function.description' must be a string", where)
    try:  # the schema must compile, forced or not: a call may be constrained later
        json_schema_grammar(fn.get("parameters") or {"type": "object"}, "parameters")
    except ValueError as e:
        where = f"{where}.function.parameters"
        raise FieldError(f"'{where}': {e}", where) from e
    return tool


def parse_tools(tools: Any, tool_choice: Any, parallel: Any = None) -> Tools | None:
    """The checked ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request
    (None: no tools)."""
    if not isinstance(parallel, bool | None):
        raise FieldError(
            f"'parallel_tool_calls' must be a boolean, got {parallel!r:.80}", "parallel_tool_calls"
        )
    parallel = parallel is not False
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise FieldError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise FieldError(f"'tools' must be a list, got {tools!r:.200}", "tools")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise FieldError(f"'tools' names a function twice: {names}", "tools")
    if tool_choice is None:
        return Tools(checked, "auto", parallel=parallel)
    if tool_choice in ("none", "auto", "required"):
        return Tools(checked, tool_choice, parallel=parallel)
    is_function = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    fn = tool_choice.get("function") if is_function else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        raise FieldError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
            f"'function': {{'name': one of {names}}}}}, got {tool_choice!r:.200}",
            "tool_choice",
        )
    return Tools(checked, "function", name, parallel)


def _loads(text: str) -> Any:
    """``json.loads`` of a tool call's text, refused (``ValueError``) past
    ``MAX_ARGUMENTS_DEPTH`` levels before parsing: Python's ``json`` recurses per level."""
    if json_nests_deeper_than(text.encode("utf-8", "surrogatepass"), MAX_ARGUMENTS_DEPTH):
        raise ValueError(f"nested deeper than {MAX_ARGUMENTS_DEPTH} levels")
    return json.loads(text)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a reply: the OpenAI ``tool_calls`` (``id``, ``type``,
    ``function: {name, arguments}``, arguments a JSON string) of its well-formed
    ``<tool_call>{"name", "arguments"}</tool_call>`` blocks and the text before the first
    (None if blank). A reply without a well-formed call is all content."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = _loads(match.group(1))
        except ValueError:  # not JSON, too deep, or an int past Python's digit limit
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    if not calls:
        return text, []
    content = text[: text.index(OPEN)]
    return (content if content.strip() else None), calls


class ToolText:
    """A streamed reply's text with tool calls held back: ``push`` returns what may be
    sent as content now (up to any ``<tool_call>`` or a possible start of one); ``end``
    returns the held text that is content after all and the parsed calls."""

    def __init__(self) -> None:
        self.text, self.sent = "", 0

    def push(self, piece: str) -> str:
        self.text += piece
        start = self.text.find(OPEN, self.sent)
        if start < 0:  # hold a tail that may begin "<tool_call>"
            start = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    start = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent : start], max(self.sent, start)
        return out

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_tool_calls(self.text)
        if not calls:
            return self.text[self.sent :], []
        return (content or "")[self.sent :], calls


def template_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` (``[{"id", "type": "function",
    "function": {"name", "arguments"}}]``, arguments a JSON object as a string, as replies
    carry them) in the form chat templates read (HF's and vLLM's): ``arguments`` a dict.
    ``FieldError`` naming ``where`` for anything else."""
    if not isinstance(value, list) or not value:
        raise FieldError(f"{where} must be a non-empty list, got {value!r:.200}", where)
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise FieldError(f"{at} must be a function call object, got {call!r:.200}", at)
        if set(call) - {"id", "type", "function"} or not isinstance(call.get("id", ""), str):
            raise FieldError(f"{at} takes 'id' (a string), 'type' and 'function'", at)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FieldError(f"{at}.function must have a 'name' string", f"{at}.function")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = _loads(arguments)
            except ValueError as e:
                message = f"{at}.function.arguments is not a JSON object: {e}"
                raise FieldError(message, f"{at}.function.arguments") from e
        if not isinstance(arguments, dict):
            message = f"{at}.function.arguments must be a JSON object, got {arguments!r:.200}"
            raise FieldError(message, f"{at}.function.arguments")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        calls.append({"id": call["id"], **entry} if "id" in call else entry)
    return calls


def delta_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` as a stream chunk's ``delta.tool_calls`` (each with its ``index``)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]
