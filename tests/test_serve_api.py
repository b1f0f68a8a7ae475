"""The OpenAI-compatible server (edl.serve.server) against the official ``openai`` client on
loopback, over a fake engine that implements edl.serve.types.Engine and 'generates' a
deterministic byte-level reply (so every expected text is known exactly), plus unit tests of
the incremental detokenizer's stop strings. The server runs in uvicorn in a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from serve_fakes import EOS, MODEL, ChatBytes, FakeEngine, fake_logprob, reply_of  # noqa: E402

from edl.serve.server import create_app, make_server  # noqa: E402
from edl.serve.types import Engine  # noqa: E402
from edl.text import ByteTokenizer  # noqa: E402
from edl.text.detokenize import IncrementalText  # noqa: E402


@contextlib.contextmanager
def serving(engine: FakeEngine, *, max_model_len: int = 256, drain_s: float = 1.0):
    """``(base_url, uvicorn server)`` of the app over ``engine`` on a free loopback port
    (``make_server``, as ``edl serve``); leaving it sends the server SIGTERM's handling."""
    app = create_app(
        engine, ChatBytes(), model_name=MODEL, max_model_len=max_model_len, stop_token_ids=[EOS]
    )
    server = make_server(app, port=0, drain_s=drain_s, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(10)
        assert not thread.is_alive()


def client(base_url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, **kw)


@pytest.fixture(scope="module")
def shared():
    engine = FakeEngine()
    with serving(engine) as (url, _):
        yield engine, url


def chat_prompt(messages) -> list[int]:
    return ChatBytes().apply_chat_template(messages, add_generation_prompt=True)


def test_completion_plain_and_stream(shared):
    engine, url = shared
    api = client(url)
    expected = reply_of(ByteTokenizer().encode("Hello"))
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=200)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    n_reply = len(expected.encode()) + 1  # the EOS is a completion token
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, n_reply)
    assert out.usage.total_tokens == 5 + n_reply
    chunks = list(
        api.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected and len(texts) > 10  # streamed, not one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_reply
    # token-id prompts, and a cut by max_tokens (mid-character: U+FFFD, as decode gives it)
    default = api.completions.create(model=MODEL, prompt="Hello")  # OpenAI's default: 16
    assert default.choices[0].text == expected[:16] and default.choices[0].finish_reason == "length"
    cut = api.completions.create(model=MODEL, prompt=[72, 105], max_tokens=21)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].text == reply_of([0, 0]).encode()[:21].decode(errors="replace")
    assert engine.threads and len(engine.threads) == 1  # every engine call: one thread


def test_n_choices_and_best_of(shared):
    """``n`` choices (choice i seeded seed + i), plain and streamed, chat too; ``best_of``
    returns the n of highest cumulative log-prob; usage counts every generated token."""
    _, url = shared
    api = client(url)
    ids = ByteTokenizer().encode("Hello")

    def want(seed):
        return reply_of(ids, seed)

    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=200, n=3, seed=10)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [want(10), want(11), want(12)]
    tokens = sum(len(want(s).encode()) + 1 for s in (10, 11, 12))
    assert out.usage.completion_tokens == tokens and out.usage.prompt_tokens == len(ids)
    # best_of 3, n 2: seeds 12 (log-prob -1 per token), then 10 (-2); 11 (-3) is dropped.
    best = api.completions.create(
        model=MODEL, prompt="Hello", max_tokens=200, n=2, extra_body={"best_of": 3}, seed=10
    )
    assert [c.text for c in best.choices] == [want(12), want(10)]
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == tokens
    chunks = list(
        api.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=200,
            n=2,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: want(4), 1: want(5)} and len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == len(want(4).encode()) + len(want(5).encode()) + 2
    messages = [{"role": "user", "content": "Hi"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, n=2, seed=0)
    prompt = chat_prompt(messages)
    assert [c.message.content for c in chat.choices] == [reply_of(prompt, 0), reply_of(prompt, 1)]
    deltas = {0: "", 1: ""}
    roles = []
    for chunk in api.chat.completions.create(
        model=MODEL, messages=messages, n=2, seed=0, stream=True
    ):
        choice = chunk.choices[0]
        deltas[choice.index] += choice.delta.content or ""
        roles += [choice.index] if choice.delta.role == "assistant" else []
    assert deltas == {0: reply_of(prompt, 0), 1: reply_of(prompt, 1)} and roles == [0, 1]


def test_n_choices_each_carry_their_logprobs(shared):
    """With ``n`` > 1 every choice has its own tokens' log-probs (completions and chat),
    not only the first one."""
    _, url = shared
    api = client(url)
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=2, seed=3, logprobs=2)
    for choice in out.choices:
        tokens = choice.logprobs.tokens
        assert "".join(tokens) == choice.text and len(tokens) == 5
        # The 2 alternatives and the sampled token, keyed by text (byte tokens may collide).
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    messages = [{"role": "user", "content": "Hi"}]
    chat = api.chat.completions.create(
        model=MODEL, messages=messages, n=2, seed=0, logprobs=True, top_logprobs=1, max_tokens=4
    )
    for choice in chat.choices:
        content = choice.logprobs.content
        assert "".join(e.token for e in content) == choice.message.content
        assert all(len(e.top_logprobs) == 1 for e in content)


def test_penalties_bias_min_p_and_stop_token_ids_reach_the_engine(shared):
    engine, url = shared
    api = client(url)
    extra = {"repetition_penalty": 1.2, "min_p": 0.1, "stop_token_ids": [ord("!")]}
    out = api.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=200,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": 5, "120": -100},
        extra_body=extra,
    )
    params = engine.params[-1]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert (params.repetition_penalty, params.min_p) == (1.2, 0.1)
    assert params.logit_bias == ((7, 5.0), (120, -100.0))
    assert params.stop_token_ids == (EOS, ord("!"))
    # The fake stops at its first "!"; the stop token is left out of the text, as EOS is.
    expected = reply_of(ByteTokenizer().encode("Hello"))
    assert out.choices[0].text == expected[: expected.index("!")]
    assert out.choices[0].finish_reason == "stop"


def test_chat_plain_and_stream(shared):
    _, url = shared
    api = client(url)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = reply_of(chat_prompt(messages))
    out = api.chat.completions.create(model=MODEL, messages=messages)
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "stop" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(chat_prompt(messages))
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert (
        chunks[-1].choices[0].finish_reason == "stop"
        and chunks[-1].object == "chat.completion.chunk"
    )
    # developer = system, text content parts joined
    halves = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    parts = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": halves}]
    again = api.chat.completions.create(model=MODEL, messages=parts)
    assert again.choices[0].message.content == expected


def test_stop_strings_trim_and_abort():
    # ~20 steps of 10 ms follow " très": the server's abort reaches the engine before the
    # reply would end (an engine with no step delay can finish it first on a loaded
    # machine, and aborting a finished request does nothing).
    engine = FakeEngine(step_delay=0.01)
    with serving(engine) as (url, _):
        _check_stop_strings(engine, url)


def test_usage_counts_tokens_up_to_a_stop_string_inside_a_run_of_tokens():
    """A speculative engine emits several tokens at once; a stop string completed by the
    third of four counts the tokens up to it, not the run's last one."""
    engine = FakeEngine(tokens_per_step=4)
    with serving(engine) as (url, _):
        want = reply_of(ByteTokenizer().encode("Hello"))
        cut = want.index(" très")
        out = client(url).completions.create(
            model=MODEL, prompt="Hello", max_tokens=100, stop=[" très"]
        )
        assert out.choices[0].text == want[:cut]
        # bytes up to the stop string's end; the run holding it carried more
        used = len((want[:cut] + " très").encode())
        assert used % 4 != 0  # the stop string ends inside a run of 4
        assert out.usage.completion_tokens == used


def _check_stop_strings(engine, url):
    api = client(url)
    expected = reply_of(ByteTokenizer().encode("Hello"))
    want = expected[: expected.index(" très")]
    aborted_before = len(engine.aborted)
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=100, stop=["zzz", " très"])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    # the tokens counted are those generated up to the stop string (no EOS)
    assert out.usage.completion_tokens == len((want + " très").encode())
    stream = api.completions.create(
        model=MODEL, prompt="Hello", max_tokens=100, stop=" très", stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stop=["→"]
    )
    assert (
        chat.choices[0].message.content
        == reply_of(chat_prompt([{"role": "user", "content": "x"}])).split("→")[0]
    )
    deadline = time.monotonic() + 5
    while len(engine.aborted) < aborted_before + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == aborted_before + 3  # each stop string aborted its request


def test_32_concurrent_streams():
    engine = FakeEngine(step_delay=0.004)
    with serving(engine) as (url, _):
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        async def one(i: int) -> tuple[str, str]:
            prompt = "x" * (i + 1)
            stream = await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=100, stream=True
            )
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            return text, reply_of(ByteTokenizer().encode(prompt))

        async def run_all():
            try:
                return await asyncio.gather(*(one(i) for i in range(32)))
            finally:
                await api.close()

        results = asyncio.run(run_all())
    assert all(text == want for text, want in results)
    assert engine.largest_batch >= 8  # they were batched, not served one after another
    assert len(engine.finished) == 32 and not engine.running


BAD = [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "echo": 1}, 400, "echo"),
    ({"model": MODEL, "prompt": ["a", "b"], "stream": True}, 400, "stream"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"x7": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"7": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"9999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": [7]}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [9999]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "seed": -5}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**80}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 300]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),  # > max_model_len 256
    ({"model": MODEL, "prompt": "x" * 200, "max_tokens": 100}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
]
BAD_CHAT = [
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1},
        400,
        "logprobs",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        400,
        "top_logprobs",
    ),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": ["hi"]}, 400, "messages[0]"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 0,
        },
        400,
        "max_tokens",
    ),
]


def _check_error(error, status: int, param: str) -> None:
    assert error.status_code == status
    full = error.response.json()
    assert set(full) == {"error"} and set(full["error"]) == {"message", "type", "param", "code"}
    assert full["error"]["param"] == param and isinstance(full["error"]["message"], str)
    assert full["error"]["type"] == "invalid_request_error"
    assert error.body == full["error"]  # what the client parsed


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_completions(shared, body, status, param):
    api = client(shared[1])
    errors = openai.NotFoundError if status == 404 else openai.BadRequestError
    extra = {k: v for k, v in body.items() if k not in ("model", "prompt")}
    with pytest.raises(errors) as caught:
        api.completions.create(model=body["model"], prompt=body["prompt"], extra_body=extra)
    _check_error(caught.value, status, param)
    if param == "prompt" and body["prompt"] == "x" * 300:
        assert caught.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
def test_bad_chats(shared, body, status, param):
    api = client(shared[1])
    extra = {k: v for k, v in body.items() if k not in ("model", "messages")}
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=body["messages"], extra_body=extra)
    _check_error(caught.value, status, param)


def test_chat_roles_and_text_are_refused_as_in_training_data(shared, tmp_path):
    from edl.text import read_records
    from edl.text.chat import ROLES

    url = shared[1]
    messages = [{"role": "user", "content": "hi"}, {"role": "hacker", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(model=MODEL, messages=messages)
    _check_error(caught.value, 400, "messages[1].role")
    refusal = f"messages[1].role must be one of {list(ROLES)}, got 'hacker'"
    assert caught.value.body["message"] == refusal
    path = tmp_path / "chat.jsonl"  # the same table, the same words, for training records
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: {refusal}")):
        list(read_records(path))
    # A lone surrogate (no tokenizer encodes it) is the client's error, named, not a 500.
    parts = [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]
    for route, body, param in [
        ("/v1/completions", {"model": MODEL, "prompt": "a\ud800"}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": parts}, "messages[0].content"),
    ]:
        status, reply = _raw(url, "POST", route, json.dumps(body).encode())
        assert (status, reply["error"]["param"]) == (400, param)
        assert f"{param} has a lone surrogate U+" in reply["error"]["message"]


def _raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_malformed_json_unknown_route_models_health(shared):
    _, url = shared
    status, body = _raw(url, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _raw(url, "GET", "/v1/nothing")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = _raw(url, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["num_total_pages"] in (None, 100)
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_queue_full_is_429():
    engine = FakeEngine(max_running=1, step_delay=0.01)
    with serving(engine, drain_s=0.5) as (url, _):
        api = client(url)
        first = api.completions.create(model=MODEL, prompt="a", max_tokens=100, stream=True)
        next(iter(first))  # the one slot is taken
        with pytest.raises(openai.RateLimitError) as caught:
            api.completions.create(model=MODEL, prompt="b")
        assert caught.value.status_code == 429
        assert caught.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        first.close()


def _wait(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_disconnect_aborts_stream_and_plain():
    engine = FakeEngine(step_delay=0.05)  # a reply takes ~3 s
    with serving(engine, drain_s=0.5) as (url, _):
        api = client(url)
        stream = api.completions.create(model=MODEL, prompt="a", max_tokens=100, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.close()  # the client goes away mid-stream
        _wait(lambda: engine.aborted == [0] and not engine.running)
        assert engine.finished == []
        # a plain request whose client gives up (times out) is aborted too
        with pytest.raises(openai.APITimeoutError):
            client(url, timeout=0.3).completions.create(model=MODEL, prompt="b", max_tokens=100)
        _wait(lambda: engine.aborted == [0, 1] and not engine.running)


def test_shutdown_drains_then_aborts_and_stops_the_engine_thread():
    engine = FakeEngine(step_delay=0.05)  # a 100-token reply takes ~3.5 s, 5 tokens ~0.3 s
    with serving(engine, drain_s=1.0) as (url, server):
        api = client(url)
        long = iter(api.completions.create(model=MODEL, prompt="a", max_tokens=100, stream=True))
        short = iter(api.completions.create(model=MODEL, prompt="b", max_tokens=5, stream=True))
        first = next(long).choices[0].text
        driver = server.config.app.state.server.driver
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        finished = list(short)  # within the drain: answered in full
        assert finished[-1].choices[0].finish_reason == "length"
        rest = list(long)  # after it: aborted, and the stream ends cleanly ([DONE])
        assert rest[-1].choices[0].finish_reason == "abort"
        text = first + "".join(c.choices[0].text for c in rest)
        assert reply_of([97]).startswith(text) and len(text) < len(reply_of([97]))
        _wait(lambda: not driver.alive)
    assert engine.aborted == [0] and engine.finished == [1] and not engine.running
    assert not driver._thread.is_alive() and driver.error is None


def test_sigterm_finishes_or_aborts_open_requests_and_exits():
    """The real signal: uvicorn stops accepting, the open stream (a 3.5 s reply) gets
    ``--drain-s`` and is then aborted (its reply ends with "abort"), the engine thread
    stops and the process exits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("serve_fakes.py")
    paths = [str(script.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            "--port",
            str(port),
            "--step-delay",
            "0.05",
            "--drain-s",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return _raw(url, "GET", "/health")[0] == 200
            except OSError:
                return False

        _wait(up, 20)
        stream = client(url).completions.create(
            model=MODEL, prompt="a", max_tokens=100, stream=True
        )
        chunks = iter(stream)
        next(chunks)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    # uvicorn re-raises the signal once shut down, so the status says SIGTERM ended it
    assert proc.returncode in (0, -signal.SIGTERM), stderr
    assert "Traceback" not in stderr, stderr  # no request was cancelled under uvicorn
    record = json.loads(stdout.strip().splitlines()[-1])
    assert record == {"aborted": [0], "finished": [], "running": [], "engine_thread_alive": False}
    rest = list(chunks)  # the stream was aborted, cleanly
    assert rest[-1].choices[0].finish_reason == "abort"
    with pytest.raises(openai.APIConnectionError):  # nothing accepts any more
        client(url).models.list()


def test_engine_failure_is_500_then_503(caplog):
    engine = FakeEngine(fail_at_step=3)
    with serving(engine) as (url, _):
        api = client(url)
        with pytest.raises(openai.InternalServerError) as caught:
            api.completions.create(model=MODEL, prompt="a")
        assert caught.value.status_code == 500 and "fell over" in caught.value.body["message"]
        assert caught.value.body["type"] == "server_error"
        with pytest.raises(openai.APIStatusError) as caught:
            api.completions.create(model=MODEL, prompt="a")
        assert caught.value.status_code == 503
        assert _raw(url, "GET", "/health")[0] == 503
    assert "the engine failed" in caplog.text
    with serving(FakeEngine(fail_at_step=3)) as (url, _):  # mid-stream: an error event
        stream = client(url).completions.create(model=MODEL, prompt="a", stream=True)
        with pytest.raises(openai.APIError, match="fell over"):
            list(stream)


def test_incremental_text_stop_across_tokens():
    tok = ByteTokenizer()
    text = IncrementalText(tok, stop=["END", "→"], stop_token_ids=[EOS])
    pieces = [text.push([t]) for t in tok.encode("ab EN")]
    assert "".join(pieces) == "ab " and not text.stopped  # "EN" held back: may become "END"
    assert text.push(tok.encode("x")) == "ENx"  # it did not
    assert text.push(tok.encode("yEND and more")) == "y" and text.stopped
    assert text.text == "ab ENxy" and text.push([65]) == "" and text.end() == ""
    # a multi-byte stop string split over tokens; U+FFFD never leaks mid-character
    text = IncrementalText(tok, stop=["→"])
    out = [text.push([t]) for t in tok.encode("a→b")]
    assert out == ["a", "", "", "", ""] and text.stopped and text.text == "a"
    # no stop: end releases what was held back; EOS left out
    text = IncrementalText(tok, stop=["ENDX"], stop_token_ids=[EOS])
    assert text.push([*tok.encode("xEND"), EOS]) == "x" and text.end() == "END"
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalText(tok, stop=[""])


class _RawTokenizer:
    """A ``tokenizers.Tokenizer`` under the decode signature of ``HFTokenizer``."""

    def __init__(self, raw) -> None:
        self.raw = raw

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_windowed_decode_concatenates_to_the_full_decode(kind):
    """Against the tokenizer's own decode of all ids: a byte-level BPE (ids that split
    UTF-8 characters) and a SentencePiece-like Metaspace one (a leading space per word)."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    if kind == "byte_level":
        raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["</s>"], initial_alphabet=alphabet
    )
    raw.train_from_iterator(["Grüße aus Köln: 東京 café, the quick brown fox."] * 4, trainer)
    tokenizer = _RawTokenizer(raw)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, raw.get_vocab_size(), 40).tolist()
        text, pieces, at = IncrementalText(tokenizer), [], 0
        while at < len(ids):
            size = int(rng.integers(1, 4))
            pieces.append(text.push(ids[at : at + size]))
            at += size
        pieces.append(text.end())
        assert "".join(pieces) == raw.decode(ids, skip_special_tokens=True)
        assert text.read <= len(ids) and text.prefix <= text.read


def test_fake_engine_is_an_engine():
    assert isinstance(FakeEngine(), Engine)


def test_cli_serve_checks_options(capsys):
    from edl.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", "--model", "m", "--max-batch", "0"])
    assert caught.value.code == 2
    assert "argument --max-batch: must be >= 1, got 0" in capsys.readouterr().err


def test_cli_serve_says_what_it_does_from_the_first_second(tmp_path, capsys):
    from edl.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", "--model", str(tmp_path / "missing")])
    assert caught.value.code == 1
    first, error = capsys.readouterr().err.splitlines()
    assert first.startswith("edl serve [") and first.endswith(
        f"]: loading {tmp_path / 'missing'} ..."
    )
    assert error.startswith("edl serve: error: ") and "missing" in error


@pytest.mark.slow  # the real engine on a tiny Llama, through the openai client (~40 s)
def test_real_tiny_model_matches_generate_text(tmp_path):
    import jax
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from edl.generate import generate_text
    from edl.models import LlamaConfig, LlamaForCausalLM
    from edl.text import load_tokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["Hello world, how are you?", "Grüße aus Köln: 東京 café"] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    model = LlamaForCausalLM.init(
        LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        key=jax.random.key(0),
    )
    from edl.serve.engine import Engine

    engine = Engine(
        model,
        max_batch=4,
        max_model_len=64,
        page_size=8,
        prefill_chunk=16,
        eos_token_ids=(tokenizer.eos_id,),
    )
    app = create_app(
        engine, tokenizer, model_name="tiny", max_model_len=64, stop_token_ids=[tokenizer.eos_id]
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started, 30)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        api = client(url)
        messages = [{"role": "user", "content": "Hello café"}]
        want = generate_text(model, tokenizer, messages=messages, max_new_tokens=12)
        out = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        assert out.choices[0].message.content == want and want
        chunks = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        want = generate_text(model, tokenizer, "how are", max_new_tokens=12)
        out = api.completions.create(model="tiny", prompt="how are", max_tokens=12, temperature=0)
        assert out.choices[0].text == want

        def stream(_):
            chunks = api.completions.create(
                model="tiny", prompt="how are", max_tokens=12, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in chunks)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:  # batched in the real engine
            assert list(pool.map(stream, range(32))) == [want] * 32
        _wait(lambda: engine.num_free_pages == engine.num_total_pages, 10)  # no page leaks
        # Clients that go away mid-stream: their requests are aborted and every page is back.
        for _ in range(3):
            # Sampled (seeded): greedy replies of this random model end early at its EOS.
            stream = api.completions.create(
                model="tiny",
                prompt="Hello world",
                max_tokens=40,
                temperature=1.0,
                seed=0,
                stream=True,
            )
            chunks = iter(stream)
            next(chunks), next(chunks)
            stream.close()
        _wait(lambda: engine.num_free_pages == engine.num_total_pages, 10)
        assert not engine.has_unfinished()
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.slow  # loads a saved tiny Llama through edl serve's path (jax, ~5 s)
def _saved_llama(directory):
    """A tiny byte-vocabulary Llama saved to ``directory``."""
    import jax

    from edl.io.formats.hf import save_pretrained
    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
    )
    save_pretrained(LlamaForCausalLM.init(config, key=jax.random.key(0)), directory)


def test_cli_serve_builds_the_engine_and_app(tmp_path, monkeypatch, capsys):
    """``edl serve`` with a stand-in ``edl.serve.engine``: the model loaded from its
    directory, the engine built with the CLI's sizes, the app given the model's EOS ids,
    max_model_len and name, then served (here: captured, not run)."""

    import edl.serve.server
    from edl.cli import main

    _saved_llama(tmp_path / "m")
    built, served = [], []

    class StandIn(FakeEngine):
        row_buckets, width_buckets, page_buckets = (1, 2, 3), (16, 64), (4, 6)

        def __init__(
            self,
            model,
            *,
            max_batch,
            max_model_len,
            eos_token_ids,
            echo,
            tokenizer,
            speculative,
            draft_model,
            kv_cache_dtype,
        ):
            super().__init__(max_running=max_batch)
            assert kv_cache_dtype == "auto"  # no --kv-cache-dtype: the model's dtype
            built.append((type(model).__name__, max_batch, max_model_len, eos_token_ids))
            assert tokenizer is None  # a byte tokenizer: no grammars (edl.serve.grammar)
            assert speculative is None and draft_model is None  # no --speculative-method
            echo("a line from the engine")

        def step_shapes(self):
            return [(1, 1, 4)] * 12

    monkeypatch.setitem(sys.modules, "edl.serve.engine", types.SimpleNamespace(Engine=StandIn))
    monkeypatch.setattr(edl.serve.server, "serve", lambda app, **kw: served.append((app, kw)))
    main(["serve", "--model", str(tmp_path / "m"), "--max-batch", "3", "--port", "8123"])
    # max_model_len: the model's positions; no generation_config: the tokenizer's EOS
    assert built == [("LlamaForCausalLM", 3, 96, (ByteTokenizer.eos_id,))]
    ((app, options),) = served
    state = app.state.server
    assert options == {"host": "127.0.0.1", "port": 8123, "drain_s": 30.0}
    assert (state.model_name, state.max_model_len) == (str(tmp_path / "m"), 96)
    assert state.stop_token_ids == (ByteTokenizer.eos_id,)  # no generation_config: the tokenizer's
    assert isinstance(state.tokenizer, ByteTokenizer)
    # What it does, on stderr from the first second, each line timed from the start.
    said = [line.split("]: ", 1) for line in capsys.readouterr().err.splitlines()]
    assert all(t.startswith("edl serve [") and t.endswith(" s") for t, _ in said), said
    assert [m for _, m in said] == [
        f"loading {tmp_path / 'm'} ...",
        f"loaded {said[1][1].split()[1]} parameters; building the engine ...",
        "a line from the engine",
        "engine ready: 12 step shapes (batch rows (1, 2, 3), prefill widths (16, 64), pages "
        "(4, 6)); compilation cache: off",
        "each step shape compiles when a request first needs it (--warmup: all now)",
        "starting the HTTP server on http://127.0.0.1:8123",
    ]


def test_cli_serve_reports_an_engine_refusal_as_one_line(tmp_path, monkeypatch, capsys):
    """What the engine refuses (speculation on a recurrent model, a draft model of another
    vocabulary) ends ``edl serve`` with one ``error:`` line and status 1, no traceback."""
    from edl.cli import main

    _saved_llama(tmp_path / "m")

    def refuse(model, **options):
        raise ValueError("speculative decoding needs a model without recurrent state")

    monkeypatch.setitem(sys.modules, "edl.serve.engine", types.SimpleNamespace(Engine=refuse))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(tmp_path / "m")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.endswith(
        "edl serve: error: the serving engine refuses this model or these options: "
        "speculative decoding needs a model without recurrent state\n"
    )
    assert "Traceback" not in err


def _fake_entries(tokens, k):
    return [(ByteTokenizer().decode([t]), fake_logprob(t, k)) for t in tokens]


def test_logprobs_in_openai_shapes(shared):
    """Log-probs as the engine reports them, in OpenAI's shapes: /v1/completions' legacy
    object (with echo: the prompt first, its first log-prob None; max_tokens 0 allowed;
    several prompts as choices), chat's ``content`` entries, streamed and not."""
    url = shared[1]
    api = client(url)
    want = reply_of(ByteTokenizer().encode("Hi"))
    out = api.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    reply = ByteTokenizer().encode(want)[:5]
    entries = _fake_entries(reply, 2)
    assert out.choices[0].text == want[:5] and lp.tokens == [t for t, _ in entries]
    assert lp.token_logprobs == [e.logprob for _, e in entries]
    assert lp.text_offset == [0, 1, 2, 3, 4]
    tok = ByteTokenizer()
    assert lp.top_logprobs[0] == {
        **{tok.decode([i]): p for i, p in entries[0][1].top},
        entries[0][0]: entries[0][1].logprob,
    }
    # lm-evaluation-harness's loglikelihood call: echo, several token-id prompts.
    prompts = [tok.encode("Hi"), tok.encode("Hey you")]
    out = api.completions.create(model=MODEL, prompt=prompts, max_tokens=0, logprobs=1, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, ids in zip(out.choices, prompts, strict=True):
        lp = choice.logprobs
        assert choice.text == tok.decode(ids) and lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == [fake_logprob(t, 1).logprob for t in ids[1:]]
    assert out.usage.prompt_tokens == 9 and out.usage.completion_tokens == 0
    # Streamed with echo: the prompt and its entries lead; offsets run over the whole text.
    chunks = list(
        api.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, logprobs=0, echo=True, stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    lps = [p for c in chunks if c.choices[0].logprobs for p in c.choices[0].logprobs.token_logprobs]
    assert text == "Hi" + want[:4] and "".join(tokens) == text
    assert offsets == list(range(6)) and lps[0] is None and None not in lps[1:]

    messages = [{"role": "user", "content": "Hi"}]
    tokens = ByteTokenizer().encode(reply_of(chat_prompt(messages)))[:6]
    out = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    for got, (text, entry) in zip(content, _fake_entries(tokens, 2), strict=True):
        assert got.token == text and got.logprob == entry.logprob
        assert got.bytes == list(text.encode()) and len(got.top_logprobs) == 2
        assert [t.logprob for t in got.top_logprobs] == [p for _, p in entry.top]
    chunks = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert plain.choices[0].logprobs is None


@pytest.mark.slow  # the real engine on a tiny Llama through the openai client (~30-60 s)
def test_real_engine_n_choices_with_a_seed_are_reproducible():
    """With a seed, ``n`` sampled choices are reproducible and choice ``i`` is the single
    request seeded ``seed + i``; ``best_of`` returns the choice of highest cumulative
    log-prob, which the engine reports (checked against a second engine in-process)."""
    import jax

    from edl.models import LlamaConfig, LlamaForCausalLM
    from edl.serve import SamplingParams
    from edl.serve.engine import Engine

    tokenizer = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    geometry = dict(max_batch=4, max_model_len=64, page_size=8, prefill_chunk=16)
    app = create_app(Engine(model, **geometry), tokenizer, model_name="tiny", max_model_len=64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started, 30)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    sampled = dict(model="tiny", prompt="Hello", max_tokens=10, temperature=1.0)
    try:
        api = client(url)
        first = api.completions.create(n=3, seed=123, **sampled)
        again = api.completions.create(n=3, seed=123, **sampled)
        texts = [c.text for c in first.choices]
        assert texts == [c.text for c in again.choices] and len(set(texts)) == 3
        for i in range(3):
            alone = api.completions.create(seed=123 + i, **sampled)
            assert alone.choices[0].text == texts[i]
        best = api.completions.create(n=1, seed=123, extra_body={"best_of": 3}, **sampled)
    finally:
        server.should_exit = True
        thread.join(10)
    engine = Engine(model, **geometry)
    prompt = tokenizer.encode("Hello")
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=123 + i))
        for i in range(3)
    ]
    logprob = {}
    while engine.has_unfinished():
        for out in engine.step():
            logprob[out.request_id] = out.cumulative_logprob
    scores = [logprob[i] for i in ids]
    assert len(set(scores)) == 3 and all(s < 0 for s in scores)
    assert best.choices[0].text == texts[scores.index(max(scores))]
