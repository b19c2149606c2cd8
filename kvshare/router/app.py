"""The router's HTTP app: every path is proxied except `/health`, `/metrics`, aggregated `/v1/models`, and the admin
endpoints that inspect (`/admin/state`, open) and switch (`/admin/policy`, behind the admin token) the placement
policy at run time. Every error the router writes itself is JSON in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvshare.router.admin import AdminGate
from kvshare.router.config import RouterConfig
from kvshare.router.metrics import RouterMetrics
from kvshare.router.policies import POLICIES
from kvshare.router.proxy import Proxy, error_response
from kvshare.router.replicas import ReplicaSet
from kvshare.router.request import MalformedBody, parse_request

log = logging.getLogger(__name__)
CONTROL_PATHS = frozenset({"/health", "/metrics", "/v1/models", "/admin/state", "/admin/policy"})


class RouterApp:
    """The ASGI entry point. Control paths (and lifespan) go to the FastAPI app; every other request goes straight to
    the proxy, so that relaying each SSE chunk skips FastAPI's middleware: the relay is the router's hot path."""

    def __init__(self, control: FastAPI, proxy: Proxy) -> None:
        self.control = control
        self.proxy = proxy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in CONTROL_PATHS:
            await self.control(scope, receive, send)
            return
        body = await _whole_body(receive)
        if body is None:
            return  # the client left before sending its whole request (the HTTP layer logged it): nothing to forward
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        query = scope.get("query_string", b"").decode("latin-1")
        try:
            info = parse_request(scope["path"], headers, body, read_prompt=self.proxy.policy.reads_prompt)
        except MalformedBody as error:
            await error_response(400, str(error), "invalid_request_error", "invalid_body")(scope, receive, send)
            return
        try:
            response = await self.proxy.forward(scope["method"], scope["path"], query, headers, body, info)
        except Exception as error:  # noqa: BLE001 - a bug answers JSON, as every other error does
            log.exception("unexpected error forwarding %s %s", scope["method"], scope["path"])
            response = error_response(500, f"internal error: {type(error).__name__}", "server_error")
        await response(scope, receive, send)


async def _whole_body(receive) -> bytes | None:
    """The request body, or None if the client left first. Bounded by the HTTP guard's body limit, which stands
    in front of this app (kvshare.httpguard): past it the client gets 413 and this sees a disconnect."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def create_app(config: RouterConfig) -> RouterApp:
    replicas = ReplicaSet(config.replicas)
    metrics = RouterMetrics()
    proxy = Proxy(config, replicas, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            proxy.client = client
            await replicas.probe_all(client, config.health_timeout_s)
            checker = asyncio.create_task(
                replicas.health_loop(client, config.health_interval_s, config.health_timeout_s)
            )
            try:
                yield
            finally:
                checker.cancel()

    app = FastAPI(title="kvshare router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    admin = AdminGate.from_file(config.admin_token_file)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        return error_response(error.status_code, f"{error.detail}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> Response:
        log.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal error: {type(error).__name__}", "server_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = len(replicas.healthy())
        return JSONResponse({"healthy_replicas": healthy, "replicas": len(replicas.replicas)}, 200 if healthy else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        for replica in replicas.replicas:
            metrics.healthy.labels(replica.url).set(1 if replica.healthy else 0)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        return await aggregated_models(proxy)

    @app.get("/admin/state")
    async def state() -> JSONResponse:
        return JSONResponse(router_state(proxy))

    @app.post("/admin/policy")
    async def set_policy(request: Request) -> Response:
        refusal = admin.refusal(request.headers.get("authorization"))
        if refusal is not None:
            return refusal
        try:
            name = json.loads(await request.body())["policy"]
            proxy.switch_policy(name)
        except (ValueError, KeyError, TypeError, RecursionError) as error:
            message = f"bad policy request ({error}); send {{\"policy\": NAME}} with NAME one of {', '.join(POLICIES)}"
            return error_response(400, message)
        return JSONResponse(router_state(proxy))

    return RouterApp(app, proxy)


def router_state(proxy: Proxy) -> dict:
    return {
        "policy": proxy.policy.name,
        "policies": list(POLICIES),
        "replicas": [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "last_error": r.last_error}
            for r in proxy.replicas.replicas
        ],
    }


async def aggregated_models(proxy: Proxy) -> Response:
    """The union (by id, first seen wins) of every healthy replica's /v1/models; 503 if none answers."""
    healthy = proxy.replicas.healthy()
    answers = await asyncio.gather(
        *(proxy.client.get(f"{r.url}/v1/models", timeout=proxy.config.health_timeout_s * 5) for r in healthy),
        return_exceptions=True,
    )
    models: dict[str, dict] = {}
    for answer in answers:
        if isinstance(answer, httpx.Response) and answer.status_code == 200:
            for model in answer.json().get("data", []):
                models.setdefault(model.get("id"), model)
    if not models:
        message = "no healthy replica answered /v1/models: check the replicas behind --replica (GET /admin/state)"
        return error_response(503, message, "service_unavailable")
    return JSONResponse({"object": "list", "data": list(models.values())})
