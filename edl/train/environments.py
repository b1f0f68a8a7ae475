"""Environments for multi-turn and tool-use rollouts (``edl.train.multiturn``).

An :class:`Environment` is a conversation partner for one rollout row:

- ``reset(record) -> messages``: the chat messages that open the conversation, from a
  prompt record of the dataset (``{"prompt": text or messages, ...columns}``);
- ``step(assistant_message) -> (messages, reward, done)``: the model's turn (an assistant
  message, ``tool_calls`` included when the tool format found calls); the environment's
  answer (``tool`` or ``user`` messages, rendered into the sequence by the chat template),
  this turn's reward and whether the conversation is over;
- ``tools``: the JSON schemas the prompt is rendered with (the chat template's ``tools=``),
  or None.

Rewards: a row's reward is the sum of every step's reward (undiscounted; per-turn rewards
and a final-state reward, returned with ``done``, are the same mechanism), plus the
weighted reward functions of the GRPO step, if any, on the finished conversation; GRPO's
group-normalised advantage of that total weighs every model token of the row alike. A row
cut by ``max_turns`` gets the steps' rewards so far (its last turn is still stepped).

Rollouts build one environment per row, from a factory ``() -> Environment`` (the CLI's
``--environment module:factory``), so environments may keep per-conversation state.

:class:`ToolEnvironment` is the built-in: Python functions as tools, calls parsed by a tool
format (``edl.train.tool_formats``), each run in a thread with a deadline. Threads, not
subprocesses: tools are arbitrary callables (closures, bound methods holding the
environment's state) that a subprocess could only receive pickled, forking a process that
runs jax's threads is unsafe, and a spawned interpreter costs about a second per call
against microseconds. The price: Python cannot kill a thread, so a tool past its deadline is
abandoned (a daemon thread, it ends with the process) and its late result ignored; a tool
that may never return should put its own work in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from edl.train.tool_formats import TOOL_FORMATS, ParsedTurn, ToolCall

__all__ = [
    "Environment",
    "EnvironmentFactory",
    "ToolEnvironment",
    "check_factory",
    "prompt_messages",
    "run_tool",
]

Message = dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """What a multi-turn rollout talks to (module docstring)."""

    tools: Sequence[Mapping[str, Any]] | None

    @property
    def stop(self) -> str | None:
        """The text that ends a model turn besides EOS (read by the rollout)."""
        return self.format.close if self.stop_at_call else None

    def reset(self, record: Mapping[str, Any]) -> list[Message]: ...

    def step(self, message: Message) -> tuple[list[Message], float, bool]: ...


EnvironmentFactory = Callable[[], Environment]


def check_factory(factory: Any) -> None:
    """Build one environment with ``factory`` and check it has ``reset`` and ``step``
    methods, so that a wrong factory fails before a model loads. ``TypeError`` saying what
    was called and what it returned (or raised)."""
    if not callable(factory):
        raise TypeError(f"{type(factory).__name__} is not callable (expected a factory)")
    try:
        made = factory()
    except Exception as e:
        raise TypeError(f"calling it raised {type(e).__name__}: {e}") from e
    missing = [m for m in ("reset", "step") if not callable(getattr(made, m, None))]
    if missing:
        raise TypeError(
            f"it returned {type(made).__name__} {made!r:.60}, expected an environment with "
            f"reset(record) and step(message) methods (edl.train.environments.Environment); "
            f"no {' or '.join(missing)}"
        )


def prompt_messages(record: Mapping[str, Any]) -> list[Message]:
    """A record's ``prompt`` as chat messages: text becomes one user message."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt) and prompt:
        return [dict(m) for m in prompt]
    raise ValueError(
        "environment reset: the record's 'prompt' must be text or chat messages, got "
        f"{prompt!r:.120}"
    )


def _text(value: Any) -> str:
    """A tool's result as a tool message's content: strings as they are, JSON values as
    JSON, anything else by ``str``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def run_tool(fn: Callable[..., Any], arguments: Mapping[str, Any], timeout: float) -> str:
    """``fn(**arguments)`` in a daemon thread, waited for at most ``timeout`` seconds; its
    result as text (:func:`_text`), or ``"error: ..."`` naming the exception or the timeout.
    Never raises for the tool's sake (the rollout goes on)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as e:  # the tool's failure is its message's content
            box["error"] = e

    thread = threading.Thread(target=target, name=f"edl-tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"error: tool {name!r} timed out after {timeout:g} s"
    if "error" in box:
        e = box["error"]
        return f"error: tool {name!r} raised {type(e).__name__}: {e}"
    try:
        return _text(box.get("value"))
    except Exception as e:  # a __str__ that raises
        return (
            f"error: tool {name!r} returned an unprintable {type(box.get('value')).__name__}: {e}"
        )


def _schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema by transformers' ``get_json_schema`` (type hints and a
    Google-style docstring), as chat templates take ``tools``."""
    from transformers.utils import get_json_schema  # the text extra: imported when used

    return get_json_schema(fn)


@dataclasses.dataclass
class ToolEnvironment:
    """Python functions as tools (module docstring).

    Args:
        functions: the tools, called by their ``__name__`` with the call's arguments.
        reward: ``reward(record, messages) -> float``, the final state's reward, called when
            the model answers without a call (``done``); None: 0. ``messages`` is the whole
            conversation, the final answer last.
        tool_format: a name in ``edl.train.tool_formats.TOOL_FORMATS`` (``"auto"``: the
            tokenizer's own parser where it has one, else ``"hermes"``).
        timeout: seconds each call may run.
        schemas: the JSON schemas rendered into the prompt (None: from the functions'
            signatures and docstrings, transformers' ``get_json_schema``).
        tokenizer: for ``"template"`` / ``"auto"`` (its ``parse_response``, if any).
        stop_at_call: end the model's turn at the format's closing tag (``</tool_call>``)
            when it is one token: one call per turn, and the model never writes a tool's
            answer itself; False: turns end at EOS only (several calls per turn).

    ``step``: with calls or malformed calls in the turn, one ``tool`` message per call (its
    result, or ``"error: ..."`` for an unknown tool, bad arguments, an exception or a
    timeout) and one per malformed call, reward 0, not done; without, done with ``reward``.
    """

    functions: Sequence[Callable[..., Any]]
    reward: Callable[[Mapping[str, Any], list[Message]], float] | None = None
    tool_format: str = "auto"
    timeout: float = 10.0
    schemas: Sequence[Mapping[str, Any]] | None = None
    tokenizer: Any = None
    stop_at_call: bool = True

    def __post_init__(self) -> None:
        self.format = TOOL_FORMATS.lookup(self.tool_format, "ToolEnvironment.tool_format")
        if not self.timeout > 0:
            raise ValueError(f"ToolEnvironment.timeout must be > 0 seconds, got {self.timeout!r}")
        self.by_name = {getattr(f, "__name__", ""): f for f in self.functions}
        if "" in self.by_name or len(self.by_name) != len(self.functions):
            names = [getattr(f, "__name__", None) for f in self.functions]
            raise ValueError(f"ToolEnvironment: tools need distinct __name__s, got {names}")
        if self.schemas is None:
            self.schemas = [_schema(f) for f in self.functions]
        self.record: Mapping[str, Any] = {}
        self.messages: list[Message] = []

    @property
    def tools(self) -> list[Mapping[str, Any]]:
        return list(self.schemas or [])

    @property
    def stop(self) -> str | None:
        """The text that ends a model turn besides EOS (read by the rollout)."""
        return self.format.close if self.stop_at_call else None

    def reset(self, record: Mapping[str, Any]) -> list[Message]:
        self.record = record
        self.messages = prompt_messages(record)
        return list(self.messages)

    def parse(self, text: str) -> ParsedTurn:
        return self.format.parse(text, self.tokenizer)

    def call(self, call: ToolCall) -> str:
        """One call's result text (errors included)."""
        fn = self.by_name.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; the tools are {sorted(self.by_name)}"
        return run_tool(fn, call.arguments, self.timeout)

    def step(self, message: Message) -> tuple[list[Message], float, bool]:
        parsed = self.parse(str(message.get("content") or ""))
        self.messages.append(parsed.message())
        if not parsed.calls and not parsed.errors:
            reward = 0.0 if self.reward is None else float(self.reward(self.record, self.messages))
            return [], reward, True
        answers = [
            {"role": "tool", "name": c.name, "content": self.call(c)} for c in parsed.calls
        ] + [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in parsed.errors]
        self.messages += answers
        return answers, 0.0, False
