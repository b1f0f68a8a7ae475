"""``GET /metrics`` (edl.serve.metrics): Prometheus' text format, read back with
prometheus_client's own parser; a fake clock makes every latency exact."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families
from serve_fakes import MODEL, FakeEngine, reply_of
from test_serve_api import client, serving

from edl.serve.driver import Stats
from edl.serve.metrics import ServerMetrics
from edl.text import ByteTokenizer


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of an exposition text."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_latencies_counts_and_gauges_from_a_fake_clock():
    clock = _Clock()
    stats = Stats(running=3, num_free_pages=30, num_total_pages=40, steps=7, waiting=2)
    metrics = ServerMetrics(lambda: stats, window_s=10.0, clock=clock)
    timer = metrics.timer(prompt_tokens=11)
    clock.now += 0.3  # first token 0.3 s after arrival
    timer.tokens(1)
    clock.now += 0.2
    timer.tokens(2)
    clock.now += 0.1
    timer.tokens(1)  # 4 tokens, the last 0.3 s after the first: 0.1 s per token
    timer.finish("length")
    timer.finish("stop")  # once only
    metrics.timer(prompt_tokens=5).finish("abort")  # no token: a latency, no TTFT
    got = _samples(metrics.render().decode())

    assert got[("edl:num_requests_running", ())] == 3
    assert got[("edl:num_requests_waiting", ())] == 2
    assert got[("edl:kv_cache_pages_used", ())] == 10
    assert got[("edl:kv_cache_pages_total", ())] == 40
    assert got[("edl:kv_cache_usage_perc", ())] == pytest.approx(0.25)
    assert got[("edl:prompt_tokens_total", ())] == 16
    assert got[("edl:generation_tokens_total", ())] == 4
    assert got[("edl:generation_tokens_per_second", ())] == pytest.approx(0.4)
    reasons = {"length": 1, "abort": 1}
    for reason, count in reasons.items():
        assert got[("edl:request_success_total", (("finished_reason", reason),))] == count
    assert ("edl:request_success_total", (("finished_reason", "stop"),)) not in got
    assert got[("edl:time_to_first_token_seconds_count", ())] == 1
    assert got[("edl:time_to_first_token_seconds_sum", ())] == pytest.approx(0.3)
    assert got[("edl:e2e_request_latency_seconds_count", ())] == 2
    assert got[("edl:e2e_request_latency_seconds_sum", ())] == pytest.approx(0.6)
    assert got[("edl:time_per_output_token_seconds_sum", ())] == pytest.approx(0.1)
    # Latency buckets are cumulative: 0.5 s holds the abort (0 s), not the 0.6 s reply.
    bucket = ("edl:e2e_request_latency_seconds_bucket", (("le", "0.5"),))
    assert got[bucket] == 1

    clock.now += 11  # the throughput window has passed
    assert _samples(metrics.render().decode())[("edl:generation_tokens_per_second", ())] == 0


def test_unknown_pages_read_as_nan():
    got = _samples(ServerMetrics(lambda: Stats()).render().decode())
    assert got[("edl:num_requests_running", ())] == 0
    assert got[("edl:kv_cache_usage_perc", ())] != got[("edl:kv_cache_usage_perc", ())]


def test_metrics_route_counts_what_the_server_answered():
    with serving(FakeEngine()) as (url, _):
        api = client(url)
        for _ in range(3):
            api.completions.create(model=MODEL, prompt="Hello", max_tokens=200)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            got = _samples(response.read().decode())
    reply = len(ByteTokenizer().encode(reply_of(ByteTokenizer().encode("Hello")))) + 1  # + EOS
    assert got[("edl:prompt_tokens_total", ())] == 3 * 5
    assert got[("edl:generation_tokens_total", ())] == 3 * reply
    assert got[("edl:request_success_total", (("finished_reason", "stop"),))] == 3
    assert got[("edl:time_to_first_token_seconds_count", ())] == 3
    assert got[("edl:e2e_request_latency_seconds_count", ())] == 3
    assert got[("edl:num_requests_waiting", ())] == 0
    assert got[("edl:kv_cache_pages_total", ())] == 100
