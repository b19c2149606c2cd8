"""Lanes: the striped L2 read path. Each node (the standalone server, or every cluster master) gets `connections`
lanes; a lane is one thread owning one RespConnection. Chunks of a promotion are dealt round-robin over their node's
lanes, so consecutive chunks travel on different connections (and, in a cluster, mostly to different masters) at
the same time, and each lane pipelines: it sends every GET queued to it before it reads the first reply, and sends
newly queued ones before each further reply, so its connection never idles between values.

submit() never blocks (it only queues), so the pool's event loop may call it; prepare() may block (it discovers the
cluster's slot map) and runs on a worker thread. Each GET resolves a concurrent Future: a Received value, None for a
missing key, or L2Unavailable. Values land in buffers from a BufferPool and stay there until their holder calls
Received.release().

Why the Future is never left pending: a lane answers every request it takes, on every path (a connection error fails
the whole lane's backlog; a cancelled job's unsent requests are cancelled), so a promoter awaiting them always wakes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kvshare.pool.l2 import codec
from kvshare.pool.l2.buffers import BufferPool
from kvshare.pool.l2.config import L2Config
from kvshare.pool.l2.resp import ProtocolError, RespConnection, RespError, command
from kvshare.pool.l2.store import L2Unavailable
from kvshare.pool.l2.topology import Node, Topology, discover_cluster, standalone

log = logging.getLogger(__name__)
ALIGN = 64  # a value's payload starts at a multiple of this in its receive buffer (a cache line)
SLACK = 256  # bytes asked beyond a value's expected length (its header's length varies by a few bytes)


@dataclass
class Received:
    """An L2 value held in a pooled buffer: read `data`, then release() exactly once."""

    data: memoryview
    buffer: bytearray = field(repr=False)
    pool: BufferPool = field(repr=False)

    def release(self) -> None:
        self.data.release()
        self.pool.release(self.buffer)


@dataclass
class Job:
    """The GETs of one promotion. cancelled: its unsent GETs are dropped (set by the promoter when it stops early)."""

    cancelled: bool = False


@dataclass
class _Get:
    name: bytes
    job: Job
    expected: int  # the value's length as last seen for its namespace (0: unknown, one GET)
    future: Future = field(default_factory=Future)
    parts: int = 0  # GETRANGE pieces sent (0: a GET was sent)


class ValueTooLong(Exception):
    """Every GETRANGE piece came back full: the value is longer than expected (it is not taken)."""


class Lane:
    """One connection to one node, served by its own thread (see the module docstring)."""

    def __init__(self, node: Node, config: L2Config, buffers: BufferPool, name: str) -> None:
        self.node = node
        self.config = config
        self.buffers = buffers
        self.moved = False  # a MOVED/ASK reply was seen: the slot map is stale
        self._queue: queue.SimpleQueue[_Get | None] = queue.SimpleQueue()
        self._connection: RespConnection | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, get: _Get) -> None:
        self._queue.put(get)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while not self._stopping:
            first = self._queue.get()
            if first is None:
                break
            self._serve(deque([first]))
        self._close()

    def _serve(self, unsent: deque[_Get]) -> None:
        """Send and answer GETs until none is left: new requests are sent before each reply is read."""
        sent: deque[_Get] = deque()
        try:
            while unsent or sent:
                self._take_queued(unsent)
                self._send(unsent, sent)
                if sent:
                    self._answer(sent[0])  # stays in `sent` until answered, so an error below fails it too
                    sent.popleft()
        except Exception as error:  # OSError, ProtocolError, a bad length...: the connection is out of step
            if not isinstance(error, (OSError, ProtocolError, ValueError)):
                log.exception("L2 lane %s:%d failed", *self.node)
            self._close()
            failure = L2Unavailable(f"L2 {self.node[0]}:{self.node[1]}: GET failed: {error!r}")
            for get in (*sent, *unsent):
                _fail(get.future, failure)

    def _take_queued(self, unsent: deque[_Get]) -> None:
        while True:
            try:
                get = self._queue.get_nowait()
            except queue.Empty:
                return
            if get is None:
                self._stopping = True  # finish what is queued, then stop
                return
            unsent.append(get)

    def _send(self, unsent: deque[_Get], sent: deque[_Get]) -> None:
        wanted = []
        while unsent:
            get = unsent.popleft()
            if get.job.cancelled:
                get.future.cancel()
            else:
                wanted.append(get)
        if wanted:
            if not sent and self._connection is not None and self._connection.closed_by_peer():
                self._close()  # an idle connection the server dropped (it restarted): open a new one, no retry
            sent.extend(wanted)  # before sending: if the send fails, the error handler fails them with the rest
            self._connected().send(b"".join(self._commands(get) for get in wanted))

    def _commands(self, get: _Get) -> bytes:
        """GET, or GETRANGEs of piece_bytes covering the expected length plus SLACK: Redis copies a reply into a
        buffer of its size, and one of 8 MiB or more is a fresh allocation whose pages fault in on every GET (a third
        of the server's CPU per byte in the build machine's profile); pieces of 1 MiB reuse warm buffers."""
        piece = self.config.piece_bytes
        if not get.expected or not piece:
            return command(b"GET", get.name)
        get.parts = -(-(get.expected + SLACK) // piece)
        return b"".join(command(b"GETRANGE", get.name, j * piece, (j + 1) * piece - 1) for j in range(get.parts))

    def _answer(self, get: _Get) -> None:
        """Read the reply (or the GETRANGE pieces) of the oldest sent GET into a pooled buffer and resolve its
        future. Every reply of the GET is read whatever happens, so the connection stays in step."""
        target = _Target(self.buffers, max(get.parts * self.config.piece_bytes, 0))
        error: Exception | None = None
        short = False  # a piece came back shorter than asked: the value's end was reached
        try:
            for _ in range(max(get.parts, 1)):
                try:
                    data = self._connected().read_bulk_into(target.next_piece)
                except RespError as reply_error:  # still in step: read the remaining pieces, then fail this GET
                    self.moved = self.moved or reply_error.moved
                    error = error or L2Unavailable(f"L2 {self.node[0]}:{self.node[1]}: {reply_error}")
                    continue
                if data is not None:
                    target.filled += len(data)
                    short = short or len(data) < self.config.piece_bytes
        except BaseException:
            target.release()
            raise
        if error is None and get.parts and not short:
            error = ValueTooLong(f"{get.name!r} is longer than {get.parts} pieces")
        if error is not None or not target.filled or get.job.cancelled:
            target.release()
            if error is not None:
                _fail(get.future, error)
            elif get.job.cancelled:
                get.future.cancel()
            else:
                get.future.set_result(None)  # nil (GET) or empty (GETRANGE): not in L2
            return
        get.future.set_result(target.received())

    def _connected(self) -> RespConnection:
        if self._connection is None:
            self._connection = RespConnection(*self.node, self.config.timeout, self.config.receive_buffer)
        return self._connection

    def _close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            except OSError:
                pass
            self._connection = None


class _Target:
    """Where a value is received: one pooled buffer, its first piece placed so that the chunk's bytes start
    ALIGN-aligned (numpy hashes an unaligned uint64 view by copying it through a bounce buffer, a third of the pool's
    CPU in the build machine's profile; the copy into the arena's pages runs faster from an aligned source too), the
    next pieces right after it."""

    def __init__(self, buffers: BufferPool, capacity: int) -> None:
        self.buffers, self.capacity = buffers, capacity  # capacity 0: the first piece's length
        self.buffer: bytearray | None = None
        self.view: memoryview | None = None
        self.filled = 0

    def next_piece(self, length: int, head: bytes) -> memoryview:
        if self.buffer is None:
            if not length:
                return memoryview(bytearray())
            self.buffer = self.buffers.acquire(max(self.capacity, length) + ALIGN)
            start = (-codec.payload_offset(head) - _address(self.buffer)) % ALIGN
            self.view = memoryview(self.buffer)[start:]
        if self.filled + length > len(self.view):
            raise ValueError(f"a piece of {length} bytes overflows the {len(self.view)}-byte buffer")
        return self.view[self.filled :]

    def received(self) -> Received:
        return Received(self.view[: self.filled], self.buffer, self.buffers)

    def release(self) -> None:
        if self.buffer is not None:
            self.buffers.release(self.buffer)
            self.buffer = None


def _address(buffer: bytearray) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _fail(future: Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


class Lanes:
    """Every node's lanes and the routing of keys to them (see the module docstring)."""

    def __init__(self, config: L2Config, buffers: BufferPool) -> None:
        self.config = config
        self.buffers = buffers
        self._topology: Topology | None = None
        self._lanes: dict[Node, list[Lane]] = {}
        self._turn: dict[Node, int] = {}  # next lane of each node (round-robin)
        self._stale = False  # set by invalidate(): discover the topology again at the next prepare()
        self._lock = threading.Lock()  # guards _topology, _lanes and _turn (prepare on a worker, submit on the loop)

    @property
    def count(self) -> int:
        with self._lock:
            return sum(len(lanes) for lanes in self._lanes.values())

    def prepare(self) -> None:
        """Know the topology (discover it if unknown or stale) and have lanes for every node. Blocking: worker
        threads only. Raises L2Unavailable if no node answers."""
        with self._lock:
            stale = self._topology is None or any(lane.moved for lanes in self._lanes.values() for lane in lanes)
            stale = stale or (self._stale and self.config.cluster)
        if not stale:
            return
        try:
            topology = (discover_cluster(self.config.nodes, self.config.timeout) if self.config.cluster
                        else standalone(self.config.nodes[0]))
        except (OSError, RespError, ProtocolError, ValueError) as error:
            raise L2Unavailable(f"L2 {self.config.url}: cluster slots unavailable: {error!r}") from None
        with self._lock:
            old, self._lanes = self._lanes, {}
            for node in topology.nodes:  # a node that stays keeps its lanes: a MOVED leaves connections in step
                self._lanes[node] = old.pop(node, None) or [
                    Lane(node, self.config, self.buffers, f"l2-lane-{node[1]}-{i}")
                    for i in range(self.config.connections)]
                for lane in self._lanes[node]:
                    lane.moved = False
                self._turn.setdefault(node, 0)
            self._topology, self._stale = topology, False
        for lanes in old.values():  # nodes that left the cluster
            for lane in lanes:
                lane.stop()

    def invalidate(self) -> None:
        """A GET failed: a cluster's slot map may have changed (failover); rediscover it at the next prepare()."""
        with self._lock:
            self._stale = True

    def submit(self, names: list[bytes], job: Job, expected: int = 0) -> list[Future]:
        """Queue a GET of each name on its node's next lane; never blocks. prepare() must have succeeded once.
        `expected`: the values' length as last seen (0: unknown); with it, values come in GETRANGE pieces, and one
        longer than expected fails with ValueTooLong."""
        futures = []
        with self._lock:
            for name in names:
                index = self._topology.node_of(name)
                if index is None:
                    future: Future = Future()
                    future.set_exception(L2Unavailable(f"L2 {self.config.url}: no master serves key {name!r}"))
                    futures.append(future)
                    continue
                node = self._topology.nodes[index]
                lanes = self._lanes[node]
                get = _Get(name, job, expected)
                lanes[self._turn[node] % len(lanes)].submit(get)
                self._turn[node] += 1
                futures.append(get.future)
        return futures

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = self._lanes, {}
        for node_lanes in lanes.values():
            for lane in node_lanes:
                lane.stop()
