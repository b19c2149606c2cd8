"""Misbehaving HTTP/1.1 clients on raw sockets, for `kvshare validate hostile` and the tests: half-sent requests,
bodies cut short, streams that are never read. Every call is bounded in time (socket timeouts) and in bytes."""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


def address(base: str) -> tuple[str, int]:
    url = urlsplit(base)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"{base!r} is not an http:// URL (raw-socket attacks speak plain HTTP/1.1)")
    return url.hostname, url.port or 80


def connect(base: str, timeout_s: float = 10.0, receive_buffer: int | None = None) -> socket.socket:
    """A TCP connection to `base`; `receive_buffer` (SO_RCVBUF, set before connecting so the window stays small)
    makes a client that does not read fill the server's buffers sooner."""
    host, port = address(base)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(timeout_s)
    sock.connect((host, port))
    return sock


def request_head(method: str, path: str, base: str, headers: dict[str, str] | None = None,
                 content_length: int | None = None) -> bytes:
    host, port = address(base)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    if content_length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {content_length}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def post_json(path: str, base: str, body: bytes) -> bytes:
    return request_head("POST", path, base, content_length=len(body)) + body


@dataclass(frozen=True)
class Ending:
    """How a connection ended after we sent what we sent: `closed_after_s` is None if the server still held it when
    we gave up; `status` is the HTTP status of what it answered first (0: nothing)."""

    closed_after_s: float | None
    status: int
    received: bytes


def wait_for_close(sock: socket.socket, patience_s: float, limit: int = 1 << 20) -> Ending:
    """Reads (at most `limit` bytes) until the server closes or `patience_s` passes, then closes our side."""
    started = time.monotonic()
    received = bytearray()
    try:
        while len(received) < limit:
            left = patience_s - (time.monotonic() - started)
            if left <= 0:
                return Ending(None, status_of(bytes(received)), bytes(received))
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:  # reset by the server: closed
                data = b""
            if not data:
                return Ending(time.monotonic() - started, status_of(bytes(received)), bytes(received))
            received += data
        return Ending(None, status_of(bytes(received)), bytes(received))
    finally:
        sock.close()


def status_of(response: bytes) -> int:
    """The status code of the first response line in `response`, 0 if there is none."""
    first = response.split(b"\r\n", 1)[0].split(b" ")
    return int(first[1]) if len(first) >= 2 and first[0].startswith(b"HTTP/") and first[1].isdigit() else 0


def send_then_wait(base: str, data: bytes, patience_s: float) -> Ending:
    """Sends `data` (e.g. half a request) and nothing more; how and when the server ends the connection."""
    sock = connect(base)
    sock.sendall(data)
    return wait_for_close(sock, patience_s)


def send_then_leave(base: str, data: bytes) -> None:
    """Sends `data` (e.g. headers and part of a body) and closes the connection at once."""
    with connect(base) as sock:
        sock.sendall(data)


@dataclass(frozen=True)
class Stall:
    """A stream requested and then not read for `held_s`: `dropped` when the server ended the connection without
    finishing the stream; `finished` when the whole stream ([DONE]) was there to read."""

    dropped: bool
    finished: bool
    received_bytes: int


def stall_stream(base: str, request: bytes, held_s: float, drain_s: float = 5.0) -> Stall:
    """Sends a streaming request, reads nothing for `held_s`, then reads for at most `drain_s` to see whether the
    server dropped us (EOF or reset before the stream's end) or kept the stream for us."""
    sock = connect(base, receive_buffer=4096)
    try:
        sock.sendall(request)
        time.sleep(held_s)
        ending = wait_for_close(sock, drain_s, limit=64 << 20)
    finally:
        sock.close()
    finished = b"data: [DONE]" in ending.received
    return Stall(ending.closed_after_s is not None and not finished, finished, len(ending.received))


@dataclass(frozen=True)
class Upload:
    """How a paced chunked upload ended: `sent` body bytes handed to the socket, `status` of the answer (0: none)."""

    sent: int
    status: int


def paced_chunked_upload(base: str, path: str, total: int, patience_s: float, piece: int = 256 << 10,
                         pause_s: float = 0.02) -> Upload:
    """POSTs a chunked body of up to `total` bytes in `piece`s, looking for an answer for `pause_s` after each.

    Paced on purpose: a client that blasts the body lets loopback's socket buffers (several MiB each way) swallow it
    before a server that refused it early has been scheduled to say so, so "answered before the whole body was sent"
    would measure the kernel, not the server. At ~12 MB/s a server that answers once its limit is passed is heard
    long before the end; one that reads the whole body first is not."""
    sock = connect(base, timeout_s=patience_s)
    sent = 0
    try:
        head = request_head("POST", path, base, headers={"Content-Type": "application/json",
                                                         "Transfer-Encoding": "chunked"})
        sock.sendall(head)
        while sent < total:
            readable, _, _ = select.select([sock], [], [], pause_s)
            if readable:
                break
            size = min(piece, total - sent)
            try:
                sock.sendall(b"%x\r\n" % size + b" " * size + b"\r\n")
            except OSError:  # reset: the server refused and closed; its answer may still be queued
                break
            sent += size
        else:
            try:
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass
        return Upload(sent, status_of(_first_bytes(sock, patience_s)))
    finally:
        sock.close()


def _first_bytes(sock: socket.socket, patience_s: float) -> bytes:
    """What the server has answered (the start of it), or b"" if nothing arrives within `patience_s`."""
    sock.settimeout(patience_s)
    try:
        return sock.recv(4096)
    except OSError:
        return b""
