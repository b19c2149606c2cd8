"""Requests bounded before an app sees them: an ASGI middleware that answers 431 for headers over the limit and 413
for bodies over the limit (never letting the app read more than it), and the OpenAI-shaped JSON error bodies the HTTP
guard writes."""

from __future__ import annotations

import json
import logging

from kvshare.units import format_size

log = logging.getLogger(__name__)


def json_error(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    """OpenAI's error shape, which both servers use for every error they write."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length (h11 has already refused malformed or conflicting ones), or None (chunked)."""
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return None


def head_size(scope) -> int:
    """Bytes of the request line and headers as received (give or take the separators)."""
    line = len(scope["method"]) + len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class RequestLimit:
    """ASGI middleware: the app behind it never sees a request head over `max_head_bytes` nor more than `max_bytes` of
    a request body.

    h11 refuses headers over the limit only while they are incomplete; a head that arrives whole in one read (up to
    uvicorn's read size) is parsed, and is refused here, 431, before the app is called.

    A declared Content-Length over the limit is answered 413 before any body byte is read (the app is not called).
    A body without one (chunked) is counted as it arrives; the read that passes the limit is not handed over: the
    client gets 413 at once, the app receives `http.disconnect` (as if the client had left) and whatever it sends
    afterwards is dropped. So the app's buffer holds at most the limit, whatever the client sends.
    """

    def __init__(self, app, max_bytes: int, max_head_bytes: int) -> None:
        self.app, self.max_bytes, self.max_head_bytes = app, max_bytes, max_head_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if head_size(scope) > self.max_head_bytes:
            log.info("refused %d bytes of request headers from %s: over --max-header-size %d", head_size(scope),
                     _client(scope), self.max_head_bytes)
            message = (f"the request's headers are larger than this server's limit of {self.max_head_bytes} bytes "
                       "(--max-header-size)")
            await send_error(send, 431, json_error(message, "headers_too_large"))
            return
        declared = declared_length(scope["headers"])
        if declared is not None and declared > self.max_bytes:
            log.info("refused a %s body from %s: over --max-body-size %s", format_size(declared),
                     _client(scope), format_size(self.max_bytes))
            await send_413(send, self.max_bytes, declared)
            return
        await self.app(scope, *_CountedExchange(self.max_bytes, scope, receive, send).channels())


async def send_413(send, max_bytes: int, size: int | None) -> None:
    what = f"has {size} bytes," if size is not None else "is"
    message = (f"the request body {what} over this server's limit of {max_bytes} bytes ({format_size(max_bytes)}, "
               "--max-body-size); send a smaller request")
    await send_error(send, 413, json_error(message, "request_too_large"))


async def send_error(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _CountedExchange:
    """One request through RequestLimit: counts body bytes on the way in, and once refused stands between the app and
    the client (the app sees a disconnect, its sends go nowhere)."""

    def __init__(self, max_bytes: int, scope, receive, send) -> None:
        self.max_bytes, self.scope, self._receive, self._send = max_bytes, scope, receive, send
        self.received = 0
        self.response_started = self.refused = False

    def channels(self):
        return self.receive, self.send

    async def receive(self):
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_bytes:
                self.refused = True
                log.info("refused a chunked body from %s: over --max-body-size %s", _client(self.scope),
                         format_size(self.max_bytes))
                if not self.response_started:
                    await send_413(self._send, self.max_bytes, None)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"
