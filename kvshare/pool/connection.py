"""One client connection of the pool server: length-prefixed frames read straight into a buffer, replies in order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshare.pool import protocol as p

if TYPE_CHECKING:
    from kvshare.pool.server import PoolServer

KEEP_BUFFER = 4 << 20  # a connection keeps its body buffer up to this size (a 256k-token LOOKUP is ~1 MiB)


class CloseConnection(Exception):
    """Reply with Error(code, message), then close this connection (oversized frame, failed authentication)."""


@dataclass
class Connection:
    """What the server knows of a connection: its id (its leases carry it) and whether it has authenticated."""

    id: int
    authenticated: bool
    is_unix: bool = True


class ClientProtocol(asyncio.BufferedProtocol):
    """Frames in, one reply per frame out, strictly in order, for one client connection.

    asyncio's StreamReader cost ~1 ms per 1 MiB LOOKUP on the 2-core build machine (it receives 256 KiB pieces into
    its own buffer, then copies the frame out); here the loop receives straight into the exact rest of the current
    header or body (get_buffer), so a frame is read without a copy and never past its end. Because nothing past the
    current frame is ever read, pausing the transport while a request is pending (a LOOKUP awaiting L2 promotion,
    or the client not reading its replies: pause_writing) is enough to keep replies in request order.
    """

    def __init__(self, server: "PoolServer", conn: Connection) -> None:
        self.server = server
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(p.HEADER.size)
        self._body = bytearray()
        self._target = memoryview(self._header)  # what the bytes being received belong to: header or body
        self._got = 0
        self._in_body = False
        self._pending: asyncio.Future | None = None  # the reply being awaited, if any (at most one)
        self._write_paused = False
        self._closed = False

    # ---- asyncio callbacks -------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connected(self.conn, transport.get_extra_info("socket"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got < len(self._target):
            return
        if not self._in_body:
            (length,) = p.HEADER.unpack(self._header)
            if length > self.server.config.max_frame:
                self._close_with(p.Error(p.ErrorCode.TOO_LARGE, f"frame of {length} bytes exceeds the limit of "
                                         f"{self.server.config.max_frame}: send smaller requests (split the key list)"))
                return
            self._expect_body(length)
            if length:
                return
        self._request(self._target)

    def pause_writing(self) -> None:
        # The client does not read its replies: stop reading its requests until it catches up (bounded memory).
        self._write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._pending is None and not self._closed:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._pending is None:
            self.server.disconnected(self.conn)  # I8, I10: its leases are fenced, and end once its process is gone
        # else: _answered drops the client once the pending request has finished (it may grant a lease).

    # ---- frames ------------------------------------------------------------------------------------------------

    def _expect_body(self, length: int) -> None:
        if length > len(self._body):
            buffer = bytearray(length)
            if length <= KEEP_BUFFER:
                self._body = buffer
        else:
            buffer = self._body
        self._target, self._got, self._in_body = memoryview(buffer)[:length], 0, True

    def _expect_header(self) -> None:
        self._target, self._got, self._in_body = memoryview(self._header), 0, False

    def _request(self, body: memoryview) -> None:
        try:
            reply = self.server.handle(self.conn, body)  # decodes `body` before returning: the buffer is free again
        except CloseConnection as close:
            self._close_with(p.Error(*close.args))
            return
        self._expect_header()
        if isinstance(reply, p.Reply):
            self.transport.write(p.frame(reply))
            return
        self.transport.pause_reading()  # one request at a time: the next is read once this one is answered
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
        if not self._write_paused:
            self.transport.resume_reading()

    def _close_with(self, error: p.Error) -> None:
        self.transport.write(p.frame(error))
        self.transport.close()  # after the buffered reply has been written

