"""RespConnection: one blocking socket to one Redis node speaking just enough RESP2 for the striped data path —
pipelined commands out, bulk replies read straight into a caller's buffer, small replies (errors, CLUSTER SLOTS)
parsed.

Why not redis-py here: its pure-Python parser receives a large bulk reply 64 KiB at a time into a BytesIO, then
copies it out again (three copies, thousands of calls for an 8 MiB value; measured at 0.25-0.29 GB/s against 0.7-1.0
GB/s from a bare socket on the build machine, see docs/results/l2-bench.md). Here the bytes of a value go from the
kernel into a reused buffer once (`recv_into`), and nothing else is copied.

Not thread-safe: a connection belongs to one lane thread (kvshare.pool.l2.lanes). Every socket call has the
connection's timeout; any error leaves the connection unusable (the caller closes it and opens another).
"""

from __future__ import annotations

import select
import socket
from typing import Callable

CRLF = b"\r\n"
_SCRATCH = 64 << 10  # bytes read ahead for reply headers and small replies
PEEK = 8  # bytes of a bulk value shown to read_bulk_into's buffer_for before it is received


class RespError(Exception):
    """An error reply from Redis (`-ERR ...`, `-MOVED ...`); the connection itself is still in step."""

    @property
    def moved(self) -> bool:
        """A cluster redirection: the slot map the caller used is stale."""
        return str(self).startswith(("MOVED ", "ASK "))


class ProtocolError(Exception):
    """Bytes that are not a RESP2 reply: the connection is out of step and must be closed."""


def command(*args: bytes | str | int) -> bytes:
    """One command in RESP2 (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += [b"$%d\r\n" % len(data), data, CRLF]
    return b"".join(parts)


class RespConnection:
    def __init__(self, host: str, port: int, timeout: float, receive_buffer: int = 0) -> None:
        self.address = (host, port)
        self.sock = socket.create_connection(self.address, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if receive_buffer:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = self._end = 0  # unread bytes are _scratch[_start:_end]

    def closed_by_peer(self) -> bool:
        """Did the server close this idle connection (restart, idle timeout)? Call only between replies: then the
        socket is readable only at EOF, on an error, or with bytes nobody asked for, all reasons to reconnect. (A poll,
        not recv(MSG_DONTWAIT): a socket with a timeout waits for readability before any recv.)"""
        if self._end > self._start:
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    # ---- replies ---------------------------------------------------------------------------------------------------

    def read_bulk_into(self, buffer_for: Callable[[int, bytes], memoryview]) -> memoryview | None:
        """The next reply, which must be a bulk string or nil: None for nil; otherwise `buffer_for(length, head)` gives
        a writable view of at least `length` bytes and the value is received into its first `length` bytes (returned).
        `head` is the value's first min(length, PEEK) bytes, so the caller can place the value (align its payload).
        An error reply raises RespError after the reply is consumed."""
        line = self._line()
        if line[:1] == b"$":
            length = int(line[1:])
            if length < 0:
                return None
            while self._end - self._start < min(length, PEEK):
                self._fill()
            target = buffer_for(length, bytes(self._view[self._start : self._start + min(length, PEEK)]))[:length]
            self._read_into(target)
            self._expect_crlf()
            return target
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        raise ProtocolError(f"expected a bulk reply, got {line[:40]!r}")

    def read_reply(self):
        """The next reply of any kind, parsed (bulk strings as bytes: for small replies only)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            data = bytearray(length)
            self._read_into(memoryview(data))
            self._expect_crlf()
            return bytes(data)
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self.read_reply() for _ in range(count)]
        raise ProtocolError(f"not a RESP2 reply: {line[:40]!r}")

    # ---- receiving -------------------------------------------------------------------------------------------------

    def _line(self) -> bytes:
        """The next CRLF-terminated line, without the CRLF."""
        while True:
            at = self._scratch.find(CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start >= _SCRATCH // 2:
                raise ProtocolError("reply line longer than 32 KiB")
            self._fill()

    def _fill(self) -> None:
        """Receive more bytes into the scratch buffer (moving the unread ones to its front first)."""
        if self._start:
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        got = self.sock.recv_into(self._view[self._end :])
        if not got:
            raise ConnectionError(f"Redis {self.address[0]}:{self.address[1]} closed the connection")
        self._end += got

    def _read_into(self, target: memoryview) -> None:
        """Exactly len(target) bytes: first what the scratch buffer holds, then straight from the socket."""
        have = min(len(target), self._end - self._start)
        target[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < len(target):
            got = self.sock.recv_into(target[have:])
            if not got:
                raise ConnectionError(f"Redis {self.address[0]}:{self.address[1]} closed the connection mid-reply")
            have += got

    def _expect_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != CRLF:
            raise ProtocolError("bulk reply not followed by CRLF")
        self._start += 2
