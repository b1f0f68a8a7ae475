"""An OpenAI-compatible HTTP server over an :class:`edl.serve.types.Engine` (Starlette +
uvicorn: the ``edl-jax[serve]`` extra).

    app = create_app(engine, tokenizer, model_name="tiny", max_model_len=2048,
                     stop_token_ids=[tokenizer.eos_id])
    serve(app, host="127.0.0.1", port=8000)            # or: edl serve --model DIR

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain, or server-sent
events with ``"stream": true``: ``data: {chunk}`` lines in OpenAI's chunk format, then
``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Requests are validated by
:mod:`edl.serve.protocol`; errors are OpenAI's body ``{"error": {"message", "type",
"param", "code"}}``: 400 for a bad request (malformed JSON or messages, max_tokens < 1,
temperature / top_p out of range, a prompt that leaves no room in ``max_model_len``), 404
for an unknown model or route, 429 when the engine's queue is full, 503 when the engine is
stopped or failed. A chat is rendered by the tokenizer's chat template with the generation
prompt; a completion prompt is encoded as transformers' ``tokenizer(prompt)``;
``max_tokens`` defaults to 16 for completions (OpenAI's default) and to the room left in
``max_model_len`` for chat.

One background thread runs the engine (:class:`edl.serve.driver.AsyncEngine`); text is
detokenized incrementally with stop strings (:mod:`edl.serve.detokenize`): a stop string
ends the reply before it and aborts the request in the engine. A client that disconnects
(mid-stream, or while waiting for a plain reply) aborts its request, which frees its
pages. Shutdown (SIGTERM / SIGINT, :func:`serve` / :func:`make_server`): uvicorn stops
accepting, new requests on open connections get 503, the open requests get ``drain_s``
seconds to finish and are then aborted (their replies end with ``finish_reason: "abort"``,
streams with ``[DONE]``), then the lifespan stops the engine thread.

Tests: tests/test_serve_api.py (the ``openai`` client against a fake engine,
tests/serve_fakes.py; slow: the real engine behind ``edl serve``'s app, and the CLI's
wiring). ``n`` choices and ``best_of`` are several engine requests answered as one reply
(:mod:`edl.serve.choices`). Not implemented, rejected with a 400 naming the field:
``logprobs``, tools, ``response_format``, ``echo``, ``suffix``, several prompts in one
/v1/completions call. Also not done: an API key, metrics
(Prometheus), per-request timeouts, a queue in the driver in front of ``QueueFull`` (429 at
once), tokenization off the event loop (chat templates of long conversations take
milliseconds there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edl.serve import protocol
from edl.serve.choices import Choices as _Choices
from edl.serve.choices import add_choices, check_token_ids
from edl.serve.detokenize import IncrementalText
from edl.serve.driver import AsyncEngine, EngineStopped, RequestStream
from edl.serve.protocol import APIError, GenerationRequest
from edl.serve.types import Engine, QueueFull, SamplingParams
from edl.text.tokenizer import Tokenizer

__all__ = ["create_app", "make_server", "serve"]

_COMPLETION_DEFAULT_MAX_TOKENS = 16
_FINISH_REASONS = ("stop", "length", "abort")


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _EventStream(StreamingResponse):
    """A streaming response that always watches for the client's disconnect and then
    cancels the body iterator, whatever ASGI spec version the server reports; ``on_close``
    runs at the end in any case (even if the body never started)."""

    def __init__(self, content: Any, on_close: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def body() -> None:
            await self.stream_response(send)
            watcher.cancel()

        streaming = asyncio.ensure_future(body())
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watcher):
                task.cancel()
            await asyncio.gather(streaming, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()
        # A failure of the body (not the client going away: OSError on send) is raised.
        error = None if streaming.cancelled() else streaming.exception()
        if error is not None and not isinstance(error, OSError):
            raise error


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


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
        self.draining = False  # shutting down: no new requests

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
            "num_free_pages": stats.num_free_pages,
            "num_total_pages": stats.num_total_pages,
        }
        return JSONResponse(body, status_code=200 if up else 503)

    # --- generation ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, protocol.parse_completion(await _json(request)))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, protocol.parse_chat(await _json(request)))

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        tok = self.tokenizer
        if req.messages is not None:
            if getattr(tok, "chat_template", None) is None:
                raise protocol.bad(
                    f"the model {self.model_name} has no chat template: use /v1/completions",
                    "messages",
                )
            try:
                return list(tok.apply_chat_template(req.messages, add_generation_prompt=True))
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
        ids = self._prompt_ids(req)
        max_tokens = self._max_tokens(req, len(ids))
        check_token_ids(req, self.tokenizer.vocab_size)
        if req.best_of > 1:
            return await self._generate_choices(request, req, ids, max_tokens)
        stream = await self._add(ids, req.sampling_params(max_tokens, self.stop_token_ids))
        reply = _Reply(self, req, stream, len(ids))
        self.open_replies += 1  # _Reply's plain / sse take it off when they end
        if req.stream:
            return _EventStream(
                reply.sse(),
                reply.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await reply.plain(request)

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

    async def _generate_choices(
        self, request: Request, req: GenerationRequest, ids: list[int], max_tokens: int
    ) -> Response:
        """``best_of`` requests in the engine (choice ``i`` seeded ``seed + i``), answered
        as ``n`` choices: all of them, or the ``n`` of highest cumulative log-prob."""
        streams = await add_choices(self, req, ids, max_tokens)
        replies = [_Reply(self, req, stream, len(ids), i) for i, stream in enumerate(streams)]
        self.open_replies += len(replies)  # each reply's close takes its own off
        choices = _Choices(self, req, replies)
        if req.stream:
            return _EventStream(
                choices.sse(),
                choices.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await choices.plain(request)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise protocol.bad(f"the request body is not valid JSON: {e}") from e


class _Reply:
    """One request's reply: the engine's outputs as text pieces, sent plain or streamed;
    it aborts the request unless the engine finished it."""

    def __init__(
        self,
        server: _Server,
        req: GenerationRequest,
        stream: RequestStream,
        prompt_tokens: int,
        index: int = 0,
    ) -> None:
        self.server, self.req, self.stream = server, req, stream
        self.index, self.cumulative_logprob = index, 0.0  # its choice; best_of's ranking
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.id = protocol.new_id(req.kind)
        self.text = IncrementalText(
            server.tokenizer,
            stop=req.stop,
            stop_token_ids=server.stop_token_ids + req.stop_token_ids,  # left out of the text
        )
        self.done = self.closed = False

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        """``(text, finish_reason)``; the last has a finish reason."""
        async for out in self.stream:
            self.completion_tokens += len(out.new_token_ids)
            self.cumulative_logprob = out.cumulative_logprob
            piece = self.text.push(out.new_token_ids)
            if self.text.stopped:  # a stop string: the reply ends here
                self.server.driver.abort(self.stream.request_id)
                self.done = True
                yield piece, "stop"
                return
            if out.finished:
                if out.finish_reason not in _FINISH_REASONS:  # the engine broke the contract
                    raise RuntimeError(
                        f"the engine finished request {out.request_id} with "
                        f"finish_reason {out.finish_reason!r}, not one of "
                        f"{_FINISH_REASONS}"
                    )
                self.done = True
                yield piece + self.text.end(), out.finish_reason
                return
            if piece:
                yield piece, None

    def close(self) -> None:
        """The reply's end (once; from ``finally`` blocks): the request leaves the engine
        if it has not finished."""
        if self.closed:
            return
        self.closed = True
        self.server.open_replies -= 1
        if not self.done:
            self.server.driver.abort(self.stream.request_id)

    async def plain(self, request: Request) -> Response:
        """Collect the reply, aborting it if the client disconnects meanwhile."""

        async def collect() -> tuple[str, str | None]:
            texts, reason = [], None
            async for piece, finish in self.pieces():
                texts.append(piece)
                reason = finish
            return "".join(texts), reason

        collecting = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client is gone: nobody reads the answer
                return Response(status_code=499)
            try:
                text, finish = collecting.result()
            except EngineStopped as e:
                raise APIError(500, str(e), type="server_error") from e
        finally:
            for task in (collecting, watcher):
                task.cancel()
            await asyncio.gather(collecting, watcher, return_exceptions=True)
            self.close()
        build = protocol.chat_response if self.req.kind == "chat" else protocol.completion_response
        return JSONResponse(
            build(
                self.id,
                self.server.model_name,
                text,
                finish,
                self.prompt_tokens,
                self.completion_tokens,
            )
        )

    def _chunk(self, piece: str | None, finish: str | None, usage: Any = None) -> str:
        model, chat = self.server.model_name, self.req.kind == "chat"
        if chat:
            delta = None if piece is None else ({"content": piece} if piece else {})
            body = protocol.chat_chunk(self.id, model, delta, finish, usage, self.index)
        else:
            body = protocol.completion_chunk(self.id, model, piece, finish, usage, self.index)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events: chat opens with the assistant role; a content chunk per
        piece; the finish reason; usage when asked; ``[DONE]``."""
        try:
            if self.req.kind == "chat":
                body = protocol.chat_chunk(
                    self.id, self.server.model_name, {"role": "assistant", "content": ""}, None
                )
                yield f"data: {json.dumps(body)}\n\n"
            try:
                async for piece, finish in self.pieces():
                    if finish is not None and self.req.kind == "chat":
                        if piece:
                            yield self._chunk(piece, None)
                        yield self._chunk("", finish)
                    else:
                        yield self._chunk(piece, finish)
            except EngineStopped as e:  # the status is sent: an error event, as vLLM's
                error = APIError(500, str(e), type="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            if self.req.include_usage:
                usage = protocol.usage(self.prompt_tokens, self.completion_tokens)
                yield self._chunk(None, None, usage)
            yield "data: [DONE]\n\n"
        finally:
            self.close()


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    stop_token_ids: Sequence[int] = (),
) -> Starlette:
    """The ASGI app serving ``engine`` (see the module docstring).

    Args:
        engine: the engine; only the app's engine thread calls it, from startup on.
        tokenizer: ``edl.text.HFTokenizer`` (or anything with ``encode`` / ``decode`` /
            ``vocab_size``, and ``apply_chat_template`` / ``chat_template`` for chat).
        model_name: the ``model`` clients must name.
        max_model_len: prompt plus reply tokens at most.
        stop_token_ids: the EOS ids, passed to every request (and left out of the text).
    """
    if max_model_len < 2:
        raise ValueError(f"create_app: max_model_len must be >= 2, got {max_model_len}")
    server = _Server(engine, tokenizer, model_name, max_model_len, stop_token_ids)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.driver.start()
        try:
            yield
        finally:
            await server.driver.stop()

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
    ]

    async def server_error(request: Request, e: Exception) -> Response:
        # Starlette logs the traceback; the client gets OpenAI's shape, not plain text.
        return _error(APIError(500, f"internal error: {e!r}", type="server_error"))

    handlers = {APIError: api_error, HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = server
    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal also starts the app's drain."""

    def __init__(self, config: uvicorn.Config, server: _Server, drain_s: float) -> None:
        super().__init__(config)
        self.app_server, self.drain_s = server, drain_s
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.loop is not None:  # the signal may come in any thread: wake the loop
            drain = partial(self.app_server.drain, self.drain_s)
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(drain()))


def make_server(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_s: float = 30.0,
    log_level: str = "info",
) -> uvicorn.Server:
    """A uvicorn server for ``app`` (:func:`create_app`); ``.run()`` serves until SIGTERM /
    SIGINT, then: uvicorn stops accepting, the open requests get ``drain_s`` seconds to
    finish and are then aborted (their replies end with ``finish_reason: "abort"``), the
    lifespan stops the engine thread. ``port=0`` picks a free port
    (``server.servers[0].sockets[0].getsockname()`` once ``server.started``)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_s + 10
    )
    return _DrainingServer(config, app.state.server, drain_s)


def serve(app: Starlette, **options: Any) -> None:
    """``make_server(app, **options).run()``: serve until SIGTERM / SIGINT."""
    make_server(app, **options).run()
