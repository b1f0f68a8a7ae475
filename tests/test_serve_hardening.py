"""The server as an attacker meets it (edl.serve.guard, edl.serve.options, the limits in
edl.serve.server): the API key, the request body limit, connections that never finish their
headers, a flood of connections, tokenization off the event loop, and bad values that are
400s naming their field. The server runs in uvicorn in a thread over the fake engine of
tests/serve_fakes.py (one test: in a subprocess, under a low open-file limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from serve_fakes import EOS, MODEL, ChatBytes, FakeEngine, reply_of  # noqa: E402

from edl.serve.options import ServerOptions  # noqa: E402
from edl.serve.server import create_app, make_server  # noqa: E402
from edl.text import ByteTokenizer  # noqa: E402

RESPONSIVE_S = 1.0  # /health must answer within this while the server is under attack
KEY = "sk-edl-test-key"


@contextlib.contextmanager
def serving(tokenizer=None, **app_options):
    """``(host, port, uvicorn server)`` of the app over a fake engine on a free loopback
    port; ``app_options`` go to ``create_app`` (``options=``, ``api_key=``)."""
    app = create_app(
        FakeEngine(),
        tokenizer or ChatBytes(),
        model_name=MODEL,
        max_model_len=256,
        stop_token_ids=[EOS],
        **app_options,
    )
    server = make_server(app, port=0, drain_s=0.5, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield "127.0.0.1", server.servers[0].sockets[0].getsockname()[1], server
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(10)
        assert not thread.is_alive()


def request(host, port, method, path, body=None, headers=None, timeout=10.0):
    """``(status, headers, parsed JSON body)`` of one plain HTTP request."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            method, path, body=body, headers={"Content-Type": "application/json"} | (headers or {})
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def health_within(host, port, seconds=RESPONSIVE_S) -> None:
    status, _, body = request(host, port, "GET", "/health", timeout=seconds)
    assert status == 200 and body["status"] == "ok"


# --- the API key -----------------------------------------------------------------------


def test_api_key_is_required_on_v1_and_health_stays_open(monkeypatch):
    import edl.serve.guard

    compared = []
    real = edl.serve.guard.hmac.compare_digest
    monkeypatch.setattr(
        edl.serve.guard.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b)
    )
    with serving(api_key=KEY) as (host, port, _):
        url = f"http://{host}:{port}/v1"
        api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=200)
        assert out.choices[0].text == reply_of(ByteTokenizer().encode("Hello"))
        assert [m.id for m in api.models.list().data] == [MODEL]
        assert compared  # the key was compared in constant time
        for wrong in ("nope", KEY[:-1], KEY + "x"):
            bad = openai.OpenAI(base_url=url, api_key=wrong, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                bad.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            error = caught.value.response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key" and KEY not in error["message"]
        for path in ("/v1/models", "/v1/nothing"):  # every /v1 path, even an unknown one
            status, headers, body = request(host, port, "GET", path)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert headers["www-authenticate"] == "Bearer"
        health_within(host, port)  # /health needs no key


def test_create_app_options_are_checked():
    with pytest.raises(ValueError, match=r"api_key and options\.api_key differ"):
        create_app(
            FakeEngine(),
            ChatBytes(),
            model_name=MODEL,
            max_model_len=256,
            options=ServerOptions(api_key="a"),
            api_key="b",
        )
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1, got 0"):
        ServerOptions(max_body_bytes=0)
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerOptions(api_key=" ")


def _serve_args(argv, monkeypatch, env=None):
    from edl.cli import _check_serve, _parser

    monkeypatch.delenv("EDL_API_KEY", raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args = _parser().parse_args(["serve", "--model", "m", *argv])
    _check_serve(args)
    return args.options


def test_cli_server_options_flags_env_and_errors(monkeypatch, capsys):
    from edl.cli import main

    options = _serve_args(
        ["--max-body-bytes", "1000", "--header-timeout-s", "2.5", "--max-connections", "9"],
        monkeypatch,
    )
    assert options == ServerOptions(max_body_bytes=1000, header_timeout_s=2.5, max_connections=9)
    assert _serve_args([], monkeypatch, {"EDL_API_KEY": "k1"}).api_key == "k1"
    flag_wins = _serve_args(["--api-key", "k2"], monkeypatch, {"EDL_API_KEY": "k1"})
    assert flag_wins.api_key == "k2"
    for argv, env, message in [
        (["--max-body-bytes", "0"], {}, "argument max_body_bytes must be >= 1, got 0"),
        (["--api-key", ""], {}, "argument --api-key: must not be empty"),
        ([], {"EDL_API_KEY": ""}, "EDL_API_KEY is set but empty"),
    ]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as caught:
            main(["serve", "--model", "m", *argv])
        monkeypatch.delenv("EDL_API_KEY", raising=False)
        assert caught.value.code == 2
        assert message in capsys.readouterr().err
    # --help shows each option's default, never a key
    monkeypatch.setenv("EDL_API_KEY", "secret-in-env")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--max-body-bytes N" in shown and "(default: 8388608)" in shown
    assert "secret-in-env" not in shown


def test_a_warning_when_listening_beyond_loopback_without_a_key():
    from edl.cli.serve import warn_if_exposed

    said = []
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        warn_if_exposed(host, ServerOptions(), said.append)
    warn_if_exposed("0.0.0.0", ServerOptions(api_key="k"), said.append)
    assert said == []
    warn_if_exposed("0.0.0.0", ServerOptions(), said.append)
    warn_if_exposed("myhost.example", ServerOptions(), said.append)
    assert len(said) == 2 and said[0].startswith("WARNING: --host 0.0.0.0 is not a loopback")


# --- bad values: 400s naming the field, never 500 ----------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_VALUES = [
    ({"model": MODEL, "prompt": "hi", "seed": -5}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**32}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**80}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "top_k": 2**31}, 400, "top_k"),  # int32 in the engine
    ({"model": MODEL, "prompt": "hi", "stop": ["ok", "\ud800"]}, 400, "stop"),
    ({"model": "\ud800", "prompt": "hi"}, 404, "model"),  # echoed in the message
    ({"model": MODEL, "prompt": "hi", "\udfff": 1}, 400, "\udfff"),  # echoed too
]


@pytest.fixture(scope="module")
def plain():
    """``(host, port)`` of one server with the default options, for the requests that
    leave nothing behind."""
    with serving() as (host, port, _):
        yield host, port


@pytest.mark.parametrize(("body", "status", "param"), BAD_VALUES)
def test_bad_values_are_4xx_naming_the_field(plain, body, status, param):
    got, _, reply = request(*plain, "POST", "/v1/completions", json.dumps(body))
    assert (got, reply["error"]["param"]) == (status, param), reply


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (DEEP, "nests arrays / objects deeper than 64 levels"),
        (b'{"model": "m", "prompt": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001, "deeper"),
        (b'{"model": "m", "max_tokens": ' + b"1" * 5000 + b"}", "not valid JSON"),  # int limit
        (b'{"model": "\xff"}', "not UTF-8"),
        (b"[]", "must be a JSON object, got list"),
        (b'"text"', "must be a JSON object, got str"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_400(plain, raw, says):
    status, _, reply = request(*plain, "POST", "/v1/chat/completions", raw)
    assert status == 400 and says in reply["error"]["message"], reply
    health_within(*plain)


# --- the body limit, and /health while a big request comes in -------------------------


def _asgi_post(app, chunks):
    """POST ``chunks`` (a chunked body: no Content-Length) to ``app``'s /v1/completions
    through ASGI directly; ``(status, body, chunks read)``."""
    read, sent = [0], []

    async def receive():
        if read[0] < len(chunks):
            read[0] += 1
            return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": True}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), read[0]


def test_the_body_limit_stops_reading_a_chunked_body():
    limit = 3 * 2**20
    app = create_app(
        FakeEngine(),
        ChatBytes(),
        model_name=MODEL,
        max_model_len=256,
        options=ServerOptions(max_body_bytes=limit),
    )
    chunks = [b" " * 2**20] * 40  # 40 MiB offered, 1 MiB at a time
    status, reply, read = _asgi_post(app, chunks)
    assert status == 413 and read == 4  # stopped at the chunk that passed 3 MiB
    assert f"limit of {limit} bytes (max_body_bytes;" in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def test_health_answers_while_a_30_mb_request_is_refused():
    body = json.dumps({"model": MODEL, "prompt": "x" * (30 * 2**20)}).encode()
    with serving() as (host, port, _):
        result = {}

        def big():
            result["reply"] = request(host, port, "POST", "/v1/completions", body, timeout=60)

        sender = threading.Thread(target=big)
        sender.start()
        polls = 0
        while sender.is_alive() or polls == 0:
            health_within(host, port)
            polls += 1
        sender.join()
        status, _, reply = result["reply"]
        assert status == 413 and "limit of 8388608 bytes" in reply["error"]["message"]
        # the same connection shape with a declared length over the limit and no body:
        # refused from the headers alone
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 31457280\r\n\r\n"
            )
            assert s.recv(4096).startswith(b"HTTP/1.1 413 ")


def _whole_response(s: socket.socket) -> bytes:
    """One HTTP response read whole (its head and ``Content-Length`` bytes), however the
    network splits it: one ``recv`` may return the head alone."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed inside the response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed inside the body: {body!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_body_that_never_arrives_whole_is_408():
    with serving(options=ServerOptions(body_timeout_s=0.3)) as (host, port, _):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 100\r\n\r\n{"model": '
            )
            reply = _whole_response(s)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "within 0.3 s" in error["message"]
        assert "(body_timeout_s; 10 bytes came)" in error["message"]
        health_within(host, port)


class _Blocking(ChatBytes):
    """A tokenizer whose ``encode`` / chat template wait for the test (as a 30 MB prompt
    would keep it busy) on prompts that start with ``BLOCK``."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def _hold(self, text):
        if text.startswith("BLOCK") or text.startswith("<user>BLOCK"):
            self.entered.set()
            assert self.release.wait(20), "the test never released the tokenizer"

    def encode(self, text, **kw):
        self._hold(text)
        return super().encode(text, **kw)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_tokenization_runs_off_the_event_loop(route):
    tokenizer = _Blocking()
    with serving(tokenizer) as (host, port, _):
        api = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0)
        result = {}

        def slow():
            if route == "chat":
                messages = [{"role": "user", "content": "BLOCK me"}]
                out = api.chat.completions.create(model=MODEL, messages=messages)
                result["text"] = out.choices[0].message.content
            else:
                out = api.completions.create(model=MODEL, prompt="BLOCK me", max_tokens=200)
                result["text"] = out.choices[0].text

        sender = threading.Thread(target=slow)
        sender.start()
        try:
            assert tokenizer.entered.wait(10)
            health_within(host, port)  # the loop is free while the prompt is tokenized
        finally:
            tokenizer.release.set()
            sender.join(20)
        assert result["text"].startswith("You sent ")


# --- connections: header deadline, connection limit ------------------------------------


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` within ``within`` seconds (EOF or reset; what it
    sends before, the rest of a reply, is read and dropped)."""
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def test_connections_that_never_finish_their_headers_are_closed():
    options = ServerOptions(header_timeout_s=0.5)
    with serving(options=options) as (host, port, _):
        silent = socket.create_connection((host, port))
        partial = socket.create_connection((host, port))
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        trickle = socket.create_connection((host, port))
        # after a whole request, the next one's headers get the same deadline
        reused = socket.create_connection((host, port))
        reused.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reused.recv(4096).startswith(b"HTTP/1.1 200 ")
        reused.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(8):  # a byte every 0.1 s does not extend the deadline (0.5 s)
            with contextlib.suppress(OSError):
                trickle.sendall(b"X")
            time.sleep(0.1)
        for s in (silent, partial, trickle, reused):
            assert _closed_by_server(s, 5.0)
            s.close()
        health_within(host, port)


def test_a_flood_of_connections_is_capped_and_health_still_answers():
    options = ServerOptions(max_connections=16, header_timeout_s=60.0)
    with serving(options=options) as (host, port, server):
        flood = []
        for _ in range(50):
            s = socket.create_connection((host, port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            flood.append(s)
            # Pacing only: the server thread gets the GIL, so the listen backlog (16, as
            # the limit) does not fill and make connects wait for SYN retries.
            time.sleep(0.002)
        health_within(host, port)  # a new client gets in: the oldest waiting one went
        closed = sum(_closed_by_server(s, 2.0) for s in flood[:34])
        assert closed == 34  # at most 16 open: the oldest were closed
        assert len(server.server_state.connections) <= 16
        for s in flood:
            s.close()


def test_uvicorn_gets_its_own_limits_and_headers_past_the_size_are_400():
    options = ServerOptions(keep_alive_s=2.5, max_header_bytes=4096)
    with serving(options=options) as (host, port, server):
        assert server.config.timeout_keep_alive == 2.5
        assert server.config.h11_max_incomplete_event_size == 4096
        with socket.create_connection((host, port), timeout=5) as s:
            # h11 counts a header block while it is incomplete (one that arrives whole in
            # one read is parsed): 8 KiB of headers with no end yet is refused
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192)
            assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
        health_within(host, port)


def test_a_connection_limit_the_process_cannot_open_is_refused_at_start():
    resource = pytest.importorskip("resource")
    from edl.serve.guard import ensure_fd_limit

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(ValueError, match=rf"max_connections {hard} needs \d+ open files"):
        ensure_fd_limit(hard)


def test_a_flood_past_the_open_file_limit_leaves_no_traceback():
    """300 connections that never finish their headers against a server (a subprocess)
    whose process may open 256 files: it stays under the limit (no failing accept, no
    traceback on stderr) and answers /health."""
    resource = pytest.importorskip("resource")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("serve_fakes.py")
    paths = [str(script.parents[1]), os.environ.get("PYTHONPATH", "")]
    options = json.dumps({"max_connections": 32, "header_timeout_s": 60.0})

    def limit_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            "--port",
            str(port),
            "--drain-s",
            "0.1",
            "--options",
            options,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        preexec_fn=limit_files,
    )
    flood = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health_within("127.0.0.1", port, 5.0)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "no server"
                time.sleep(0.1)
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /health HTTP/1.1\r\n")
            flood.append(s)
            time.sleep(0.001)  # pacing only: a full listen backlog makes connects retry (1 s)
        for _ in range(3):
            health_within("127.0.0.1", port)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
        for s in flood:
            s.close()
    assert "Traceback" not in stderr and "out of system resource" not in stderr, stderr[-3000:]
