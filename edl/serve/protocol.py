"""OpenAI's HTTP API as plain data: request validation and response shapes.

``parse_completion`` / ``parse_chat`` check a decoded JSON body against what this server
supports and return a :class:`GenerationRequest`; anything else raises :class:`APIError`,
whose ``body()`` is OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}``. The response builders return the JSON objects of OpenAI's completions and chat
completions (plain, and the chunks of a stream). No web framework here.

Log-probs: ``/v1/completions`` ``logprobs`` (0-20, OpenAI's legacy shape) and ``echo`` (the
prompt and its log-probs lead the reply, streamed or not; ``max_tokens`` 0 allowed), several
prompts in one call (lm-evaluation-harness's batches; not streamed); chat ``logprobs: true`` with
``top_logprobs`` (0-20). All from the model's distribution before sampling processors.

Supported: ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature`` in [0, 2],
``top_p`` in (0, 1], ``top_k`` (vLLM's extension; -1 or null: off), ``seed`` in [0, 2**32),
``stop`` (a string or up to 4), ``stream`` with ``stream_options`` (``include_usage``);
``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``logit_bias`` (up to
``MAX_LOGIT_BIAS`` ids, bias in [-100, 100]), and vLLM's ``repetition_penalty`` (> 0),
``min_p`` in [0, 1] and ``stop_token_ids`` (semantics: ``edl.ops.sampling.RowSampling``);
``n`` choices and ``best_of`` (``n <= best_of <= MAX_CHOICES``; the ``n`` of highest
cumulative log-prob are returned; not streamed when ``best_of > n``), choice ``i`` seeded
``(seed + i) mod 2**32``; ``response_format`` (text, ``json_object``, ``json_schema``) and,
for chat, ``tools`` / ``tool_choice`` (:mod:`edl.serve.structured`). Fields OpenAI defines
but this server does not implement are accepted only at their no-op value; any other field
is an error naming it.

Limits the engine or Unicode set: ``top_k`` below 2**31 (the engine's int32), ``seed`` in
[0, 2**32) (its uint32); text with a lone surrogate (a JSON ``\\ud800`` escape: no UTF-8)
is refused naming its field. :func:`decode_body` turns a request body into JSON (UTF-8,
nested at most :data:`MAX_BODY_DEPTH` deep) or a 400.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from edl.serve.messages import chat_turns
from edl.serve.structured import FieldError, Tools, parse_tools, response_format_grammar
from edl.serve.types import MAX_LOGIT_BIAS, MAX_LOGPROBS, SEED_END, TOP_K_END, SamplingParams
from edl.text.sources import json_nests_deeper_than
from edl.text.tokenizer import checked_text

__all__ = ["MAX_BODY_DEPTH", "APIError", "GenerationRequest", "decode_body"]


class APIError(Exception):
    """An error answered as OpenAI's error body with HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


MAX_BODY_DEPTH = 64
"""How deep arrays / objects may nest in a request body (a chat body is 5 deep: body,
``messages``, message, content parts, part). Checked before parsing, by a scan that does
not recurse: Python's ``json`` recurses once per level (100k levels: ``RecursionError``)."""


def decode_body(data: bytes) -> Any:
    """A request body's JSON value: UTF-8 (RFC 8259), nested at most
    :data:`MAX_BODY_DEPTH` deep; anything else is a 400 saying what is wrong. CPU-bound
    on a large body (the server runs it off the event loop)."""
    if json_nests_deeper_than(data, MAX_BODY_DEPTH):
        raise bad(
            f"the request body nests arrays / objects deeper than {MAX_BODY_DEPTH} levels; "
            "refused before parsing"
        )
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not UTF-8 (byte {e.start}: {e.reason})") from e
    except ValueError as e:  # JSONDecodeError, and ints past Python's 4300-digit limit
        raise bad(f"the request body is not valid JSON: {e}") from e


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A validated request: the prompt (text, or token ids for completions; messages for
    chat), the sampling options with ``max_tokens`` still None when the client left it to
    the model length, the stop strings, and how to stream."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top log-probs per token (0: the token's own); None: off
    echo: bool = False  # completions: the prompt (and its log-probs) leads the reply
    grammar: str | None = None  # response_format's or a forced tool choice's
    tools: Tools | None = None
    # -- issue 47: penalties, bias, choices (_sampling_fields) --
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    best_of: int = 1  # choices generated; the n of highest cumulative log-prob are returned

    def sampling_params(
        self, max_tokens: int, stop_token_ids: Sequence[int], choice: int = 0
    ) -> SamplingParams:
        """Choice ``choice``'s settings: with a ``seed``, choice ``i`` uses ``(seed + i) mod
        2**32``, so the ``n`` choices differ and each is reproducible; ``stop_token_ids``
        (the server's EOS ids) join the request's own."""
        seed = None if self.seed is None else (self.seed + choice) % 2**32
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids) + self.stop_token_ids,
            logprobs=self.logprobs,
            # echo: the prompt's own log-probs (max_tokens 0 needs them in the engine).
            prompt_logprobs=(self.logprobs or 0) if self.echo else None,
            grammar=self.grammar,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "response_format",
    # issue 47 (_sampling_fields)
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop_token_ids",
    "best_of",
}
# Defined by OpenAI, not implemented: accepted at the value that means "off" only.
_NO_OP = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
}
_FIELDS = {
    "completion": _COMMON | {"prompt", "logprobs", "echo"},
    "chat": _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}


def _number(
    body: Mapping[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad(f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(f"'{name}' must be an integer, got {value!r}", name)
    return value


def _integer_in(body: Mapping[str, Any], name: str, low: int, end: int, shown: str) -> int | None:
    """An optional integer in ``[low, end)`` (``shown``: that range as the error says it):
    what the engine keeps in a fixed-width integer."""
    value = _integer(body, name)
    if value is not None and not low <= value < end:
        raise bad(f"'{name}' must be an integer in {shown}, got {value}", name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if value is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"'stop' must be a non-empty string or a list of them, got {value!r}", "stop")
    if len(stops) > 4:
        raise bad(f"'stop' takes at most 4 strings, got {len(stops)}", "stop")
    return tuple(_text(s, "stop") for s in stops)


def _common(body: Any, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in _NO_OP and name not in _FIELDS[kind] and value not in _NO_OP[name]:
            raise bad(f"'{name}' is not supported by this server (got {value!r})", name)
        if name not in _FIELDS[kind] and name not in _NO_OP:
            raise bad(f"unknown field '{name}' (supported: {sorted(_FIELDS[kind])})", name)
    if not isinstance(body.get("model"), str):
        raise bad(f"'model' must be a string, got {body.get('model')!r}", "model")
    max_tokens = _integer(body, "max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens")
    least = 0 if kind == "completion" and body.get("echo") is True else 1  # echo: prompt only
    if max_tokens is not None and max_tokens < least:
        raise bad(
            f"'max_tokens' must be at least {least}{' (0 with echo)' if least else ''}, "
            f"got {max_tokens}",
            "max_tokens",
        )
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k != -1:  # -1: off
        _integer_in(body, "top_k", 1, TOP_K_END, "[1, 2**31) (or -1: off)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise bad(f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad(f"'stream_options' takes only 'include_usage', got {options!r}", "stream_options")
    if options and not stream:
        raise bad("'stream_options' needs 'stream': true", "stream_options")
    try:
        grammar = response_format_grammar(body.get("response_format"))
        tools = parse_tools(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
        )
    except FieldError as e:
        raise bad(str(e), e.param) from e
    if tools is not None and tools.forced:
        if grammar is not None:
            raise bad(
                "'response_format' cannot be combined with a forced 'tool_choice'",
                "response_format",
            )
        grammar = tools.grammar()
    return dict(
        kind=kind,
        model=body["model"],
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=None if top_k in (None, -1) else top_k,
        stop=_stop(body.get("stop")),
        stream=bool(stream),
        include_usage=bool(options.get("include_usage", False)),
        **_logprob_fields(body, kind, bool(stream)),
        **_sampling_fields(body, bool(stream)),
        grammar=grammar,
        tools=tools,
    )


# --- issue 47: seed, penalties, min_p, logit_bias, stop_token_ids, n, best_of ----------

MAX_CHOICES = 16  # n and best_of, at most: one request is at most this many in the engine


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (ids as decimal strings, bias in [-100, 100]) as
    pairs; ids against the vocabulary are the server's check."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        message = f"'logit_bias' must be an object of token id -> bias, got {value!r}"
        raise bad(message[:300], "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} ids, got {len(value)}", "logit_bias"
        )
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            raise bad(
                f"'logit_bias' keys must be token ids (digits), got {key!r}"[:300], "logit_bias"
            )
        ok = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not ok or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise bad(
                f"'logit_bias' values must be in [-100, 100], got {bias!r} for {key}"[:300],
                "logit_bias",
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _choices(body: Mapping[str, Any], stream: bool) -> tuple[int, int]:
    n, best_of = _integer(body, "n"), _integer(body, "best_of")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
    best_of = n if best_of is None else best_of
    if not n <= best_of <= MAX_CHOICES:
        raise bad(f"'best_of' must be in [n = {n}, {MAX_CHOICES}], got {best_of}", "best_of")
    if stream and best_of > n:
        raise bad("'best_of' > 'n' cannot be streamed (as OpenAI)", "best_of")
    return n, best_of


def _sampling_fields(body: Mapping[str, Any], stream: bool) -> dict[str, Any]:
    """The validated ``seed``, ``min_p``, penalties, ``logit_bias``, ``stop_token_ids``,
    ``n`` and ``best_of``: a 400 naming the field for any value out of range."""
    seed = _integer_in(body, "seed", 0, SEED_END, "[0, 2**32)")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stop_ids
    ):
        raise bad(
            f"'stop_token_ids' must be a list of token ids, got {stop_ids!r}"[:300],
            "stop_token_ids",
        )
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 1e6, low_open=True)
    n, best_of = _choices(body, stream)
    return dict(
        seed=seed,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=repetition,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        stop_token_ids=tuple(stop_ids),
        n=n,
        best_of=best_of,
    )


def _logprob_fields(body: Mapping[str, Any], kind: str, stream: bool) -> dict[str, Any]:
    """``logprobs`` / ``echo`` (completions: ``logprobs`` an integer 0-20) or ``logprobs`` /
    ``top_logprobs`` (chat: a boolean and an integer 0-20 that needs it), checked."""
    if kind == "completion":
        k = _integer(body, "logprobs")
        echo = body.get("echo")
        if not (echo is None or isinstance(echo, bool)):
            raise bad(f"'echo' must be a boolean, got {echo!r}", "echo")
        name = "logprobs"
    else:
        on, echo = body.get("logprobs"), False
        if not (on is None or isinstance(on, bool)):
            raise bad(f"'logprobs' must be a boolean, got {on!r}", "logprobs")
        k = _integer(body, "top_logprobs")
        if k is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = (k or 0) if on else None
        name = "top_logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return dict(logprobs=k, echo=bool(echo))


def parse_completion(body: Any) -> GenerationRequest:
    """A ``/v1/completions`` body: ``prompt`` is a string, a list of token ids, or a list
    of one of either."""
    fields = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return GenerationRequest(prompt=list(prompt), messages=None, **fields)
    if not isinstance(prompt, str) or not prompt:
        raise bad(
            "'prompt' must be a non-empty string or list of token ids (one prompt per "
            f"request), got {prompt!r}"[:300],
            "prompt",
        )
    return GenerationRequest(prompt=_text(prompt, "prompt"), messages=None, **fields)


def parse_completions(body: Any) -> list[GenerationRequest]:
    """A ``/v1/completions`` body whose ``prompt`` may also be a list of several prompts
    (strings, or lists of token ids: lm-evaluation-harness sends its batches so): one
    request per prompt, answered as the choices of one reply (not streamed)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    several = isinstance(prompt, list) and len(prompt) > 1
    if not several or not all(isinstance(p, str | list) for p in prompt):
        return [parse_completion(body)]
    if body.get("stream"):
        raise bad("several prompts in one request cannot be streamed", "stream")
    return [parse_completion({**body, "prompt": [p]}) for p in prompt]


def _text(text: str, param: str) -> str:
    """``text`` with no lone surrogate (a JSON ``\\ud800`` escape), which no tokenizer
    encodes: refused here as a 400 naming ``param`` (the tokenizer would fail as a 500)."""
    try:
        return checked_text(text, param)
    except ValueError as e:
        raise bad(str(e), param) from e


def parse_chat(body: Any) -> GenerationRequest:
    """A ``/v1/chat/completions`` body: ``messages`` of the roles that training records
    take too (:data:`edl.text.chat.ROLES`: system, developer (sent to the template as
    system), user, assistant, tool), text content; an assistant's ``tool_calls`` and a tool
    result's ``tool_call_id`` (OpenAI's tool loop) go to the template too."""
    fields = _common(body, "chat")
    try:
        turns = chat_turns(body.get("messages"))
    except FieldError as e:
        raise bad(str(e), e.param) from e
    return GenerationRequest(prompt=None, messages=turns, **fields)
