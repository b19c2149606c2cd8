"""Hostile clients of a running pool (`kvshare validate hostile --pool ADDR`): single attacks checked against what a
bounded pool does, and a flood of many hostile connections at once while an innocent client keeps working, with the
pool's memory and the innocent client's STATS latency measured (the bound: docs/security.md).

The pool's process is found from its Unix socket (SO_PEERCRED), so the flood can read its RSS; attacks that need
TCP (before authentication) run only when --pool-tcp is given. Everything is bounded: a fixed number of connections,
each sending one payload of bounded size, for a fixed time, then closed.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import psutil

from kvshare.keys import synthetic_keys, tool_namespace
from kvshare.pool import protocol as p
from kvshare.pool.client import NewChunk, PoolClient, PoolError
from kvshare.pool.holders import peer_pid

ATTACK_NAMESPACE = tool_namespace("validate-hostile")
MiB = 1 << 20


@dataclass(frozen=True)
class PoolTarget:
    address: str  # the pool's Unix socket
    tcp: str = ""  # "HOST:PORT" of its TCP listener, for the attacks before authentication ("" skips them)
    patience_s: float = 15.0  # how long an attack waits for the pool to close a connection


@dataclass(frozen=True)
class PoolVerdict:
    observed: str
    handled: bool


# ---- single attacks --------------------------------------------------------------------------------------------


def _unix(target: PoolTarget) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(target.address)
    return sock


def _tcp(target: PoolTarget) -> socket.socket:
    host, port = target.tcp.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, float]:
    """(closed by the pool within `seconds`, after how long); replies before the close are read and dropped."""
    started = time.monotonic()
    sock.settimeout(0.5)
    while time.monotonic() - started < seconds:
        try:
            if not sock.recv(65536):
                return True, time.monotonic() - started
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            return True, time.monotonic() - started
    return False, seconds


def _reply(sock: socket.socket) -> p.Reply:
    sock.settimeout(10)
    (length,) = p.HEADER.unpack(sock.recv(p.HEADER.size, socket.MSG_WAITALL))
    return p.reply_decoder.decode(sock.recv(length, socket.MSG_WAITALL))


def preauth_huge_header(target: PoolTarget) -> PoolVerdict:
    with _tcp(target) as sock:
        sock.sendall(struct.pack("<I", 64 * MiB))
        closed, after = _closed_within(sock, target.patience_s)
    return PoolVerdict(f"closed after {after:.2f} s" if closed else "still open", closed)


def preauth_malformed(target: PoolTarget) -> PoolVerdict:
    with _tcp(target) as sock:
        sock.sendall(struct.pack("<I", 5) + b"\xc1junk")
        closed, after = _closed_within(sock, target.patience_s)
    return PoolVerdict(f"closed after {after:.2f} s" if closed else "answered and kept open", closed)


def preauth_idle(target: PoolTarget) -> PoolVerdict:
    with _tcp(target) as sock:
        closed, after = _closed_within(sock, target.patience_s)
    return PoolVerdict(f"closed after {after:.1f} s" if closed else f"open after {target.patience_s:g} s", closed)


def frame_over_limit(target: PoolTarget) -> PoolVerdict:
    with _unix(target) as sock:
        sock.sendall(struct.pack("<I", 0xFFFFFFF0))
        reply = _reply(sock)
        closed, _ = _closed_within(sock, target.patience_s)
    code = reply.code if isinstance(reply, p.Error) else type(reply).__name__
    return PoolVerdict(f"{code}, {'closed' if closed else 'kept open'}", code == p.ErrorCode.TOO_LARGE and closed)


def too_many_keys(target: PoolTarget) -> PoolVerdict:
    keys = synthetic_keys("too-many-keys", 200_000)
    with PoolClient.connect(target.address, map_arena=False, timeout=30) as client:
        started = time.monotonic()
        try:
            client.lookup(ATTACK_NAMESPACE, keys, [b""] * len(keys))
            return PoolVerdict("answered a LOOKUP of 200k keys", False)
        except PoolError as error:
            took = time.monotonic() - started
            return PoolVerdict(f"{error.code} in {took * 1e3:.0f} ms", error.code == p.ErrorCode.LIMIT)


def huge_description(target: PoolTarget) -> PoolVerdict:
    with PoolClient.connect(target.address, map_arena=False) as client:
        try:
            client.hello(ATTACK_NAMESPACE, "x" * (4 * MiB))
            return PoolVerdict("kept a 4 MiB description", False)
        except PoolError as error:
            return PoolVerdict(error.code, error.code == p.ErrorCode.LIMIT)


@dataclass(frozen=True)
class PoolAttack:
    name: str
    expected: str
    needs_tcp: bool
    run: object  # Callable[[PoolTarget], PoolVerdict]


POOL_ATTACKS: tuple[PoolAttack, ...] = (
    PoolAttack("TCP: 64 MiB header before ATTACH", "closed, nothing allocated", True, preauth_huge_header),
    PoolAttack("TCP: malformed frame before ATTACH", "closed", True, preauth_malformed),
    PoolAttack("TCP: idle before ATTACH", "closed after --auth-timeout", True, preauth_idle),
    PoolAttack("frame over --max-frame", "too_large, closed", False, frame_over_limit),
    PoolAttack("LOOKUP of 200k keys", "limit, refused before decoding", False, too_many_keys),
    PoolAttack("HELLO with a 4 MiB description", "limit", False, huge_description),
)


# ---- the flood -------------------------------------------------------------------------------------------------


@dataclass
class FloodResult:
    connections: int
    by_kind: dict[str, int]
    seconds: float
    pool_rss_before: int
    pool_rss_peak: int
    pool_rss_after: int
    stats_calls: int
    stats_p50_ms: float
    stats_p99_ms: float
    stats_max_ms: float
    innocent_rounds: int  # store + load round trips of the innocent client, each checked byte for byte
    innocent_failures: int
    failure_examples: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> int:
        return self.pool_rss_peak - self.pool_rss_before


def _payloads(target: PoolTarget) -> list[tuple[str, bool, bytes]]:
    """(kind, over TCP, bytes to send) of each attacker kind; the flood cycles through them."""
    keys = b"".join(synthetic_keys("flood", 100_000))
    huge = msgspec.msgpack.encode(p.Lookup(ATTACK_NAMESPACE, [keys[i:i + 16] for i in range(0, len(keys), 16)],
                                           b"", [0] * 100_000))  # 1.9 MB: refused by --max-keys
    kinds = [("huge LOOKUP", False, p.HEADER.pack(len(huge)) + huge),
             ("idle", False, b""),
             ("malformed", False, struct.pack("<I", 5) + b"\xc1junk"),
             ("header over --max-frame", False, struct.pack("<I", 0xFFFFFFF0))]
    if target.tcp:
        kinds += [("TCP: huge header before ATTACH", True, struct.pack("<I", 64 * MiB)),
                  ("TCP: idle before ATTACH", True, b"")]
    return kinds


def flood(target: PoolTarget, connections: int = 1000, seconds: float = 10.0) -> FloodResult:
    """Open `connections` hostile connections (cycling through the kinds above), keep them sending for `seconds`
    while an innocent client calls STATS every 10 ms and stores and loads a chunk every 100 ms; then close all."""
    pool = psutil.Process(_pool_pid(target))
    before = pool.memory_info().rss
    kinds = _payloads(target)
    selector = selectors.DefaultSelector()
    by_kind: dict[str, int] = {}
    stop = threading.Event()
    innocent = _Innocent(target, stop)
    innocent.start()
    peak = before
    started = time.monotonic()
    try:
        for i in range(connections):
            kind, over_tcp, payload = kinds[i % len(kinds)]
            sock = _tcp(target) if over_tcp else _unix(target)
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, [memoryview(payload)])
            by_kind[kind] = by_kind.get(kind, 0) + 1
        while time.monotonic() - started < seconds:
            for key, events in selector.select(timeout=0.1):
                _pump(selector, key, events)
            peak = max(peak, pool.memory_info().rss)
    finally:
        stop.set()
        innocent.join()
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()
    time.sleep(0.5)
    latencies = np.asarray(innocent.latencies) * 1e3 if innocent.latencies else np.zeros(1)
    return FloodResult(connections, by_kind, seconds, before, peak, pool.memory_info().rss, len(innocent.latencies),
                       float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99)),
                       float(latencies.max()), innocent.rounds, len(innocent.failures), innocent.failures[:5])


def _pump(selector: selectors.BaseSelector, key: selectors.SelectorKey, events: int) -> None:
    """Send what is left of this attacker's payload, read and drop what the pool answers, forget it once closed."""
    sock, (left,) = key.fileobj, key.data
    try:
        if events & selectors.EVENT_READ and not sock.recv(65536):
            raise ConnectionResetError
        if events & selectors.EVENT_WRITE:
            if left:
                key.data[0] = left[sock.send(left):]
            else:
                selector.modify(sock, selectors.EVENT_READ, key.data)
    except BlockingIOError:
        pass
    except OSError:  # closed by the pool: what a bounded pool does to most of them
        selector.unregister(sock)
        sock.close()


class _Innocent(threading.Thread):
    """A well-behaved client during the flood: STATS every 10 ms (latencies kept), and every 100 ms a RESERVE, write,
    COMMIT, LOOKUP, byte-exact read and RELEASE of a fresh one-page chunk. Any failure is recorded."""

    def __init__(self, target: PoolTarget, stop: threading.Event) -> None:
        super().__init__(name="innocent-client", daemon=True)
        self.target, self.stop = target, stop
        self.latencies: list[float] = []
        self.rounds = 0
        self.failures: list[str] = []

    def run(self) -> None:
        namespace = tool_namespace(f"innocent-{os.getpid()}")
        try:
            with PoolClient.connect(self.target.address, timeout=10) as client:
                client.hello(namespace, "innocent")
                last_round = 0.0
                while not self.stop.is_set():
                    started = time.perf_counter()
                    client.stats()
                    self.latencies.append(time.perf_counter() - started)
                    if started - last_round >= 0.1:
                        last_round = started
                        self._round(client, namespace)
                    time.sleep(0.01)
        except (PoolError, OSError) as error:
            self.failures.append(f"{type(error).__name__}: {error}")

    def _round(self, client: PoolClient, namespace: bytes) -> None:
        (key,) = synthetic_keys(namespace + self.rounds.to_bytes(8, "little"), 1)
        data = os.urandom(client.page_size)
        try:
            r = client.reserve(namespace, [NewChunk(key, namespace, b"", len(data))])
            client.write(r.chunks[0], data)
            client.commit(r.lease, [0])
            found = client.lookup(namespace, [key], [b""])
            ok = len(found.chunks) == 1 and client.read(found.chunks[0]).tobytes() == data
            client.release(found.lease)
            client.discard(namespace, [key])
            if not ok:
                self.failures.append(f"round {self.rounds}: bytes read back differ")
        except PoolError as error:
            self.failures.append(f"round {self.rounds}: {error.code}: {error}")
        self.rounds += 1


def _pool_pid(target: PoolTarget) -> int:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(target.address)
        return peer_pid(sock)
