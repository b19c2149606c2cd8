"""The router's HTTP app: every path is proxied except `/health`, `/metrics`, aggregated `/v1/models`, and the admin
endpoints that inspect and switch the placement policy at run time."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvshare.router.config import RouterConfig
from kvshare.router.metrics import RouterMetrics
from kvshare.router.policies import POLICIES
from kvshare.router.proxy import Proxy
from kvshare.router.replicas import ReplicaSet

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
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole request: nothing to forward
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode("latin-1")
        response = await self.proxy.forward(scope["method"], scope["path"], query, headers, bytes(body))
        await response(scope, receive, send)


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
    async def set_policy(request: Request) -> JSONResponse:
        try:
            name = json.loads(await request.body())["policy"]
            proxy.switch_policy(name)
        except (ValueError, KeyError, TypeError) as error:
            message = f"bad policy request ({error}); send {{\"policy\": NAME}} with NAME one of {', '.join(POLICIES)}"
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, 400)
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
        return JSONResponse({"error": {"message": message, "type": "service_unavailable", "code": 503}}, 503)
    return JSONResponse({"object": "list", "data": list(models.values())})
