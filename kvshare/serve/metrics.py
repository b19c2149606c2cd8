"""The replica server's Prometheus metrics: one registry per app, request/TTFT/token counters and the pool's stats.

Each `ServerMetrics` owns its own `CollectorRegistry` (never prometheus-client's global one), so several servers in
one process — as in tests — never clash over metric names.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshare.connector.contract import STAT_HELP, ConnectorStats
from kvshare.engine.api import EngineLoad, Usage

# Cross-replica misses on a 32B model at 256k tokens take ~90 s to prefill; hits take well under a second.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0,
                240.0, 300.0)

# Whole requests: a short answer after a pool hit takes well under a second, a long one after a 256k prefill minutes.
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 1200.0)
# Gaps between output tokens: a few ms on an H200 decode, tens of ms on CPU, seconds while a long prefill of another
# request holds the engine's step.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 30.0)

class ConnectorStatsCollector(Collector):
    """Reads the attached connector's `ConnectorStats` at scrape time; yields nothing while no connector is attached.

    The engine thread mutates the dataclass without a lock while a scrape reads it: each field is a single int/float
    read (atomic under the GIL) and only grows, so a scrape may see one counter a step ahead of another, never a
    torn or decreasing value — acceptable for monitoring, and it keeps the engine's hot path lock-free.
    """

    def __init__(self, source: Callable[[], ConnectorStats | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        if stats is None:
            return
        for name, value in stats.values().items():  # kvshare_pool_<field>_total, as the vLLM connector exports them
            yield CounterMetricFamily(f"kvshare_pool_{name}", STAT_HELP.get(name, name.replace("_", " ")), value=value)


class ServerMetrics:
    """All metrics of one server app. Endpoint labels are route paths (a fixed set), never raw request paths."""

    def __init__(self, connector_stats: Callable[[], ConnectorStats | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("kvshare_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=reg)
        self.running = Gauge("kvshare_requests_running", "generation requests in flight", registry=reg)
        self.ttft = Histogram("kvshare_time_to_first_token_seconds",
                              "seconds from request arrival to the first generated token", ["endpoint"],
                              buckets=TTFT_BUCKETS, registry=reg)
        self.e2e = Histogram("kvshare_e2e_request_latency_seconds",
                             "seconds from request arrival to the last token of a request that finished (stop or "
                             "length); one observation per prompt", ["endpoint"], buckets=E2E_BUCKETS, registry=reg)
        self.itl = Histogram("kvshare_inter_token_latency_seconds",
                             "seconds between consecutive output tokens of a request (per-output-token latency)",
                             ["endpoint"], buckets=ITL_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("kvshare_prompt_tokens", "prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter("kvshare_generation_tokens", "tokens generated", registry=reg)
        self.local_hit_tokens = Counter("kvshare_local_hit_tokens",
                                        "prompt tokens served from this replica's own prefix cache", registry=reg)
        self.pool_hit_tokens = Counter("kvshare_pool_hit_tokens", "prompt tokens loaded from the shared pool",
                                       registry=reg)
        reg.register(ConnectorStatsCollector(connector_stats))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint=endpoint).observe(seconds)

    def observe_e2e(self, endpoint: str, seconds: float) -> None:
        self.e2e.labels(endpoint=endpoint).observe(seconds)

    def observe_itl(self, endpoint: str, seconds: float) -> None:
        self.itl.labels(endpoint=endpoint).observe(seconds)

    def observe_usage(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.local_hit_tokens.inc(usage.local_hit_tokens)
        self.pool_hit_tokens.inc(usage.pool_hit_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineLoadCollector(Collector):
    """kvshare_engine_requests and kvshare_kv_blocks_{used,total}, read from the engine at scrape time: what requests
    hold now (a request whose client left releases its blocks at the engine's next step)."""

    def __init__(self, source: Callable[[], EngineLoad]) -> None:
        self._source = source

    def collect(self):
        load = self._source()
        yield GaugeMetricFamily("kvshare_engine_requests", "requests the engine holds (queued or running)",
                                value=load.requests)
        yield GaugeMetricFamily("kvshare_kv_blocks_used", "KV blocks held by requests or by pool stores",
                                value=load.blocks_used)
        yield GaugeMetricFamily("kvshare_kv_blocks_total", "KV blocks in the cache", value=load.blocks_total)


class CountRequests:
    """ASGI middleware: counts every HTTP response by endpoint and status (streams count at their start line)."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: tuple[str, ...],
                 patterns: tuple[tuple[str, str], ...] = ()) -> None:
        self.app, self.metrics, self.endpoints, self.patterns = app, metrics, endpoints, patterns

    def endpoint(self, path: str) -> str:
        """The label of a path: itself if it is an endpoint, a pattern's label (e.g. /v1/models/{id}), else "other"."""
        if path in self.endpoints:
            return path
        return next((label for prefix, label in self.patterns if path.startswith(prefix)), "other")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = self.endpoint(scope["path"])

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
