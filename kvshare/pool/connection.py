"""One client connection of the pool server: length-prefixed frames read straight into a buffer, replies in order,
and the limits that keep one connection from hurting the others.

Limits (PoolConfig, each a `kvshare pool serve` flag; docs/security.md):
- Before authentication (TCP) only an ATTACH of at most `max_auth_frame` bytes is read, within `auth_timeout`;
  anything else closes the connection.
- A frame's header is checked before anything is allocated: over `max_frame` closes the connection unread.
- A frame's buffer grows as its bytes arrive (never allocated ahead of them), and frames over SMALL_FRAME are charged
  to one budget shared by all connections (`max_buffered`): a frame that does not fit waits, its connection's
  reading paused, until others are handled (FrameBudget). A frame must be whole within `frame_timeout` of its
  header, or its connection is closed: a client that sends a large header and then trickles cannot hold the budget.
- At most `max_connections` connections; more are answered `busy` and closed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshare.pool import protocol as p

if TYPE_CHECKING:
    from kvshare.pool.server import PoolServer

SMALL_FRAME = 4096  # frames this small are never charged to the budget: STATS, COMMIT, RELEASE never wait
FIRST_PIECE = 1 << 20  # a body buffer starts at this size (or the frame's) and doubles as bytes arrive


class CloseConnection(Exception):
    """Reply with Error(code, message), then close this connection (oversized frame, failed authentication)."""


@dataclass
class Connection:
    """What the server knows of a connection: its id (its leases carry it) and whether it has authenticated."""

    id: int
    authenticated: bool
    is_unix: bool = True


class FrameBudget:
    """Bytes of frames being received, all connections together, at most `limit`. A connection whose frame does not
    fit waits in FIFO order (its reading paused) and is admitted when earlier frames are handled; so a flood of
    large frames delays large frames, and never grows the pool's memory past the limit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._waiting: deque[tuple["ClientProtocol", int]] = deque()

    def take(self, protocol: "ClientProtocol", n: int) -> bool:
        """Charge n bytes now (True), or queue the protocol to be admitted later (False)."""
        if not self._waiting and self.used + n <= self.limit:
            self.used += n
            return True
        self._waiting.append((protocol, n))
        return False

    def give(self, n: int) -> None:
        self.used -= n
        while self._waiting and self.used + self._waiting[0][1] <= self.limit:
            protocol, n = self._waiting.popleft()
            self.used += n
            protocol.admitted()

    def forget(self, protocol: "ClientProtocol") -> None:
        """A queued connection closed: it no longer waits."""
        self._waiting = deque(entry for entry in self._waiting if entry[0] is not protocol)
        self.give(0)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class ClientProtocol(asyncio.BufferedProtocol):
    """Frames in, one reply per frame out, strictly in order, for one client connection.

    asyncio's StreamReader cost ~1 ms per 1 MiB LOOKUP on the 2-core build machine (it receives 256 KiB pieces into
    its own buffer, then copies the frame out); here the loop receives straight into the rest of the current header
    or body (get_buffer), so a frame is read with at most the copies of its buffer's doublings and never past its
    end. Because nothing past the current frame is ever read, pausing the transport while a request is pending (a
    LOOKUP awaiting L2 promotion), while the client does not read its replies (pause_writing) or while its frame
    waits for the budget is enough to keep replies in request order; reading resumes when no reason is left.
    """

    def __init__(self, server: "PoolServer", conn: Connection) -> None:
        self.server = server
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(p.HEADER.size)
        self._body = bytearray()
        self._length = 0  # of the body being received
        self._got = 0  # bytes of the header or body received so far
        self._in_body = False
        self._charged = 0  # bytes of the budget this connection's current frame holds
        self._paused: set[str] = set()  # why reading is paused: "pending", "writing", "budget"
        self._pending: asyncio.Future | None = None  # the reply being awaited, if any (at most one)
        self._timer: asyncio.TimerHandle | None = None  # auth_timeout before ATTACH, then frame_timeout per frame
        self._closed = False
        self._counted = False  # connected() was called (not refused for max_connections)

    # ---- asyncio callbacks -------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        config = self.server.config
        if self.server.clients >= config.max_connections:
            self._close_with(p.Error(p.ErrorCode.BUSY, f"the pool has {config.max_connections} connections "
                                     "(--max-connections): retry later"))
            return
        self._counted = True
        self.server.connected(self.conn, transport.get_extra_info("socket"))
        if not self.conn.authenticated:
            self._timer = asyncio.get_running_loop().call_later(config.auth_timeout, self._timed_out, "ATTACH")

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._in_body:
            return memoryview(self._header)[self._got :]
        if self._got == len(self._body):  # the buffer is full of received bytes: double it (never past the frame)
            grown = bytearray(min(self._length, max(2 * len(self._body), FIRST_PIECE)))
            grown[: self._got] = self._body
            self._body = grown
        return memoryview(self._body)[self._got : self._length]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if not self._in_body:
            if self._got < p.HEADER.size:
                return
            (length,) = p.HEADER.unpack(self._header)
            if not self._start_body(length) or length:
                return
        elif self._got < self._length:
            return
        self._request(memoryview(self._body)[: self._length])

    def pause_writing(self) -> None:
        # The client does not read its replies: stop reading its requests until it catches up (bounded memory).
        self._pause("writing")

    def resume_writing(self) -> None:
        self._resume("writing")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._end_frame()
        self.server.budget.forget(self)
        if not self._counted:
            return
        if self._pending is None:
            self.server.disconnected(self.conn)  # I8, I10: its leases are fenced, and end once its process is gone
        # else: _answered drops the client once the pending request has finished (it may grant a lease).

    # ---- frames ------------------------------------------------------------------------------------------------

    def _start_body(self, length: int) -> bool:
        """A header announced `length` body bytes: refuse it (False, connection closing) or start receiving."""
        config = self.server.config
        limit = config.max_frame if self.conn.authenticated else config.max_auth_frame
        if length > limit:
            what = "frame" if self.conn.authenticated else "frame before authentication (ATTACH)"
            self._close_with(p.Error(p.ErrorCode.TOO_LARGE, f"{what} of {length} bytes exceeds the limit of {limit}: "
                                     "send smaller requests (split the key list)"))
            return False
        # No buffer yet: get_buffer makes one when the first body bytes may arrive (a waiting frame holds none).
        self._body, self._length, self._got, self._in_body = bytearray(), length, 0, True
        if length > SMALL_FRAME and not self.server.budget.take(self, length):
            self._pause("budget")  # admitted() resumes it
        elif length > SMALL_FRAME:
            self._charge(length)
        return True

    def admitted(self) -> None:
        """The budget took this connection's waiting frame (FrameBudget.give)."""
        self._charge(self._length)
        self._resume("budget")

    def _charge(self, length: int) -> None:
        self._charged = length
        if self.conn.authenticated:  # before authentication the auth timer bounds the connection instead
            self._timer = asyncio.get_running_loop().call_later(self.server.config.frame_timeout, self._timed_out,
                                                                "the frame")

    def _end_frame(self) -> None:
        """The current frame is handled (or the connection is gone): free its buffer, budget and timer."""
        if self._timer is not None and self.conn.authenticated:
            self._timer.cancel()
            self._timer = None
        if self._charged:
            charged, self._charged = self._charged, 0
            self.server.budget.give(charged)
        self._body, self._length, self._got, self._in_body = bytearray(), 0, 0, False

    def _timed_out(self, what: str) -> None:
        if self._closed:
            return
        config = self.server.config
        seconds = config.frame_timeout if self.conn.authenticated else config.auth_timeout
        code = p.ErrorCode.TOO_LARGE if self.conn.authenticated else p.ErrorCode.AUTH
        self._close_with(p.Error(code, f"{what} did not arrive within {seconds:g} s; closing the connection"))

    def _request(self, body: memoryview) -> None:
        was_authenticated = self.conn.authenticated
        try:
            reply = self.server.handle(self.conn, body)  # decodes `body` before returning: the buffer is free again
        except CloseConnection as close:
            self._close_with(p.Error(*close.args))
            return
        if self.conn.authenticated and not was_authenticated and self._timer is not None:
            self._timer.cancel()  # ATTACH with the token arrived in time
            self._timer = None
        self._end_frame()
        if isinstance(reply, p.Reply):
            self.transport.write(p.frame(reply))
            return
        self._pause("pending")  # one request at a time: the next is read once this one is answered
        self._pending = asyncio.ensure_future(reply)
        self._pending.add_done_callback(self._answered)

    def _answered(self, pending: asyncio.Future) -> None:
        self._pending = None
        if self._closed:
            self.server.disconnected(self.conn)  # closed while waiting: fence the lease it may have granted
            return
        if pending.cancelled():  # the server is shutting down
            self.transport.close()
            return
        self.transport.write(p.frame(pending.result()))  # handle()'s coroutines turn every error into an Error reply
        self._resume("pending")

    def _pause(self, reason: str) -> None:
        if not self._paused and not self._closed:
            self.transport.pause_reading()
        self._paused.add(reason)

    def _resume(self, reason: str) -> None:
        self._paused.discard(reason)
        if not self._paused and not self._closed:
            self.transport.resume_reading()

    def _close_with(self, error: p.Error) -> None:
        self._closed = True
        self.transport.write(p.frame(error))
        self.transport.close()  # after the buffered reply has been written
