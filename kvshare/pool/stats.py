"""The pool's STATS: the typed counters the server keeps and a bounded latency recorder per message type."""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np

LATENCY_WINDOW = 10_000  # most recent requests per type that p50/p99 are computed over


class RequestStats(msgspec.Struct):
    count: int = 0
    errors: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0


class PoolStats(msgspec.Struct):
    """A snapshot of the pool. Pages: free + reserved + committed + quarantined + unprepared == num_pages."""

    capacity_bytes: int = 0
    page_size: int = 0
    num_pages: int = 0
    pages_free: int = 0  # prepared and unused
    pages_used: int = 0  # reserved + committed + quarantined
    pages_reserved: int = 0
    pages_committed: int = 0
    pages_quarantined: int = 0  # kept from reuse: fenced write leases' pages, discarded chunks still being read (I10)
    pages_prepared: int = 0
    ready: bool = False  # every page prepared
    chunks: int = 0  # committed chunks
    namespaces: int = 0
    bytes_stored: int = 0  # sum of committed chunks' nbytes now
    bytes_committed_total: int = 0  # since start
    hit_chunks: int = 0
    miss_chunks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    verify_failures: int = 0  # a key was found but its stored tokens or parent differed (counted as a miss)
    evictions: int = 0
    evicted_bytes: int = 0
    read_leases: int = 0
    write_leases: int = 0
    expired_leases: int = 0  # leases fenced at their deadline (since start)
    fenced_leases: int = 0  # now: expired or orphaned by a closed connection, holder possibly still copying (I10)
    fenced_pages: int = 0  # pages those leases keep from reuse (pinned chunks and quarantined pages)
    discarded_chunks: int = 0  # removed by DISCARD after failing a reader's verification (I11, since start)
    no_space: int = 0  # RESERVE answers "no space"
    max_leased_pages_per_client: int = 0  # 0: no limit
    leased_pages_by_client: dict[int, int] = {}  # connection id -> pages its leases pin now
    lease_limited: int = 0  # LOOKUPs shortened and RESERVEs refused by the per-client limit
    l2_writes: int = 0  # chunks written behind to L2
    l2_write_drops: int = 0  # write-behinds not written: queue full, L2 down or failing, arena bytes != checksum
    l2_errors: int = 0  # failed Redis calls (timeout, connection, OOM, cluster errors)
    l2_hits: int = 0  # chunks found in L2 and verified during LOOKUPs
    l2_promotions: int = 0  # chunks copied from L2 into L1
    l2_rejected: int = 0  # L2 values refused on promotion (bad checksum, header, tokens or parent)
    l2_enabled: bool = False  # the pool has an L2 tier (--l2)
    l2_promoted_bytes: int = 0  # bytes of the chunks promoted (their rate: l2_promoted_bytes / l2_promote_seconds)
    l2_promote_seconds: float = 0.0  # wall time of the promotions that promoted something, start to last COMMIT
    clients: int = 0
    buffered_bytes: int = 0  # of frames being received now, all connections together (at most --max-buffered)
    frames_waiting: int = 0  # connections whose frame waits for that budget
    uptime_s: float = 0.0
    requests: dict[str, RequestStats] = {}


class LatencyRecorder:
    """Per message type: count, errors and the last LATENCY_WINDOW latencies (bounded memory)."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._samples: dict[str, deque] = {}

    def record(self, kind: str, seconds: float, error: bool) -> None:
        counts = self._counts.setdefault(kind, [0, 0])
        counts[0] += 1
        counts[1] += int(error)
        self._samples.setdefault(kind, deque(maxlen=LATENCY_WINDOW)).append(seconds)

    def snapshot(self) -> dict[str, RequestStats]:
        out = {}
        for kind, (count, errors) in sorted(self._counts.items()):
            ms = np.asarray(self._samples[kind]) * 1e3
            out[kind] = RequestStats(count, errors, float(np.percentile(ms, 50)), float(np.percentile(ms, 99)))
        return out
