"""uvicorn's h11 protocol with the limits uvicorn lacks: a header-read deadline, a request-body silence timeout, a write
timeout for clients that stop reading, a cap on open connections, and one log line (never a traceback) for a client
that leaves mid-request or is timed out.

uvicorn (checked with 0.54, h11 0.16) arms its keep-alive timer only after a response, so a connection that sends part
of its headers, or half a body, or stops reading a stream, is held for as long as the client likes. This subclass keeps
uvicorn's parsing and request cycle and adds timers around it; it reads `self.conn` (the h11 connection), `self.cycle`,
`self.flow` and `self.connections`, which H11Protocol has kept stable for years (tests/router/test_http_limits.py and
tests/engine/test_server_hostile.py exercise every timer against real processes).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvshare.httpguard.asgi import json_error
from kvshare.httpguard.limits import HttpLimits

log = logging.getLogger(__name__)
_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


class GuardedH11Protocol(H11Protocol):
    """One client connection. Two timers at most, each for the phase the connection is in:

    - read timer, while the client owes bytes: the *headers* phase (from the connection's start, or the end of the
      previous response, until a request's headers are complete) has a fixed deadline of `header_timeout_s`, so
      trickling bytes cannot extend it; the *body* phase (a request body incomplete) allows `body_timeout_s` of silence,
      restarted by every byte, and not counted while the app is not reading (uvicorn then pauses reading: our fault,
      not the client's). After an early answer (e.g. 413) the rest of the body is read and discarded, up to
      `max_body_bytes`, then the connection is closed.
    - write timer, while the client does not read: armed when the transport pauses writing (its buffer is full) and
      cancelled when it resumes; on expiry the connection is aborted, which the app sees as a disconnect.
    Phases are derived from h11's state after every event (`_follow`), so no phase is missed or left armed.
    """

    def __init__(self, config, server_state, app_state, _loop=None, *, limits: HttpLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_phase: str | None = None  # "headers" | "body" | "discard" | None (nothing owed by the client)
        self._write_timer: asyncio.TimerHandle | None = None
        self._discarded = 0  # body bytes read and dropped after an early answer
        self._ended = False  # set once this protocol closed the connection itself: nothing more is read or logged

    # --- asyncio.Protocol -------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Fixed instead of autotuned (up to 4 MiB on Linux): a client that stops reading pins at most this much
            # kernel memory, and the write timeout starts once it is full.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
            # Every write goes out now. asyncio sets this only when the listening socket was made with proto
            # IPPROTO_TCP; without it Nagle holds a small write while an earlier one is unacknowledged, and a client
            # that delays its ACK (Linux: up to 40 ms) holds it that long: the router's first SSE chunk, written just
            # after its held-back headers, reached keep-alive clients ~40 ms late.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection from %s: %d open, over --max-connections %d", self._peer(),
                        len(self.connections) - 1, self.limits.max_connections)
            self._answer_and_close(503, "this server has too many open connections (--max-connections "
                                        f"{self.limits.max_connections}); retry later", "too_many_connections")
            return
        self._follow()

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return  # closing on our own terms: the rest is not ours to parse
        if self._read_phase == "discard":
            self._discarded += len(data)
        super().data_received(data)
        if self._discarded > self.limits.max_body_bytes:
            log.info("closed %s: it kept sending a refused body (%d bytes dropped)", self._peer(), self._discarded)
            self._end(abort=False)
            return
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._ended and self._read_phase == "body" and not self._responding():
            request = self.scope or {}
            log.info("client %s closed the connection in the middle of its request body (%s %s); dropped",
                     self._peer(), request.get("method", "?"), request.get("path", "?"))
        self._ended = True
        self._cancel_read_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None and not self._ended:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    # --- uvicorn hooks ----------------------------------------------------------------------------------------------
    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._ended:
            self._follow()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse, as JSON; headers over the size limit get 431."""
        if self._responding():  # a response is already on the wire: another would corrupt it
            self._end(abort=True)
        elif len(self.conn.trailing_data[0]) >= self.limits.max_header_bytes:
            limit = self.limits.max_header_bytes
            self._answer_and_close(431, f"the request's headers are larger than this server's limit of {limit} bytes "
                                        "(--max-header-size)", "headers_too_large")
        else:
            self._answer_and_close(400, f"invalid HTTP request ({msg})", "invalid_http")

    # --- phases -----------------------------------------------------------------------------------------------------
    def _follow(self) -> None:
        """Arms the read timer for the phase h11's state says the connection is in (see the class docstring)."""
        if self.transport.is_closing():
            self._set_read_phase(None)
        elif self.conn.their_state is h11.IDLE:
            if self._read_phase != "headers":  # a fixed deadline: armed once per request, never restarted
                self._set_read_phase("headers", self.limits.header_timeout_s, self._headers_timed_out)
        elif self.conn.their_state is h11.SEND_BODY:
            # restarted on every call: the body phase bounds silence, not the whole upload
            if self.conn.our_state is h11.DONE:
                self._set_read_phase("discard", self.limits.body_timeout_s, self._body_timed_out)
            else:
                self._set_read_phase("body", self.limits.body_timeout_s, self._body_timed_out)
        else:
            self._set_read_phase(None)

    def _set_read_phase(self, phase: str | None, timeout_s: float = 0.0, on_expiry=None) -> None:
        self._cancel_read_timer()
        if phase != "discard":
            self._discarded = 0
        self._read_phase = phase
        if phase is not None:
            self._read_timer = self.loop.call_later(timeout_s, on_expiry)

    def _headers_timed_out(self) -> None:
        self._read_timer = None
        pending = len(self.conn.trailing_data[0])
        if pending == 0:  # an idle connection that never started a request: closed quietly, like keep-alive
            self._end(abort=False)
            return
        log.info("client %s sent %d bytes but no complete request headers within %g s (--header-timeout); closed",
                 self._peer(), pending, self.limits.header_timeout_s)
        self._answer_and_close(408, f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s "
                                    "(--header-timeout)", "header_timeout")

    def _body_timed_out(self) -> None:
        self._read_timer = None
        if self.flow.read_paused:  # the app is not reading: not the client's silence, so wait on
            self._set_read_phase(self._read_phase, self.limits.body_timeout_s, self._body_timed_out)
            return
        log.info("client %s sent no request body bytes for %g s (--body-timeout); closed", self._peer(),
                 self.limits.body_timeout_s)
        if self._responding():
            self._end(abort=True)
        else:
            self._answer_and_close(408, f"the request body stalled for {self.limits.body_timeout_s:g} s "
                                        "(--body-timeout)", "body_timeout")

    def _write_timed_out(self) -> None:
        self._write_timer = None
        log.info("client %s read nothing for %g s while its response waited (--write-timeout); connection dropped",
                 self._peer(), self.limits.write_timeout_s)
        self._end(abort=True)  # close() would wait to flush to a client that does not read

    # --- ending a connection ourselves ------------------------------------------------------------------------------
    def _answer_and_close(self, status: int, message: str, code: str) -> None:
        """Writes a whole JSON error response (Connection: close) and closes. Only called before the app's response
        started, so these are the only bytes of a response on the wire."""
        body = json_error(message, code)
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self._end(abort=False)

    def _end(self, abort: bool) -> None:
        """Closes the connection on our own terms; an app still running sees a disconnect and its sends go nowhere."""
        self._ended = True
        self._cancel_read_timer()
        self._cancel_write_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # uvicorn's own flag: sends become no-ops, receive() says disconnect
            self.cycle.message_event.set()
        self.flow.resume_writing()  # a send blocked on a full buffer returns (into a no-op)
        if abort:
            self.transport.abort()
        else:
            self.transport.close()

    def _responding(self) -> bool:
        """A response is on the wire and not finished: no other bytes may be written now."""
        return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"
