"""The router's Prometheus metrics, in a registry of its own (so several routers in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class RouterMetrics:
    """Per replica: requests answered, errors by kind, time to first byte and to the end, in flight, healthy."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvshare_router_requests", "requests a replica answered, by the HTTP status it answered (a 5xx retried on "
            "another replica counts here too)", ["replica", "status"], registry=self.registry
        )
        self.errors = Counter(
            "kvshare_router_errors",
            "failed attempts: connect (before first byte, retried), status_5xx (retried), request_5xx (the "
            "request's own failure, relayed, not retried), stream (after first byte)",
            ["replica", "kind"],
            registry=self.registry,
        )
        self.first_byte_seconds = Histogram(
            "kvshare_router_first_byte_seconds", "dispatch to first upstream body byte", ["replica"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.latency_seconds = Histogram(
            "kvshare_router_request_seconds", "dispatch to end of the response", ["replica"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.in_flight = Gauge("kvshare_router_in_flight", "requests streaming", ["replica"], registry=self.registry)
        self.healthy = Gauge("kvshare_router_replica_healthy", "1 if in rotation", ["replica"], registry=self.registry)
        self.no_replica = Counter(
            "kvshare_router_unplaced", "requests answered 503: no healthy replica left", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
