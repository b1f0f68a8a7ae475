"""``GET /metrics``: the server's state and latencies in Prometheus' text format.

Names follow vLLM's (``vllm:`` becomes ``edl:``), so dashboards written for it need only
the prefix changed:

- gauges read at scrape time from the engine thread's last snapshot
  (``edl.serve.driver.Stats``): ``edl:num_requests_running``, ``edl:num_requests_waiting``,
  ``edl:kv_cache_pages_used``, ``edl:kv_cache_pages_total``, ``edl:kv_cache_usage_perc``
  (0-1), and ``edl:generation_tokens_per_second`` over the last ``window_s`` seconds;
- counters: ``edl:prompt_tokens_total``, ``edl:generation_tokens_total``,
  ``edl:request_success_total{finished_reason}``; with speculative decoding
  (``edl.serve.speculation``) ``edl:spec_decode_num_draft_tokens_total`` and
  ``edl:spec_decode_num_accepted_tokens_total`` (the engine's counts, as of its last step);
- histograms: ``edl:time_to_first_token_seconds``, ``edl:e2e_request_latency_seconds``,
  ``edl:time_per_output_token_seconds`` (per request, after its first token).

``prometheus_client`` (the reference client library) writes the format; each app has its
own registry, so several apps in one process (tests) do not share numbers.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from edl.serve.driver import Stats

__all__ = ["CONTENT_TYPE", "RequestTimer", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: from a few ms (a warm CPU step) to minutes (a long reply under load).
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Throughput:
    """Generated tokens per second over the last ``window_s`` seconds (thread-safe)."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s, self.clock = window_s, clock
        self.events: collections.deque[tuple[float, int]] = collections.deque()
        self.lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self.lock:
            self.events.append((self.clock(), tokens))

    def rate(self) -> float:
        now = self.clock()
        with self.lock:
            while self.events and self.events[0][0] < now - self.window_s:
                self.events.popleft()
            return sum(n for _, n in self.events) / self.window_s


class _SpeculationCounters:
    """vLLM's speculative decoding counters, read from the engine's counts at scrape time
    (a collector: the engine thread counts, the snapshot carries the totals); none while
    the engine does not speculate."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:  # prometheus_client's protocol
        s = self.stats()
        if s.spec_drafted is None or s.spec_accepted is None:
            return
        yield CounterMetricFamily(
            "edl:spec_decode_num_draft_tokens",
            "Draft tokens proposed by speculative decoding.",
            value=s.spec_drafted,
        )
        yield CounterMetricFamily(
            "edl:spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target model's verification.",
            value=s.spec_accepted,
        )


class ServerMetrics:
    """One app's metrics; ``stats`` gives the driver's latest ``Stats`` at scrape time."""

    def __init__(
        self,
        stats: Callable[[], Stats],
        *,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"ServerMetrics: window_s must be > 0, got {window_s}")
        self.registry = CollectorRegistry()
        self.clock = clock
        self.throughput = _Throughput(window_s, clock)
        r = self.registry

        def gauge(name: str, doc: str, read: Callable[[Stats], float | None]) -> None:
            def value() -> float:
                got = read(stats())
                return float("nan") if got is None else float(got)

            Gauge(name, doc, registry=r).set_function(value)

        gauge("edl:num_requests_running", "Requests running in the engine.", _running)
        gauge("edl:num_requests_waiting", "Requests waiting to be admitted.", _waiting)
        gauge("edl:kv_cache_pages_used", "KV-cache pages in use.", _pages_used)
        gauge("edl:kv_cache_pages_total", "KV-cache pages in the pool.", _pages_total)
        gauge("edl:kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).", _usage)
        Gauge(
            "edl:generation_tokens_per_second",
            f"Generated tokens per second over the last {window_s:g} s.",
            registry=r,
        ).set_function(self.throughput.rate)
        self.prompt_tokens = Counter("edl:prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter("edl:generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter(
            "edl:request_success",
            "Requests answered in full, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        r.register(_SpeculationCounters(stats))
        self.ttft = Histogram(
            "edl:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "edl:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "edl:time_per_output_token_seconds",
            "Seconds per generated token after the first, per request.",
            buckets=_PER_TOKEN_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        """The exposition text (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def timer(self, prompt_tokens: int) -> RequestTimer:
        """A request's timer, started now (call when the request arrives)."""
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self, self.clock())


class RequestTimer:
    """One request's clock: ``tokens(n)`` as its tokens arrive, ``finish(reason)`` once
    (a reply that ends without a finish reason, e.g. a client gone, records no latency)."""

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.first: float | None = None
        self.count = 0
        self.done = False

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        if self.first is None:
            self.first = self.metrics.clock()
            self.metrics.ttft.observe(self.first - self.start)
        self.count += n
        self.metrics.generation_tokens.inc(n)
        self.metrics.throughput.add(n)

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m, now = self.metrics, self.metrics.clock()
        m.finished.labels(finished_reason=reason).inc()
        m.latency.observe(now - self.start)
        if self.first is not None and self.count > 1:
            m.per_token.observe((now - self.first) / (self.count - 1))


def _running(s: Stats) -> int:
    return s.running


def _waiting(s: Stats) -> int | None:
    return s.waiting


def _pages_total(s: Stats) -> int | None:
    return s.num_total_pages


def _pages_used(s: Stats) -> int | None:
    if s.num_total_pages is None or s.num_free_pages is None:
        return None
    return s.num_total_pages - s.num_free_pages


def _usage(s: Stats) -> float | None:
    used = _pages_used(s)
    return None if used is None or not s.num_total_pages else used / s.num_total_pages
