"""An OpenAI-compatible HTTP server over an :class:`edl.serve.types.Engine` (Starlette +
uvicorn: the ``edl-jax[serve]`` extra).

    app = create_app(engine, tokenizer, model_name="tiny", max_model_len=2048,
                     stop_token_ids=[tokenizer.eos_id])
    serve(app, host="127.0.0.1", port=8000)            # or: edl serve --model DIR

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain, or server-sent
events with ``"stream": true``: ``data: {chunk}`` lines in OpenAI's chunk format, then
``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus:
:mod:`edl.serve.metrics`). Requests are validated by
:mod:`edl.serve.protocol`; errors are OpenAI's body ``{"error": {"message", "type",
"param", "code"}}``: 400 for a bad request (a body that is not UTF-8 JSON, nests deeper
than 64 levels or is not an object; malformed messages, max_tokens < 1, temperature / top_p
/ top_k / seed out of range, a lone surrogate in any text, a prompt that leaves no room in
``max_model_len``), 401 without the API key (when one is set), 404 for an unknown model or
route, 408 for a body not in within ``body_timeout_s``, 413 for a body over
``max_body_bytes``, 429 when the engine's queue is full, 503 when the engine is stopped or
failed.

Guards (:class:`edl.serve.options.ServerOptions`, enforced by :mod:`edl.serve.guard`): an
API key on ``/v1/*`` (``/health`` stays open), a body limit counted while the body is read
and a deadline for it, a deadline for a connection's request headers, a connection limit
(a new connection closes the oldest one still waiting for a request), uvicorn's keep-alive
timeout and header size limit. The request body is parsed and validated in a worker
thread, and prompts are tokenized (chat templates rendered) in one tokenizer thread, so
``/health`` and the streams in flight never wait on a large request. Tests:
tests/test_serve_hardening.py.

A chat is rendered by the tokenizer's chat template with the generation
prompt; a completion prompt is encoded as transformers' ``tokenizer(prompt)``;
``max_tokens`` defaults to 16 for completions (OpenAI's default) and to the room left in
``max_model_len`` for chat.

One background thread runs the engine (:class:`edl.serve.driver.AsyncEngine`); text is
detokenized incrementally with stop strings (:mod:`edl.text.detokenize`): a stop string
ends the reply before it and aborts the request in the engine. A client that disconnects
(mid-stream, or while waiting for a plain reply) aborts its request, which frees its
pages. Shutdown (SIGTERM / SIGINT, :func:`serve` / :func:`make_server`): uvicorn stops
accepting, new requests on open connections get 503, the open requests get ``drain_s``
seconds to finish and are then aborted (their replies end with ``finish_reason: "abort"``,
streams with ``[DONE]``), then the lifespan stops the engine thread.

Tests: tests/test_serve_api.py (the ``openai`` client against a fake engine,
tests/serve_fakes.py; slow: the real engine behind ``edl serve``'s app, and the CLI's
wiring; tests/test_serve_structured.py). Log-probs (:mod:`edl.serve.logprob_replies`):
completions' ``logprobs`` / ``echo`` (lm-evaluation-harness's loglikelihood requests; several
prompts per call are answered as choices, not streamed; one prompt streams, echo too) and
chat's ``logprobs`` / ``top_logprobs``; token texts are each token decoded alone.
``response_format`` / ``tools``: :mod:`edl.serve.structured`. ``n`` choices and ``best_of``
are several engine requests answered as one reply (:mod:`edl.serve.choices`). Not
implemented, rejected with a 400 naming the field: ``suffix``. Also not done: per-request
timeouts, a queue in the driver in front of ``QueueFull`` (429 at once), TLS (put a reverse
proxy in front for it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edl.serve import protocol, responses
from edl.serve.choices import Choices, add_choices, check_token_ids
from edl.serve.driver import AsyncEngine, EngineStopped, RequestStream
from edl.serve.guard import limit_body, make_server, require_api_key, serve
from edl.serve.metrics import CONTENT_TYPE, ServerMetrics
from edl.serve.options import ServerOptions
from edl.serve.protocol import APIError, GenerationRequest
from edl.serve.reply import EventStream, Reply, ReplyContext, unless_disconnected
from edl.serve.types import Engine, QueueFull, SamplingParams
from edl.text.tokenizer import Tokenizer

__all__ = ["create_app", "make_server", "serve"]

_COMPLETION_DEFAULT_MAX_TOKENS = 16


def _error(e: APIError) -> Response:
    """OpenAI's error body, as ASCII JSON: a message may echo the client's text, whose lone
    surrogates have no UTF-8 (Starlette's ``JSONResponse`` would fail on them with a 500)."""
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return Response(
        json.dumps(e.body()), status_code=e.status, headers=headers, media_type="application/json"
    )


class _Server:
    """The routes' shared state: the driver, tokenizer and the model's limits."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        stop_token_ids: Sequence[int],
    ) -> None:
        self.driver = AsyncEngine(engine)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_model_len, self.stop_token_ids = max_model_len, tuple(stop_token_ids)
        self.created = int(time.time())
        self.open_replies = 0  # requests added and not yet answered in full
        self.metrics = ServerMetrics(lambda: self.driver.stats)
        self.draining = False  # shutting down: no new requests
        # Tokenization and chat templates run here, off the event loop (a long prompt takes
        # seconds). One thread: transformers' fast tokenizers are not safe to call from
        # several at once ("Already borrowed"), and the GIL would serialize them anyway.
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(1, "edl-tokenize")
        self.context = ReplyContext(
            self.driver, tokenizer, model_name, self.stop_token_ids, self._reply_closed
        )

    def _reply_closed(self) -> None:
        self.open_replies -= 1

    async def drain(self, drain_s: float) -> None:
        """Shutdown's first half (a signal, :func:`make_server`): refuse new requests, give
        the open ones ``drain_s`` seconds, then abort the rest, whose replies end at once
        (``finish_reason: "abort"``, streams with ``[DONE]``), so every connection closes
        cleanly before uvicorn's own timeout would cancel it."""
        self.draining = True
        deadline = time.monotonic() + drain_s
        while self.open_replies and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.open_replies:
            self.driver.abort_all()

    # --- plain routes ----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "edl",
            "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        stats, up = self.driver.stats, self.driver.alive and not self.draining
        status = "ok" if up else "draining" if self.draining else "unavailable"
        body = {
            "status": status,
            "running": stats.running,
            "waiting": stats.waiting,
            "num_free_pages": stats.num_free_pages,
            "num_total_pages": stats.num_total_pages,
        }
        return JSONResponse(body, status_code=200 if up else 503)

    async def scrape(self, request: Request) -> Response:
        """Prometheus' text format (``edl.serve.metrics``)."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # --- generation ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        reqs = await _parsed(request, protocol.parse_completions)
        if len(reqs) == 1:
            return await self._generate(request, reqs[0])
        return await self._generate_many(request, reqs)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, await _parsed(request, protocol.parse_chat))

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        tok = self.tokenizer
        if req.messages is not None:
            if getattr(tok, "chat_template", None) is None:
                raise protocol.bad(
                    f"the model {self.model_name} has no chat template: use /v1/completions",
                    "messages",
                )
            tools = None if req.tools is None else req.tools.rendered
            extra = {} if tools is None else {"tools": tools}  # the template's tool format
            try:
                return list(
                    tok.apply_chat_template(req.messages, add_generation_prompt=True, **extra)
                )
            except Exception as e:  # the template's own errors (jinja raise_exception, ...)
                raise protocol.bad(
                    f"the chat template rejected the messages: {e}", "messages"
                ) from e
        if isinstance(req.prompt, list):
            vocab = tok.vocab_size
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise protocol.bad(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt"
                )
            return req.prompt
        return list(tok.encode(req.prompt, add_bos=bool(getattr(tok, "adds_bos", False))))

    def _max_tokens(self, req: GenerationRequest, prompt_tokens: int) -> int:
        room = self.max_model_len - prompt_tokens
        if req.max_tokens == 0 and room >= 0:  # echo: the prompt's log-probs only
            return 0
        if room < 1:
            raise protocol.bad(
                f"This model's maximum context length is {self.max_model_len} tokens, and "
                f"the prompt has {prompt_tokens}: no room for a reply.",
                "messages" if req.kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        if req.max_tokens is None:  # OpenAI's defaults: 16 for completions, all room for chat
            return min(room, _COMPLETION_DEFAULT_MAX_TOKENS) if req.kind == "completion" else room
        if req.max_tokens > room:
            raise protocol.bad(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + req.max_tokens} tokens "
                f"({prompt_tokens} in the prompt, {req.max_tokens} for the completion).",
                "max_tokens",
                "context_length_exceeded",
            )
        return req.max_tokens

    async def _generate(self, request: Request, req: GenerationRequest) -> Response:
        if req.best_of > 1:
            return await self._generate_choices(request, req)
        reply = await self._start(req)
        if req.stream:
            return EventStream(
                reply.sse(),
                reply.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await reply.plain(request)

    async def _generate_many(self, request: Request, reqs: list[GenerationRequest]) -> Response:
        """Several prompts of one ``/v1/completions`` call: one engine request each, run
        together, answered as one reply's choices (``index`` in prompt order)."""
        replies: list[Reply] = []
        try:
            for req in reqs:
                replies.append(await self._start(req))
            bodies = await unless_disconnected(
                request, asyncio.gather(*(r.body() for r in replies))
            )
        finally:
            for reply in replies:
                reply.close()
        if bodies is None:
            return Response(status_code=499)
        choices = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        counts = [
            sum(b["usage"][k] for b in bodies) for k in ("prompt_tokens", "completion_tokens")
        ]
        return JSONResponse({**bodies[0], "choices": choices, "usage": responses.usage(*counts)})

    async def _prepare(self, req: GenerationRequest) -> tuple[list[int], int]:
        """Checks ``req`` against the served model; its prompt ids (tokenized off the event
        loop) and ``max_tokens``."""
        if req.model != self.model_name:  # 404, as OpenAI's model_not_found
            raise APIError(
                404,
                f"The model '{req.model}' does not exist (this server serves '{self.model_name}')",
                param="model",
                code="model_not_found",
            )
        if self.draining:
            raise APIError(
                503, "the server is shutting down", type="server_error", code="shutting_down"
            )
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self.tokenizing, self._prompt_ids, req)
        max_tokens = self._max_tokens(req, len(ids))
        check_token_ids(req, self.tokenizer.vocab_size)
        return ids, max_tokens

    async def _start(self, req: GenerationRequest) -> Reply:
        """``req`` checked, added to the engine, and its reply."""
        ids, max_tokens = await self._prepare(req)
        stream = await self._add(ids, req.sampling_params(max_tokens, self.stop_token_ids))
        return self._reply(req, stream, ids)

    def _reply(
        self, req: GenerationRequest, stream: RequestStream, ids: list[int], index: int = 0
    ) -> Reply:
        reply = Reply(self.context, req, stream, ids, self.metrics.timer(len(ids)), index)
        self.open_replies += 1  # the reply's close takes it off (context.on_close)
        return reply

    async def _add(self, ids: list[int], params: SamplingParams) -> RequestStream:
        """One request into the engine; its refusals as HTTP errors."""
        try:
            return await self.driver.add(ids, params)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is at capacity, retry later ({e})",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            ) from e
        except ValueError as e:
            raise protocol.bad(f"the engine rejected the request: {e}") from e
        except EngineStopped as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from e

    # --- issue 47: n choices / best_of (edl.serve.choices) -----------------------------

    async def _generate_choices(self, request: Request, req: GenerationRequest) -> Response:
        """``best_of`` requests in the engine (choice ``i`` seeded ``seed + i``), answered
        as ``n`` choices: all of them, or the ``n`` of highest cumulative log-prob."""
        ids, max_tokens = await self._prepare(req)
        streams = await add_choices(self, req, ids, max_tokens)
        replies = [self._reply(req, stream, ids, i) for i, stream in enumerate(streams)]
        choices = Choices(self.model_name, req, replies)
        if req.stream:
            return EventStream(
                choices.sse(),
                choices.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await choices.plain(request)


_Parsed = TypeVar("_Parsed")


async def _parsed(request: Request, parse: Callable[[Any], _Parsed]) -> _Parsed:
    """The body read (``limit_body`` stops it at ``max_body_bytes``: 413), then decoded and
    validated by ``parse`` in a worker thread: a body of megabytes takes a while to parse
    and to check for lone surrogates, and ``/health`` must not wait on it."""
    data = await request.body()
    return await asyncio.to_thread(lambda: parse(protocol.decode_body(data)))


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    stop_token_ids: Sequence[int] = (),
    options: ServerOptions | None = None,
    api_key: str | None = None,
) -> Starlette:
    """The ASGI app serving ``engine`` (see the module docstring).

    Args:
        engine: the engine; only the app's engine thread calls it, from startup on.
        tokenizer: ``edl.text.HFTokenizer`` (or anything with ``encode`` / ``decode`` /
            ``vocab_size``, and ``apply_chat_template`` / ``chat_template`` for chat).
        model_name: the ``model`` clients must name.
        max_model_len: prompt plus reply tokens at most.
        stop_token_ids: the EOS ids, passed to every request (and left out of the text).
        options: the API key and the limits (:class:`edl.serve.options.ServerOptions`;
            None: its defaults); :func:`make_server` reads the connection limits from
            ``app.state.options``.
        api_key: short for ``options.api_key``: every ``/v1/*`` request then needs
            ``Authorization: Bearer <api_key>`` (the ``openai`` client's ``api_key=``).
    """
    if max_model_len < 2:
        raise ValueError(f"create_app: max_model_len must be >= 2, got {max_model_len}")
    options = ServerOptions() if options is None else options
    if api_key is not None:
        if options.api_key not in (None, api_key):
            raise ValueError("create_app: api_key and options.api_key differ; give one")
        options = dataclasses.replace(options, api_key=api_key)
    server = _Server(engine, tokenizer, model_name, max_model_len, stop_token_ids)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.driver.start()
        try:
            yield
        finally:
            await server.driver.stop()
            server.tokenizing.shutdown(wait=False, cancel_futures=True)

    async def api_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, APIError)
        return _error(e)

    async def http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error(
            APIError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", type=kind)
        )

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.scrape, methods=["GET"]),
    ]

    async def server_error(request: Request, e: Exception) -> Response:
        # Starlette logs the traceback; the client gets OpenAI's shape, not plain text.
        return _error(APIError(500, f"internal error: {e!r}", type="server_error"))

    handlers = {APIError: api_error, HTTPException: http_error, Exception: server_error}
    # The key first: a client without it is refused before its body is read.
    key = [] if options.api_key is None else [Middleware(require_api_key, options.api_key)]
    middleware = [*key, Middleware(limit_body, options.max_body_bytes, options.body_timeout_s)]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware
    )
    app.state.server, app.state.options = server, options
    return app
