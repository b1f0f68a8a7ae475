"""The server's guard options: ``ServerOptions`` (an API key, the request body limit, header
/ idle timeouts, the connection limit), declared once (``edl._settings.option``): the
library (``create_app(..., options=ServerOptions(...))``, read again by ``make_server``), the
``edl serve`` flags and their ``--help`` derive from it. No web framework and no jax here,
so ``edl serve --help`` imports neither.

What enforces each (``edl.serve.guard``, ``edl.serve.server``):

- ``api_key``: an ASGI middleware; every ``/v1/*`` request needs ``Authorization: Bearer
  <key>`` (compared in constant time), else 401 with OpenAI's error body; ``/health`` is open.
- ``max_body_bytes``: an ASGI middleware counting the body as it is read: a declared
  ``Content-Length`` above it is refused before any byte is read, a chunked body the moment
  it passes it (413 naming the limit); the rest is never buffered. ``body_timeout_s``: the
  same middleware, a deadline for the whole body (408), against a client that trickles it.
- ``keep_alive_s``: uvicorn's ``timeout_keep_alive`` (an idle connection between requests).
- ``max_header_bytes``: uvicorn's ``h11_max_incomplete_event_size`` (h11, the HTTP parser
  when ``httptools`` is not installed: it bounds a header block while it is incomplete, so
  one that arrives whole in a single read is still parsed; ``httptools`` has its own
  fixed limit).
- ``header_timeout_s`` and ``max_connections``: edl's subclass of uvicorn's HTTP protocol,
  since uvicorn has neither (0.54: a connection that never finishes its headers is held
  forever, and it accepts connections until the process runs out of file descriptors).
"""

from __future__ import annotations

import dataclasses
import ipaddress

from edl._settings import check_options, option

__all__ = ["ServerOptions", "is_loopback"]

API_KEY_ENV = "EDL_API_KEY"
"""The environment variable ``edl serve`` reads the API key from when ``--api-key`` is not
given (a key on the command line is visible to every user of the machine in ``ps``)."""


def _hidden(key: object) -> str:
    """The key as ``--help`` shows a default: never the key itself."""
    return f"${API_KEY_ENV}, else none" if key is None else "(set)"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What the HTTP server accepts (see the module docstring for what enforces each)."""

    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every /v1/* request (401 otherwise; "
        f"/health stays open); ${API_KEY_ENV} keeps it out of the process list",
        text=_hidden,
    )
    max_body_bytes: int = option(
        8 * 2**20, "largest request body in bytes (413 beyond, refused while reading)", low=1
    )
    header_timeout_s: float = option(
        10.0,
        "seconds a connection gets to send a request's headers (from its opening or the "
        "end of its last reply) before it is closed",
        low=0.001,
    )
    body_timeout_s: float = option(
        60.0,
        "seconds a request's body gets to arrive whole after its headers (408 beyond)",
        low=0.001,
    )
    keep_alive_s: float = option(
        5.0, "seconds an idle connection is kept open between requests", low=0.001
    )
    max_connections: int = option(
        512,
        "open connections at most: a new one closes the oldest that is waiting for a "
        "request (or is closed itself when every one is busy)",
        low=1,
    )
    max_header_bytes: int = option(
        16384,
        "a request line + headers still incomplete past this many bytes is refused (400)",
        low=1024,
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty or blank (None: no key)")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: ``localhost`` or a loopback
    address (``127.0.0.0/8``, ``::1``); any other name or address may be reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: where it resolves is not known here
        return False
