"""One request's reply (:class:`Reply`): the engine's outputs as text pieces, with their
log-probs, sent as one JSON body or as server-sent events; and the response classes that
abort the request when the client goes away (``edl.serve.server`` builds them)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edl.serve import responses, structured
from edl.serve.driver import AsyncEngine, EngineStopped, RequestStream
from edl.serve.logprob_replies import ReplyLogprobs
from edl.serve.metrics import RequestTimer
from edl.serve.protocol import APIError, GenerationRequest
from edl.text.detokenize import IncrementalText
from edl.text.tokenizer import Tokenizer

__all__ = ["EventStream", "Reply", "ReplyContext", "disconnected", "unless_disconnected"]

FINISH_REASONS = ("stop", "length", "abort")  # the engine's; a reply adds "tool_calls"


@dataclasses.dataclass(frozen=True)
class ReplyContext:
    """What a reply needs of its server: the driver (to abort its request), the tokenizer,
    the served model's name, the EOS ids (left out of the text), and ``on_close``, called
    once when the reply ends (the server counts open replies for its drain)."""

    driver: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    stop_token_ids: tuple[int, ...]
    on_close: Callable[[], None]


class EventStream(StreamingResponse):
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


async def disconnected(receive: Any) -> None:
    """Returns when the client has disconnected (its ``http.disconnect`` message)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Any) -> Any:
    """``await work``, or None (``work`` cancelled) if the client disconnects first."""
    working = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait({working, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not working.done():
            return None
        try:
            return working.result()
        except EngineStopped as e:
            raise APIError(500, str(e), type="server_error") from e
    finally:
        for task in (working, watcher):
            task.cancel()
        await asyncio.gather(working, watcher, return_exceptions=True)


class Reply:
    """One request's reply: the engine's outputs as text pieces, sent plain or streamed;
    it aborts the request unless the engine finished it."""

    def __init__(
        self,
        context: ReplyContext,
        req: GenerationRequest,
        stream: RequestStream,
        prompt: list[int],
        timer: RequestTimer,
        index: int = 0,
    ) -> None:
        self.context, self.req, self.stream, self.timer = context, req, stream, timer
        self.index, self.cumulative_logprob = index, 0.0  # its choice; best_of's ranking
        self.prompt, self.prompt_tokens, self.completion_tokens = prompt, len(prompt), 0
        wanted = req.logprobs is not None
        self.logprobs = ReplyLogprobs(context.tokenizer, req.kind, prompt) if wanted else None
        self.id = responses.new_id(req.kind)
        self.text = IncrementalText(
            context.tokenizer,
            stop=req.stop,
            stop_token_ids=context.stop_token_ids + req.stop_token_ids,  # left out of the text
        )
        self.done = self.closed = False
        self.sent_chars = 0  # text streamed so far (the legacy log-probs' text_offset)
        self.echoed = not req.echo  # echo: the prompt leads the first piece
        # Tool calls (edl.serve.structured): their text is held back, then parsed.
        tools = req.tools is not None and req.tools.choice != "none"
        self.tool_text = structured.ToolText() if tools else None
        self.tool_calls: list[dict[str, Any]] = []

    def _finish(self, piece: str, reason: str) -> tuple[str, str]:
        """The last piece and finish reason, tool calls taken out of the text."""
        self.timer.finish(reason)
        if self.tool_text is None:
            return piece, reason
        piece = self.tool_text.push(piece)
        rest, self.tool_calls = self.tool_text.end()
        return piece + rest, "tool_calls" if self.tool_calls and reason == "stop" else reason

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        """``(text, finish_reason)``; the last has a finish reason (``tool_calls`` are
        then in ``self.tool_calls``)."""
        async for out in self.stream:
            self.cumulative_logprob = out.cumulative_logprob
            self.timer.tokens(len(out.new_token_ids))
            if self.logprobs is not None:
                self.logprobs.take(out)
            piece = self._echo()
            # Token by token: a stop string may end inside a speculative run of several
            # tokens, and the reply counts only the tokens up to the one that completes it.
            for token in out.new_token_ids:
                self.completion_tokens += 1
                piece += self.text.push([token])
                if self.text.stopped:
                    break
            if self.text.stopped:  # a stop string: the reply ends here
                self.context.driver.abort(self.stream.request_id)
                self.done = True
                yield self._finish(piece, "stop")
                return
            if out.finished:
                if out.finish_reason not in FINISH_REASONS:  # the engine broke the contract
                    raise RuntimeError(
                        f"the engine finished request {out.request_id} with "
                        f"finish_reason {out.finish_reason!r}, not one of "
                        f"{FINISH_REASONS}"
                    )
                self.done = True
                yield self._finish(piece + self.text.end(), out.finish_reason)
                return
            if self.tool_text is not None:
                piece = self.tool_text.push(piece)
            if piece:
                yield piece, None

    def _echo(self) -> str:
        """With ``echo``, once (at the engine's first output, which brings the prompt's
        log-probs): the prompt's text, its log-prob entries put first."""
        if self.echoed:
            return ""
        self.echoed = True
        if self.logprobs is not None:
            self.logprobs.echo()
        return self.context.tokenizer.decode(self.prompt)

    def close(self) -> None:
        """The reply's end (once; from ``finally`` blocks): the request leaves the engine
        if it has not finished."""
        if self.closed:
            return
        self.closed = True
        self.context.on_close()
        if not self.done:
            self.context.driver.abort(self.stream.request_id)

    def response(self, text: str, finish: str | None) -> dict[str, Any]:
        """The non-streamed body of this reply (a choice of ``index`` 0) once collected:
        ``text``, ``finish``, its log-probs and tool calls, usage of this reply alone."""
        args = (self.id, self.context.model_name)
        counts = (self.prompt_tokens, self.completion_tokens)
        logprobs = None if self.logprobs is None else self.logprobs.sent(0)
        if self.req.kind == "chat":
            content = text if text or not self.tool_calls else None
            return responses.chat_response(
                *args, content, finish, *counts, logprobs, self.tool_calls
            )
        return responses.completion_response(*args, text, finish, *counts, logprobs)

    async def body(self) -> dict[str, Any]:
        """The whole reply's JSON body, once the engine has finished it."""
        texts, finish = [], None
        async for piece, reason in self.pieces():
            texts.append(piece)
            finish = reason
        return self.response("".join(texts), finish)

    def events(self, piece: str, finish: str | None) -> Iterator[str]:
        """The server-sent events of one piece of ``pieces()``: in chat the last piece's
        text, its tool calls and its finish reason are separate chunks, as OpenAI's."""
        if finish is None or self.req.kind != "chat":
            yield self._chunk(piece, finish)
            return
        if piece:
            yield self._chunk(piece, None)
        if self.tool_calls:
            delta = {"tool_calls": structured.delta_tool_calls(self.tool_calls)}
            body = responses.chat_chunk(
                self.id, self.context.model_name, delta, None, index=self.index
            )
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        yield self._chunk("", finish)

    async def plain(self, request: Request) -> Response:
        """Collect the reply, aborting it if the client disconnects meanwhile."""
        try:
            body = await unless_disconnected(request, self.body())
        finally:
            self.close()
        # None: the client is gone, nobody reads the answer.
        return Response(status_code=499) if body is None else JSONResponse(body)

    def _chunk(self, piece: str | None, finish: str | None, usage: Any = None) -> str:
        model, chat = self.context.model_name, self.req.kind == "chat"
        sending = piece is not None and self.logprobs is not None
        logprobs = self.logprobs.sent(self.sent_chars) if sending else None
        self.sent_chars += len(piece or "")
        if chat:
            delta = None if piece is None else ({"content": piece} if piece else {})
            body = responses.chat_chunk(self.id, model, delta, finish, usage, logprobs, self.index)
        else:
            body = responses.completion_chunk(
                self.id, model, piece, finish, usage, logprobs, self.index
            )
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events: chat opens with the assistant role; a content chunk per
        piece; the finish reason; usage when asked; ``[DONE]``."""
        try:
            if self.req.kind == "chat":
                body = responses.chat_chunk(
                    self.id, self.context.model_name, {"role": "assistant", "content": ""}, None
                )
                yield f"data: {json.dumps(body)}\n\n"
            try:
                async for piece, finish in self.pieces():
                    for event in self.events(piece, finish):
                        yield event
            except EngineStopped as e:  # the status is sent: an error event, as vLLM's
                error = APIError(500, str(e), type="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            if self.req.include_usage:
                usage = responses.usage(self.prompt_tokens, self.completion_tokens)
                yield self._chunk(None, None, usage)
            yield "data: [DONE]\n\n"
        finally:
            self.close()
