"""What the server does before a request reaches a route (``edl.serve.options.ServerOptions``
says which limits; ``edl.serve.server`` wires them):

- :func:`guarded_protocol`: uvicorn's HTTP protocol with a header deadline and a connection
  limit, which uvicorn lacks. A connection must finish a request's headers within
  ``header_timeout_s`` of opening (or of the end of its last reply), else it is closed;
  trickling a byte at a time does not extend it. At ``max_connections`` open, a new
  connection closes the oldest one that is waiting for a request (idle, or mid-headers),
  or, when every open one has a request in progress, is closed itself: file descriptors stay
  bounded and a slow-headers flood cannot lock out a fresh client.
- :func:`require_api_key` and :func:`limit_body`: ASGI middlewares (401 without the key on
  ``/v1/*``; 413 past the body limit: a larger ``Content-Length`` before the body is read,
  a chunked body as soon as it passes the limit).
- :func:`ensure_fd_limit`: the process's open-file limit raised to fit ``max_connections``,
  or an error naming it.
- :func:`make_server` (and :func:`serve`): uvicorn configured with all of the above, whose
  first exit signal also drains the app's open requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from edl.serve.options import ServerOptions
from edl.serve.protocol import APIError

__all__ = [
    "BodyTooLarge",
    "ensure_fd_limit",
    "guarded_protocol",
    "limit_body",
    "make_server",
    "require_api_key",
    "serve",
]

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

FD_RESERVE = 64
"""File descriptors kept for what is not a connection (the listening socket, the event
loop, the engine's threads and files) when :func:`ensure_fd_limit` sizes the limit."""


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol (``AutoHTTPProtocol``: httptools' when
    installed, else h11's) with the header deadline and connection limit of this module's
    docstring; pass it as ``uvicorn.Config(http=...)``. Each call makes a new class: its
    connection table belongs to one server."""

    class Guarded(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        waiting: ClassVar[dict[Guarded, None]] = {}  # waiting for headers, oldest first
        open: ClassVar[set[Guarded]] = set()  # open, and not closed by this guard

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._armed_cycle: Any = None
            Guarded.open.add(self)
            self._arm()
            if len(Guarded.open) > max_connections:
                victim = next((c for c in Guarded.waiting if c is not self), self)
                victim._close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # a request started: its headers are complete

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()  # may start a pipelined request at once
            if not self.transport.is_closing() and self.cycle is cycle:
                self._arm()  # the rest of this body and the next headers: one deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            Guarded.open.discard(self)
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._armed_cycle = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._close)
            Guarded.waiting[self] = None

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            Guarded.waiting.pop(self, None)

        def _close(self) -> None:
            self._disarm()
            Guarded.open.discard(self)
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{AutoHTTPProtocol.__name__}"
    return Guarded


def accept_backlog(max_connections: int) -> int:
    """The listening socket's backlog, which is also how many connections asyncio accepts
    in one go, before any of them reaches the guard (``connection_made`` runs a loop turn
    or two later): bounded so that a burst cannot overshoot ``max_connections`` by much."""
    return min(128, max_connections)


def ensure_fd_limit(max_connections: int) -> None:
    """Raise the soft limit on open files (``RLIMIT_NOFILE``) to what ``max_connections``
    needs (plus two accept bursts, :func:`accept_backlog`, and :data:`FD_RESERVE`) when
    it is lower and the hard limit allows; ``ValueError`` naming
    ``max_connections`` when it does not (accepting past the limit makes every accept fail,
    each failure logged with a traceback). Nothing on a platform without ``resource``."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to read
        return
    # A burst is accepted before the guard sees it: up to a backlog per loop turn, for
    # the two turns until connection_made runs.
    need = max_connections + 2 * accept_backlog(max_connections) + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(
            f"max_connections {max_connections} needs {need} open files (with accept bursts "
            f"and {FD_RESERVE} kept for the rest), but this process may open {hard} at most "
            "(RLIMIT_NOFILE): lower max_connections or raise the limit (ulimit -n)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


async def _send_error(send: Any, error: APIError, headers: dict[str, str] | None = None) -> None:
    """OpenAI's error body as a whole response (ASCII JSON: any echoed text encodes)."""
    body = json.dumps(error.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Any, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


def require_api_key(app: ASGIApp, api_key: str) -> ASGIApp:
    """``app`` behind ``Authorization: Bearer <api_key>`` for every path under ``/v1/``
    (compared with ``hmac.compare_digest``: the time taken does not tell how much of a
    guess was right); else 401 ``invalid_api_key`` before the body is read."""
    expected = f"Bearer {api_key}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, expected):
                what = "no API key" if not given else "an incorrect API key"
                error = APIError(
                    401,
                    f"{what} was provided: send 'Authorization: Bearer <key>' with the key "
                    "the server was started with (--api-key / EDL_API_KEY)",
                    code="invalid_api_key",
                )
                return await _send_error(send, error, {"www-authenticate": "Bearer"})
        await app(scope, receive, send)

    return guarded


class BodyTooLarge(APIError):
    """413: the request body passed ``max_body_bytes`` (raised from ``receive``, so the
    route reading the body stops there; the app's ``APIError`` handler answers it)."""

    def __init__(self, limit: int, seen: str) -> None:
        super().__init__(
            413,
            f"the request body is larger than this server's limit of {limit} bytes "
            f"(max_body_bytes; {seen})",
            code="request_too_large",
        )


def limit_body(app: ASGIApp, max_bytes: int, timeout_s: float) -> ASGIApp:
    """``app`` with request bodies of at most ``max_bytes``, whole within ``timeout_s`` of
    the headers: a larger ``Content-Length`` is answered 413 before any of the body is read;
    a body without one (chunked) raises :class:`BodyTooLarge` from ``receive`` as soon as
    it passes the limit, so nothing past it is buffered; a body still incomplete at the
    deadline raises a 408 (a client trickling its body would hold the connection and the
    route forever). (Starlette's own ``max_body_size`` answers a declared length with a
    plain-text 413 whatever the app's handlers say; OpenAI's clients expect JSON.)"""

    async def limited(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            error = BodyTooLarge(max_bytes, f"Content-Length: {int(declared)}")
            return await _send_error(send, error)
        seen, more = 0, True
        deadline = asyncio.get_running_loop().time() + timeout_s

        async def counted() -> Any:
            nonlocal seen, more
            if not more:  # the body is in: what follows is the wait for a disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _body_timeout(timeout_s, seen) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                more = message.get("more_body", False)
                if seen > max_bytes:
                    raise BodyTooLarge(max_bytes, f"{seen} bytes read when it stopped")
            return message

        await app(scope, counted, send)

    return limited


def _body_timeout(timeout_s: float, seen: int) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {timeout_s} s of its headers "
        f"(body_timeout_s; {seen} bytes came)",
        code="request_timeout",
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal also starts the app's drain."""

    def __init__(self, config: uvicorn.Config, server: Any, drain_s: float) -> None:
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
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_s: float = 30.0,
    log_level: str = "info",
) -> uvicorn.Server:
    """A uvicorn server for ``app`` (``edl.serve.server.create_app``; also importable from
    there); ``.run()`` serves until SIGTERM /
    SIGINT, then: uvicorn stops accepting, the open requests get ``drain_s`` seconds to
    finish and are then aborted (their replies end with ``finish_reason: "abort"``), the
    lifespan stops the engine thread. ``port=0`` picks a free port
    (``server.servers[0].sockets[0].getsockname()`` once ``server.started``).

    The connection limits are ``app.state.options``' (:class:`ServerOptions`): uvicorn's
    ``timeout_keep_alive`` and ``h11_max_incomplete_event_size``, and edl's header deadline
    and connection limit (:func:`guarded_protocol`); the process's
    open-file limit is raised to fit ``max_connections`` (:func:`ensure_fd_limit`)."""
    options: ServerOptions = app.state.options
    ensure_fd_limit(options.max_connections)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=drain_s + 10,
        http=guarded_protocol(options.header_timeout_s, options.max_connections),
        timeout_keep_alive=options.keep_alive_s,  # type: ignore[arg-type]  # a float works
        h11_max_incomplete_event_size=options.max_header_bytes,
        backlog=accept_backlog(options.max_connections),
    )
    return _DrainingServer(config, app.state.server, drain_s)


def serve(app: Any, **options: Any) -> None:
    """``make_server(app, **options).run()``: serve until SIGTERM / SIGINT."""
    make_server(app, **options).run()
