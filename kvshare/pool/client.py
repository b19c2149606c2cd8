"""PoolClient: the typed, thread-safe, blocking client of the pool's control plane, with a zero-copy arena view.

Data plane: the client maps the arena itself and copies chunk bytes in and out of `pages`; the pool never sees
them. Control plane: one request/response at a time on one socket, under a lock, with a timeout on every call.
"""

from __future__ import annotations

import os
import socket
import threading

import msgspec
import numpy as np

from kvshare import checksum as chunk_checksum
from kvshare.pool import protocol as p
from kvshare.pool.arena import Mapping
from kvshare.pool.protocol import ChunkRef, NewChunk
from kvshare.pool.stats import PoolStats

SEND_BUFFER = 4 << 20  # SO_SNDBUF of a Unix-socket connection (see _open_socket)


class LookupResult(msgspec.Struct, frozen=True):
    """A LOOKUP's hit: the longest verified prefix of the keys, pinned by a read lease until RELEASE."""

    lease: int  # 0: nothing found (no lease is held)
    chunks: list[ChunkRef]  # chunks[i] is keys[i]


Reservation = p.ReserveReply  # Reservation(lease: int, chunks: list[ChunkRef | None]) (None: skip, do not write)
__all__ = [
    "ChunkRef", "LookupResult", "NewChunk", "PoolClient", "PoolError", "PoolUnavailable", "Reservation", "checksum",
]


class PoolError(Exception):
    """The pool answered with an error; `code` is a protocol.ErrorCode value, the message says what to do."""

    def __init__(self, message: str, code: str = p.ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


class PoolUnavailable(PoolError):
    """No pool to talk to: socket missing, connection refused, timed out or closed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "unavailable")


def checksum(data: np.ndarray | bytes | memoryview) -> int:
    """The chunk checksum COMMIT carries (`kvshare.checksum`) of a chunk's bytes, its whole extent."""
    return chunk_checksum.checksum(data)


class PoolClient:
    def __init__(self, sock: socket.socket, address: str, timeout: float, info: p.ArenaInfo | None) -> None:
        self._sock = sock
        self._address = address
        self._timeout = timeout
        self._lock = threading.Lock()  # one request/response pair at a time: replies carry no request id
        self._broken = False
        self.page_size = info.page_size if info else 0
        self.num_pages = info.num_pages if info else 0
        self.arena_path = info.path if info else ""
        self.instance_id = info.instance if info else ""
        self._mapping: Mapping | None = None

    @classmethod
    def connect(
        cls, address: str, *, timeout: float = 5.0, token: str | None = None, populate: bool = False,
        map_arena: bool = True,
    ) -> "PoolClient":
        """Connect to `address` (a Unix socket path, "unix:PATH" or "tcp://HOST:PORT") and map the arena.
        `populate` pre-faults this process's mapping (MAP_POPULATE): slower connect, full-speed first copies."""
        sock = _open_socket(address, timeout)
        client = cls(sock, address, timeout, None)
        try:
            info = client._call(p.Attach(token or "", os.getpid(), p.PROTOCOL_VERSION), p.ArenaInfo)
            client.page_size, client.num_pages, client.arena_path = info.page_size, info.num_pages, info.path
            client.instance_id = info.instance
            if map_arena:
                client._map(populate)
        except BaseException:
            client.close()
            raise
        return client

    def _map(self, populate: bool) -> None:
        try:
            self._mapping = Mapping(self.arena_path, self.page_size, self.num_pages, populate)
        except OSError as error:
            raise PoolUnavailable(
                f"cannot map the pool's arena {self.arena_path}: {error.strerror}; the client must run on the "
                "pool's host with access to that file (group of the pool's user)") from None

    # ---- data plane --------------------------------------------------------------------------------------------

    @property
    def pages(self) -> np.ndarray:
        """uint8 [num_pages, page_size], a zero-copy view of the arena."""
        if self._mapping is None:
            raise PoolUnavailable("the arena is not mapped (closed, or connected with map_arena=False)")
        return self._mapping.pages

    def write(self, ref: ChunkRef, data: np.ndarray | bytes) -> None:
        """Copy a chunk's bytes into its reserved pages (page i gets bytes [i * page_size, (i + 1) * page_size))."""
        src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
        src = src.reshape(-1).view(np.uint8)
        if src.size != ref.nbytes:
            raise ValueError(f"chunk has {src.size} bytes but {ref.nbytes} were reserved")
        for i, page in enumerate(ref.pages):
            part = src[i * self.page_size : (i + 1) * self.page_size]
            self.pages[page, : part.size] = part

    def read(self, ref: ChunkRef, out: np.ndarray | None = None) -> np.ndarray:
        """A chunk's bytes copied out of the arena (into `out` if given, uint8 of nbytes)."""
        out = np.empty(ref.nbytes, dtype=np.uint8) if out is None else out.reshape(-1).view(np.uint8)
        for i, page in enumerate(ref.pages):
            part = out[i * self.page_size : (i + 1) * self.page_size]
            part[:] = self.pages[page, : part.size]
        return out

    # ---- control plane -----------------------------------------------------------------------------------------

    def hello(self, namespace_key: bytes, description: str = "") -> None:
        self._call(p.Hello(namespace_key, description), p.Ok)

    def lookup(self, namespace_key: bytes, keys: list[bytes], tokens: list[bytes],
               promote: bool = True) -> LookupResult:
        """The longest prefix of `keys` (with `tokens`, each chunk's token bytes) that the pool holds and verified,
        read-leased: RELEASE the lease once the bytes are copied out. promote=False: a pool with an L2 tier answers
        from its own memory, without promoting L2 hits first."""
        reply = self._call(p.Lookup.of(namespace_key, keys, tokens, promote), p.LookupReply)
        try:
            return LookupResult(reply.lease, reply.refs(keys))
        except ValueError as error:
            raise PoolError(f"pool {self._address} sent a bad LOOKUP reply: {error} (a pool bug: report it)") from None

    def reserve(self, namespace_key: bytes, chunks: list[NewChunk], evict: bool = True) -> Reservation:
        """Pages for the chunks not yet in the pool, under a write lease: write them, then COMMIT (or RELEASE).
        evict=False never drops committed chunks to make room (free pages only)."""
        return self._call(p.Reserve(namespace_key, chunks, evict), p.ReserveReply)

    def commit(self, lease: int, checksums: list[int]) -> None:
        self._call(p.Commit(lease, checksums), p.Ok)

    def release(self, lease: int) -> None:
        """End a lease once this process no longer touches its pages. Also accepted for a lease of an earlier
        connection of this process after it expired or its connection closed (that frees its pages)."""
        self._call(p.Release(lease), p.Ok)

    def discard(self, namespace_key: bytes, keys: list[bytes]) -> int:
        """Remove committed chunks whose bytes failed verification, so the next store replaces them; returns how many
        were removed."""
        return self._call(p.Discard(namespace_key, keys), p.Ok).count

    def stats(self) -> PoolStats:
        return self._call(p.Stats(), p.StatsReply).stats

    def clear(self) -> int:
        """Drop every committed chunk not under a read lease; returns how many were dropped."""
        return self._call(p.Clear(), p.Ok).count

    def health(self, deep: bool = False) -> bool:
        """True if the pool answers (and, with deep=True, its integrity check passes)."""
        return self._call(p.Health(deep), p.HealthReply).ok

    def _call(self, request: p.Request, expected: type):
        with self._lock:
            if self._broken:
                raise PoolUnavailable(f"connection to pool {self._address} is closed: connect again")
            try:
                try:
                    self._sock.sendall(p.frame(request))
                except (BrokenPipeError, ConnectionResetError):
                    # A pool that refuses a connection (busy: --max-connections) answers and closes it at once; a
                    # request sent after that close fails, but the answer may still be in the socket: it says why.
                    self._broken = True
                    reply = p.reply_decoder.decode(self._recv_frame())
                    self._sock.close()
                else:
                    reply = p.reply_decoder.decode(self._recv_frame())
            except (OSError, EOFError, msgspec.DecodeError) as error:
                # After a timeout a late reply could be mistaken for the next one: this connection is done.
                self._broken = True
                self._sock.close()
                what = "did not answer within %gs" % self._timeout if isinstance(error, TimeoutError) else str(error)
                raise PoolUnavailable(f"pool {self._address} {what}: its leases on this connection are ended") from None
        if isinstance(reply, p.Error):
            raise PoolError(reply.message, reply.code)
        if not isinstance(reply, expected):
            raise PoolError(f"unexpected reply {type(reply).__name__} to {type(request).__name__}")
        return reply

    def _recv_frame(self) -> bytes:
        (length,) = p.HEADER.unpack(self._recv_exactly(p.HEADER.size))
        return self._recv_exactly(length)

    def _recv_exactly(self, n: int) -> bytearray:
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("closed the connection")
            got += k
        return buffer  # msgspec decodes from any bytes-like object

    def close(self) -> None:
        with self._lock:
            self._broken = True
            self._sock.close()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_stats(address: str, *, timeout: float = 5.0, token: str | None = None) -> PoolStats:
    """One STATS over a short connection that does not map the arena (monitoring, tests, the harness)."""
    with PoolClient.connect(address, timeout=timeout, token=token, map_arena=False) as client:
        return client.stats()


def _open_socket(address: str, timeout: float) -> socket.socket:
    if address.startswith("tcp://"):
        host, port = address[len("tcp://"):].rsplit(":", 1)
        target, family = (host, int(port)), socket.AF_INET
    else:
        target, family = address.removeprefix("unix:"), socket.AF_UNIX
        if not os.path.exists(target):
            # No command's own way out here (a replica's --pool none, a connector's config): each caller adds its own.
            raise PoolUnavailable(f"pool socket {target} not found: is `kvshare pool serve --socket {target}` running?")
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_UNIX:
        # A 1 MiB LOOKUP then goes out in one send instead of ~5 rounds of filling the 208 KiB default buffer and
        # waiting for the server to drain it (each a context switch). The kernel caps this at net.core.wmem_max.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    sock.settimeout(timeout)
    try:
        sock.connect(target)
    except OSError as error:
        sock.close()
        raise PoolUnavailable(f"cannot connect to pool {address}: {error.strerror or error}; is "
                              "`kvshare pool serve` running?") from None
    return sock
