"""``AsyncEngine``: an :class:`edl.serve.types.Engine` driven from asyncio.

The engine is not thread-safe and ``step`` blocks, so ONE background thread makes every
engine call: it takes the commands the event loop queued (add, abort), runs ``step`` while
any request is unfinished, and hands each ``RequestOutput`` to its request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. It sleeps on a condition when idle.

    driver = AsyncEngine(engine)
    await driver.start()                    # in the running loop (the app's lifespan)
    request = await driver.add(prompt_ids, params)   # ValueError / QueueFull from the engine
    async for output in request:            # RequestOutput until finished
        ...
    driver.abort(request.request_id)        # frees its pages; its stream ends ("abort")
    driver.abort_all()                      # every open request, as above
    await driver.stop()                     # aborts what is left, joins the thread
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from edl.serve.types import Engine, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "EngineStopped"]

_log = logging.getLogger("edl.serve")


class EngineStopped(RuntimeError):
    """The driver is stopping or stopped, or its engine raised (``__cause__``)."""


@dataclasses.dataclass
class RequestStream:
    """One request's outputs, in order; iterating ends after the finished one (an engine
    failure raises ``EngineStopped``)."""

    request_id: int
    queue: asyncio.Queue

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise EngineStopped(f"the engine failed: {item!r}") from item
            yield item
            if item.finished:
                return


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot the engine thread takes after each step (read from any thread)."""

    running: int = 0  # admitted and not finished
    num_free_pages: int | None = None
    num_total_pages: int | None = None
    steps: int = 0
    waiting: int | None = None  # added and not yet admitted
    # Speculative decoding's draft tokens proposed and accepted so far; None: not speculating.
    spec_drafted: int | None = None
    spec_accepted: int | None = None


class AsyncEngine:
    """Runs ``engine`` in one background thread; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[tuple[Any, ...]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[int, asyncio.Queue] = {}  # owned by the engine thread
        self.error: BaseException | None = None
        self.stats = Stats()

    @property
    def alive(self) -> bool:
        """Started, not stopping, and the engine has not failed."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping and not self.error

    async def start(self) -> None:
        """Start the engine thread; it delivers outputs to the running loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start: already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="edl-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort every request still running (their streams end with ``"abort"``) and join
        the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def add(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Add a request; raises what ``engine.add_request`` raises (``ValueError``,
        ``QueueFull``), or ``EngineStopped``."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        self._submit(("add", list(prompt_ids), params, added, queue))
        request_id = await added
        return RequestStream(request_id, queue)

    def abort(self, request_id: int) -> None:
        """Abort ``request_id`` (in the engine thread, soon); its stream gets a last output
        with ``finish_reason="abort"``. Aborting a finished request does nothing."""
        self._submit(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every open request (their streams end with ``"abort"``); the engine keeps
        running and takes new requests."""
        self._submit(("abort_all",))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineStopped(f"the engine failed: {self.error!r}") from self.error
        if not self.alive:
            raise EngineStopped("the engine is not running (stopped or never started)")

    def _submit(self, command: tuple[Any, ...]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # --- the engine thread -------------------------------------------------------------

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, queue: asyncio.Queue, item: Any) -> None:
        self._call_soon(queue.put_nowait, item)

    def _resolved(self, future: asyncio.Future, request_id: int) -> None:
        """(In the loop.) The caller of ``add`` went away meanwhile: abort what it added."""
        if future.cancelled():
            self.abort(request_id)
        else:
            future.set_result(request_id)

    def _failed(self, future: asyncio.Future, error: BaseException) -> None:
        if not future.cancelled():
            future.set_exception(error)

    def _run_command(self, command: tuple[Any, ...]) -> None:
        if command[0] == "add":
            _, prompt_ids, params, future, queue = command
            try:
                request_id = self.engine.add_request(prompt_ids, params)
            except Exception as e:  # handed to the caller of add, which raises it
                self._call_soon(self._failed, future, e)
                return
            self._queues[request_id] = queue
            self._call_soon(self._resolved, future, request_id)
        elif command[0] == "abort_all":
            for request_id in list(self._queues):
                self._run_command(("abort", request_id))
        else:
            request_id = command[1]
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                self.engine.abort(request_id)
                self._deliver(queue, RequestOutput(request_id, (), True, "abort"))

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # logged, kept in .error, raised to every request
            _log.exception("edl.serve: the engine failed; every open request fails with it")
            self.error = e
            for queue in self._queues.values():
                self._deliver(queue, e)
            self._queues.clear()
            with self._cond:  # fail the adds still waiting
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "add":
                    self._call_soon(self._failed, command[3], EngineStopped(repr(e)))

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                if not (self._commands or self._stopping or engine.has_unfinished()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                if stopping and command[0] == "add":
                    self._call_soon(self._failed, command[3], EngineStopped("stopping"))
                else:
                    self._run_command(command)
            if stopping:
                for request_id in list(self._queues):
                    self._run_command(("abort", request_id))
                return
            if not engine.has_unfinished():
                continue
            for output in engine.step():
                queue = self._queues.get(output.request_id)
                if queue is None:  # aborted meanwhile
                    continue
                self._deliver(queue, output)
                if output.finished:
                    del self._queues[output.request_id]
            waiting = engine.num_waiting
            # Optional: an engine that does not speculate (the test fakes) has no counts.
            spec = getattr(engine, "speculation_counts", None) or (None, None)
            self.stats = Stats(
                len(self._queues) - waiting,
                engine.num_free_pages,
                engine.num_total_pages,
                self.stats.steps + 1,
                waiting,
                *spec,
            )
