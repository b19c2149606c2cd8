"""Forwarding one request: choose a replica, retry on another while nothing has reached the client, then relay the
upstream bytes chunk by chunk as they arrive (never buffered), so SSE token timing is preserved.

The "first byte" is the first upstream *body* chunk: the router holds the response headers back until it has it,
so an upstream that dies after its headers but before any body is still retried elsewhere. After that first chunk
is sent the client owns the stream and an upstream failure cuts the client's connection (the error passes to it).

A failure that is the request's own is never retried: a 4xx, or a 5xx the replica marks request-caused (header
x-kvshare-error-cause: request, set by `kvshare serve` when a request failed alone while its batch went on); it goes
to the client as the replica sent it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import anyio
import httpx
from starlette.responses import Response

from kvshare.httpguard.errors import ERROR_CAUSE_HEADER, REQUEST_CAUSED
from kvshare.router.config import RouterConfig
from kvshare.router.metrics import RouterMetrics
from kvshare.router.policies import Policy, make_policy
from kvshare.router.replicas import Replica, ReplicaSet
from kvshare.router.request import RequestInfo

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvshare-replica"
# Connection-level headers describe one hop, not the message (RFC 9110 7.6.1), as do those the Connection header
# names; httpx and uvicorn write their own framing (content-length / transfer-encoding) and host.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
)
# The router's server writes its own Date and Server on every response: the replica's would appear twice.
_REWRITTEN_BY_ROUTER = frozenset({"date", "server", REPLICA_HEADER})


@dataclass
class Answered:
    """An upstream that sent its headers and its first body chunk: from here on the request is committed to it."""

    replica: Replica
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first_chunk: bytes
    started: float


@dataclass(frozen=True)
class Failed:
    """An attempt that failed before its first byte; `status`/`body`/`headers` are set for an upstream 5xx."""

    replica: Replica
    reason: str
    status: int = 0
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""


class Proxy:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet, metrics: RouterMetrics) -> None:
        self.config = config
        self.replicas = replicas
        self.metrics = metrics
        self.policy: Policy = make_policy(config.policy, config)
        self.client: httpx.AsyncClient | None = None  # set by the app's lifespan

    def switch_policy(self, name: str) -> None:
        self.policy = make_policy(name, self.config)  # raises ValueError naming the valid ones
        log.info("policy switched to %s", name)

    async def forward(
        self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes, info: RequestInfo
    ) -> "RelayedResponse | Response":
        """An ASGI response for the request: the chosen replica's, relayed, or the router's own 503 (or the last
        replica's 5xx when every replica answered one)."""
        tried: set[int] = set()
        failures: list[Failed] = []
        while candidates := self.replicas.healthy(exclude=frozenset(tried)):
            replica = self.policy.choose(info, candidates)
            tried.add(replica.index)
            attempt = await self._attempt(replica, method, path, query, headers, body)
            if isinstance(attempt, Answered):
                self.policy.placed(info, replica)
                return RelayedResponse(attempt, self)
            failures.append(attempt)
        return self._unplaced(failures)

    async def _attempt(self, replica: Replica, method, path, query, headers, body) -> Answered | Failed:
        url = f"{replica.url}{path}" + (f"?{query}" if query else "")
        request = self.client.build_request(method, url, headers=forwarded_headers(headers), content=body)
        self._begin(replica)
        started = time.perf_counter()
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            return self._failed_connect(replica, f"{type(error).__name__}: {error}")
        if response.status_code >= 500:
            if response.headers.get(ERROR_CAUSE_HEADER) != REQUEST_CAUSED:
                return await self._failed_status(replica, response)
            self.metrics.errors.labels(replica.url, "request_5xx").inc()  # the request's own: relayed, not retried
        chunks = response.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except httpx.HTTPError as error:
            await response.aclose()
            return self._failed_connect(replica, f"died before its first byte: {type(error).__name__}: {error}")
        self.metrics.requests.labels(replica.url, str(response.status_code)).inc()
        self.metrics.first_byte_seconds.labels(replica.url).observe(time.perf_counter() - started)
        return Answered(replica, response, chunks, first, started)

    def _begin(self, replica: Replica) -> None:
        replica.in_flight += 1
        self.metrics.in_flight.labels(replica.url).inc()

    def finish(self, replica: Replica, started: float) -> None:
        replica.in_flight -= 1
        self.metrics.in_flight.labels(replica.url).dec()
        self.metrics.latency_seconds.labels(replica.url).observe(time.perf_counter() - started)

    def _failed_connect(self, replica: Replica, reason: str) -> Failed:
        replica.in_flight -= 1
        self.metrics.in_flight.labels(replica.url).dec()
        self.metrics.errors.labels(replica.url, "connect").inc()
        replica.mark_down(reason)
        return Failed(replica, reason)

    async def _failed_status(self, replica: Replica, response: httpx.Response) -> Failed:
        # A live server that answers 5xx stays in rotation (the health check decides), but this request tries
        # another replica; if every replica answers 5xx the client gets the last one untouched.
        try:
            body = b"".join([chunk async for chunk in response.aiter_raw()])  # raw: headers still match the bytes
        except httpx.HTTPError:
            body = b""
        finally:
            await response.aclose()
        replica.in_flight -= 1
        self.metrics.in_flight.labels(replica.url).dec()
        self.metrics.requests.labels(replica.url, str(response.status_code)).inc()
        self.metrics.errors.labels(replica.url, "status_5xx").inc()
        headers = response_headers(response, replica)
        return Failed(replica, f"HTTP {response.status_code}", response.status_code, headers, body)

    def _unplaced(self, failures: list[Failed]) -> Response:
        answered = [f for f in failures if f.status]
        if answered:
            last = answered[-1]
            return _RawResponse(last.body, last.status, last.headers)
        self.metrics.no_replica.inc()
        tried = "; ".join(f"{f.replica.url}: {f.reason}" for f in failures)
        down = "; ".join(f"{r.url}: {r.last_error or 'down'}" for r in self.replicas.replicas if not r.healthy)
        message = (
            f"no healthy replica: all {len(self.replicas.replicas)} replicas are out of rotation "
            f"({tried or down}). Check that the `kvshare serve` processes behind --replica are running; the router "
            f"probes them every {self.config.health_interval_s:g} s and puts them back when /health answers 200."
        )
        response = error_response(503, message, "service_unavailable")
        response.headers["retry-after"] = str(max(1, round(self.config.health_interval_s)))
        return response


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> Response:
    """An error the router writes itself, in OpenAI's shape (as the replicas write theirs)."""
    payload = {"error": {"message": message, "type": kind, "param": None, "code": code if code else status}}
    return Response(json.dumps(payload), status, media_type="application/json")


def _connection_named(pairs) -> set[str]:
    """Header names the Connection header lists: hop-by-hop for this message (RFC 9110 7.6.1)."""
    named: set[str] = set()
    for name, value in pairs:
        if name.lower() == "connection":
            named.update(token.strip().lower() for token in value.split(","))
    return named


def forwarded_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones; repeated headers stay repeated, in order."""
    dropped = _HOP_BY_HOP | _connection_named(headers)
    return [(k, v) for k, v in headers if k.lower() not in dropped]


def response_headers(response: httpx.Response, replica: Replica) -> tuple[tuple[bytes, bytes], ...]:
    """The replica's headers minus hop-by-hop ones and those the router writes itself, plus X-KVShare-Replica: each
    header appears on the client's response as often as the replica sent it, never once more."""
    raw = [(k.decode("latin-1").lower(), k, v) for k, v in response.headers.raw]
    dropped = _HOP_BY_HOP | _REWRITTEN_BY_ROUTER | _connection_named((name, v.decode("latin-1")) for name, _, v in raw)
    kept = [(k, v) for name, k, v in raw if name not in dropped]
    return tuple(kept) + ((REPLICA_HEADER.encode(), replica.url.encode()),)


class _RawResponse(Response):
    """A buffered upstream answer passed on with its raw header list (repeated headers kept as they were)."""

    def __init__(self, body: bytes, status: int, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        super().__init__(body, status)
        self.raw_headers = [(b"content-length", str(len(body)).encode()), *headers]


class RelayedResponse:
    """An ASGI response that relays an `Answered` upstream: status and headers as the replica sent them (plus
    X-KVShare-Replica), then each body chunk the moment it arrives. Whatever happens (end, upstream error, client
    gone) the upstream is closed and the replica's in-flight count released exactly once."""

    def __init__(self, answered: Answered, proxy: Proxy) -> None:
        self.answered = answered
        self.proxy = proxy
        self.status_code = answered.response.status_code

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                # A client that hangs up cancels the relay, which closes the upstream: the replica sees the
                # disconnect and can abort the generation instead of computing tokens nobody reads.
                group.start_soon(self._watch_disconnect, receive, group.cancel_scope)
                await self._relay(send)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.answered.response.aclose()
                self.proxy.finish(self.answered.replica, self.answered.started)

    async def _relay(self, send) -> None:
        answered = self.answered
        headers = list(response_headers(answered.response, answered.replica))
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        if answered.first_chunk:
            await send({"type": "http.response.body", "body": answered.first_chunk, "more_body": True})
        try:
            async for chunk in answered.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as error:
            self.proxy.metrics.errors.labels(answered.replica.url, "stream").inc()
            answered.replica.mark_down(f"failed mid-response: {type(error).__name__}: {error}")
            # Raising after the response started makes the server drop the connection, so the client sees a
            # truncated response rather than a clean end that would pass for complete.
            raise RuntimeError(f"replica {answered.replica.url} failed after the first byte: {error}") from error
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _watch_disconnect(receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()
