"""Several choices of one request (OpenAI's ``n`` and ``best_of``, issue 47) as one reply.

The server adds ``best_of`` requests to the engine (choice ``i`` seeded ``seed + i``,
``edl.serve.protocol.GenerationRequest.sampling_params``) and hands their per-request
replies (``edl.serve.reply.Reply``: text pieces, completion tokens, the cumulative
log-prob of the sampled tokens) to :class:`Choices`, which answers them together: plain,
the ``n`` choices (all of them, or with ``best_of > n`` the ``n`` of highest cumulative
log-prob, as OpenAI and vLLM pick) with usage summed over every generated choice; streamed,
each choice's chunks under its ``index`` as they come, then usage and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edl.serve import protocol, responses
from edl.serve.driver import EngineStopped
from edl.serve.protocol import APIError, GenerationRequest
from edl.serve.reply import Reply, disconnected

__all__ = ["Choices", "add_choices", "check_token_ids"]


def check_token_ids(req: GenerationRequest, vocab: int) -> None:
    """The ids ``logit_bias`` and ``stop_token_ids`` name lie in the vocabulary (else a
    400 naming the field)."""
    for field, ids in (
        ("logit_bias", [i for i, _ in req.logit_bias]),
        ("stop_token_ids", list(req.stop_token_ids)),
    ):
        bad = [i for i in ids if i >= vocab]
        if bad:
            raise protocol.bad(
                f"'{field}' token id {bad[0]} is outside the vocabulary [0, {vocab})", field
            )


async def add_choices(
    server: Any, req: GenerationRequest, ids: list[int], max_tokens: int
) -> list[Any]:
    """The ``best_of`` engine requests of one request (choice ``i`` seeded ``seed + i``),
    all or none: a refusal (``server._add``'s HTTP error) aborts those already added."""
    streams: list[Any] = []
    try:
        for i in range(req.best_of):
            params = req.sampling_params(max_tokens, server.stop_token_ids, i)
            streams.append(await server._add(ids, params))
    except APIError:
        for stream in streams:
            server.driver.abort(stream.request_id)
        raise
    return streams


class Choices:
    """The replies of one request's choices (``replies[i]`` is choice ``i``) for the served
    model ``model_name``."""

    def __init__(self, model_name: str, req: GenerationRequest, replies: Sequence[Reply]) -> None:
        self.model_name, self.req, self.replies = model_name, req, list(replies)
        for reply in self.replies[1:]:  # one response id over every chunk
            reply.id = self.replies[0].id

    def close(self) -> None:
        for reply in self.replies:
            reply.close()

    def _usage(self) -> dict[str, int]:
        completion = sum(reply.completion_tokens for reply in self.replies)
        return responses.usage(self.replies[0].prompt_tokens, completion)

    async def plain(self, request: Request) -> Response:
        """Collect every choice, aborting all if the client disconnects meanwhile."""

        async def collect(reply: Any) -> tuple[str, str | None]:
            texts, reason = [], None
            async for piece, finish in reply.pieces():
                texts.append(piece)
                reason = finish
            return "".join(texts), reason

        collecting = asyncio.ensure_future(asyncio.gather(*map(collect, self.replies)))
        watcher = asyncio.ensure_future(disconnected(request.receive))
        try:
            await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client is gone: nobody reads the answer
                return Response(status_code=499)
            try:
                results = collecting.result()
            except EngineStopped as e:
                raise APIError(500, str(e), type="server_error") from e
        finally:
            for task in (collecting, watcher):
                task.cancel()
            await asyncio.gather(collecting, watcher, return_exceptions=True)
            self.close()
        order = range(len(self.replies))
        if self.req.best_of > self.req.n:  # the n most likely, highest first (stable on ties)
            order = sorted(order, key=lambda i: -self.replies[i].cumulative_logprob)
        chosen = list(order)[: self.req.n]
        bodies = [self.replies[i].response(*results[i]) for i in chosen]
        body = bodies[0]
        body["choices"] = [{**b["choices"][0], "index": j} for j, b in enumerate(bodies)]
        body["usage"] = self._usage()
        return JSONResponse(body)

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events: each choice's chunks (``_Reply._chunk``, its ``index``) in
        the order they come; usage when asked; ``[DONE]``."""
        queue: asyncio.Queue[tuple[Any, str, str | None] | None] = asyncio.Queue()

        async def pump(reply: Any) -> None:
            try:
                async for piece, finish in reply.pieces():
                    await queue.put((reply, piece, finish))
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(reply)) for reply in self.replies]
        try:
            chat = self.req.kind == "chat"
            if chat:
                for reply in self.replies:  # each choice opens with the assistant role
                    delta = {"role": "assistant", "content": ""}
                    body = responses.chat_chunk(
                        reply.id, self.model_name, delta, None, index=reply.index
                    )
                    yield f"data: {json.dumps(body)}\n\n"
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                    continue
                reply, piece, finish = item
                for event in reply.events(piece, finish):
                    yield event
            failed = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
            if failed:
                if not isinstance(failed[0], EngineStopped):
                    raise failed[0]
                error = APIError(500, str(failed[0]), type="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            if self.req.include_usage:
                yield self.replies[0]._chunk(None, None, self._usage())
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()
