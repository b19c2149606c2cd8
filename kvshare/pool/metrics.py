"""`kvshare pool serve --metrics-port`: the pool's STATS as Prometheus text, served by the pool's own event loop.

Why the loop, and not prometheus-client's HTTP server on a thread: PoolState is loop-only (no lock; see server.py),
so a scrape must read it on the loop thread anyway, and a thread would only hand each scrape back to the loop and wait.
On the loop, a scrape is one STATS snapshot (what `kvshare pool stats` gets) rendered to ~6 KiB of text, well under a
millisecond; reads and writes are asynchronous, so a slow client holds a socket, never the loop. A client gets
`--frame-timeout` seconds to send its request and take the answer, and at most `--metrics-max-connections` are open at
once (more are closed unanswered): a flood of scrapers costs sockets and file descriptors, never the pool's clients'.

Names: every scalar STATS field as kvshare_pool_server_<field> (the replica's own kvshare_pool_* counters are the
connector's view; these are the pool's): counters (`_total`) for the fields that count since start, gauges for the
rest (booleans 0/1); per message type, requests and errors counted and p50/p99 latency over the recent window.
Per-connection lease counts stay in STATS (a label per connection id would grow without bound).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshare.pool.stats import PoolStats

log = logging.getLogger(__name__)
PREFIX = "kvshare_pool_server_"
MAX_REQUEST_HEAD = 8192  # bytes of an HTTP request line and headers; a scrape sends ~200

# The STATS fields that count since start; every other scalar field is a gauge (a value now).
COUNTERS = frozenset({
    "bytes_committed_total", "hit_chunks", "miss_chunks", "hit_tokens", "miss_tokens", "verify_failures", "evictions",
    "evicted_bytes", "expired_leases", "discarded_chunks", "no_space", "lease_limited", "l2_writes",
    "l2_write_drops", "l2_errors", "l2_hits", "l2_promotions", "l2_rejected", "l2_promoted_bytes",
    "l2_promote_seconds",
})
RENAMED = {"uptime_s": "uptime_seconds", "bytes_committed_total": "bytes_committed"}  # Prometheus' unit suffixes


def families(stats: PoolStats) -> Iterator[Metric]:
    """The metric families of one STATS snapshot."""
    for name in stats.__struct_fields__:
        value = getattr(stats, name)
        if not isinstance(value, (int, float)):  # bool is an int: 0/1
            continue  # requests (below), per-connection leases, anything else not a number
        family = CounterMetricFamily if name in COUNTERS else GaugeMetricFamily
        help_text = f"the pool's STATS field {name} (kvshare pool stats)"
        yield family(PREFIX + RENAMED.get(name, name), help_text, value=float(value))
    requests = CounterMetricFamily(PREFIX + "requests", "requests answered, by message type", labels=["kind"])
    errors = CounterMetricFamily(PREFIX + "request_errors", "requests answered with an error, by message type",
                                 labels=["kind"])
    p50 = GaugeMetricFamily(PREFIX + "request_latency_p50_seconds", "median latency over the recent requests",
                            labels=["kind"])
    p99 = GaugeMetricFamily(PREFIX + "request_latency_p99_seconds", "99th percentile latency over the recent requests",
                            labels=["kind"])
    for kind, request in stats.requests.items():
        requests.add_metric([kind], request.count)
        errors.add_metric([kind], request.errors)
        p50.add_metric([kind], request.p50_ms / 1e3)
        p99.add_metric([kind], request.p99_ms / 1e3)
    yield from (requests, errors, p50, p99)


class _StatsCollector(Collector):
    def __init__(self, snapshot: Callable[[], PoolStats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        return families(self._snapshot())


class MetricsEndpoint:
    """GET /metrics over HTTP/1.1 on the pool's loop; one request per connection (answered, then closed).

    `snapshot` must be called on the loop thread (it reads PoolState): every call here is, since the handlers are
    coroutines of that loop."""

    def __init__(self, snapshot: Callable[[], PoolStats], timeout: float, max_connections: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(snapshot))
        self.timeout, self.max_connections = timeout, max_connections
        self.open = 0

    async def start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._connection, host, port, limit=MAX_REQUEST_HEAD)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            writer.close()
            return
        self.open += 1
        try:
            await asyncio.wait_for(self._answer(reader, writer), self.timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            pass  # a client that was too slow, too big or went away: nothing to answer
        finally:
            self.open -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:2]
        path = target.split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            status, body, content_type = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        elif path != b"/metrics":
            status, body, content_type = "404 Not Found", b"this pool serves GET /metrics\n", "text/plain"
        else:
            status, body, content_type = "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + (b"" if method == b"HEAD" else body))
        await writer.drain()
