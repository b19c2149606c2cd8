"""`kvshare pool serve --metrics-port`: the pool's STATS as Prometheus text, parsed with prometheus_client's own parser
and checked field by field against STATS after real stores, hits, misses, a fenced lease and a discard; the endpoint
answers only GET /metrics and bounds its connections."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.metrics import COUNTERS, PREFIX, RENAMED
from kvshare.pool.testing import start_pool
from kvshare.processes import free_port
from tests.pool.conftest import NS, PAGE, new_chunks, prompt, random_bytes


def scrape(port: int) -> dict[str, tuple[str, dict[tuple, float]]]:
    """{family name: (type, {label values: value})} of GET /metrics."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        out[family.name] = (family.type, {tuple(sorted(s.labels.items())): s.value for s in family.samples
                                          if not s.name.endswith("_created")})
    return out


def store(client: PoolClient, keys, tokens, seed: int) -> None:
    data = [random_bytes(PAGE + 100, seed=seed + i) for i in range(len(keys))]
    reservation = client.reserve(NS, new_chunks(keys, tokens, PAGE + 100))
    for ref, chunk in zip(reservation.chunks, data):
        client.write(ref, chunk)
    client.commit(reservation.lease, [checksum(d) for d in data])


def test_metrics_equal_stats_after_real_traffic():
    port = free_port()
    with start_pool("32MiB", page_size=PAGE, metrics_port=port, lease_timeout=0.5) as (address, _):
        with PoolClient.connect(address) as client, PoolClient.connect(address) as other:
            client.hello(NS)
            other.hello(NS)
            keys, tokens = prompt(4)
            store(client, keys, tokens, seed=0)
            found = client.lookup(NS, keys, tokens)  # 4 chunks hit
            client.release(found.lease)
            missing, missing_tokens = prompt(3, seed=9)
            assert not client.lookup(NS, missing, missing_tokens).chunks  # 3 chunks missed (no lease to release)
            assert client.discard(NS, keys[3:]) == 1
            stalled = other.reserve(NS, new_chunks(*prompt(2, seed=5), PAGE + 100))  # never committed: expires
            deadline = time.monotonic() + 20
            while client.stats().expired_leases < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = client.stats()  # nothing changes between this and the scrape but uptime and the request counts
            metrics = scrape(port)
            other.release(stalled.lease)

    assert stats.hit_chunks == 4 and stats.miss_chunks == 3 and stats.discarded_chunks == 1
    assert stats.expired_leases == 1 and stats.clients == 2 and stats.chunks == 3
    compared = 0
    for field in stats.__struct_fields__:
        value = getattr(stats, field)
        if not isinstance(value, (int, float)) or field == "uptime_s":
            continue
        name = PREFIX + RENAMED.get(field, field)
        kind, samples = metrics[name]
        assert kind == ("counter" if field in COUNTERS else "gauge"), field
        assert samples == {(): float(value)}, field
        compared += 1
    assert compared >= 40  # capacity, pages, chunks, hits/misses, leases, clients, buffers, L2 counters...
    assert metrics[PREFIX + "uptime_seconds"][1][()] >= stats.uptime_s
    requests = metrics[PREFIX + "requests"][1]
    assert requests[(("kind", "reserve"),)] == 2 and requests[(("kind", "discard"),)] == 1
    assert metrics[PREFIX + "request_errors"][1][(("kind", "reserve"),)] == 0
    assert metrics[PREFIX + "request_latency_p99_seconds"][1][(("kind", "lookup"),)] > 0


def test_only_get_metrics_is_served_and_connections_are_bounded():
    port = free_port()
    with start_pool("8MiB", page_size=PAGE, metrics_port=port, metrics_max_connections=2, frame_timeout=1):
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/", timeout=10).status_code == 404
        assert httpx.post(f"{base}/metrics", timeout=10).status_code == 405
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # send nothing: hold both slots
        try:
            time.sleep(0.2)
            with pytest.raises(httpx.HTTPError):  # a third is closed unanswered
                httpx.get(f"{base}/metrics", timeout=5)
            for sock in idle:  # each silent connection is closed after --frame-timeout
                sock.settimeout(10)
                assert sock.recv(1) == b""
        finally:
            for sock in idle:
                sock.close()
        assert "kvshare_pool_server_capacity_bytes" in httpx.get(f"{base}/metrics", timeout=10).text

