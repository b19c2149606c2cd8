"""The replica's OpenAI-compatible HTTP app: /v1/completions (one prompt or a batch) and /v1/chat/completions (SSE
or whole), /v1/models and /v1/models/{id}, vLLM's /tokenize and /detokenize, /health and /metrics, over any engine
that implements `EngineProtocol`.

Request flow (a module each): parse + validate (schema.py, validation.py, unsupported.py: OpenAI-style errors) ->
a `Prepared` per prompt (prompt ids + sampling) -> an `EventStream` each (bridge.py: engine-thread callbacks into
asyncio) -> `pieces` (pieces.py: token ids -> text deltas, stop strings, logprobs, metrics; a batch's merged) -> a
`Format` (formats.py: completion or chat) writes SSE chunks or one body.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvshare.connector.contract import ConnectorStats
from kvshare.engine.api import EngineLoad, EngineProtocol
from kvshare.httpguard.limits import HttpLimits
from kvshare.serve.bridge import EventStream
from kvshare.serve.formats import ChatFormat, CompletionFormat, Format, collect, sse_stream
from kvshare.serve.metrics import CountRequests, EngineLoadCollector, ServerMetrics
from kvshare.serve.pieces import merged, pieces
from kvshare.serve.schema import ApiError, ChatRequest, CompletionRequest, parse_body
from kvshare.serve.tokenize import Tokenization
from kvshare.serve.validation import Prepared, RequestLimits, TokenizerProtocol, Validator, new_request_id

log = logging.getLogger("kvshare.serve")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
ENDPOINTS = (COMPLETIONS, CHAT, MODELS, "/tokenize", "/detokenize", "/health", "/metrics")
PATTERNS = ((MODELS + "/", MODELS + "/{id}"),)  # (path prefix, the endpoint label of every path under it)


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Runs a non-streaming generation but cancels it (hence aborts the engine request) if the client goes away."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """What the route handlers share: engine, tokenizer, validator, metrics."""

    def __init__(self, engine: EngineProtocol, tokenizer: TokenizerProtocol, model_name: str,
                 is_alive: Callable[[], bool], connector_stats: Callable[[], ConnectorStats | None],
                 limits: RequestLimits) -> None:
        self.engine, self.tokenizer, self.model_name, self.is_alive = engine, tokenizer, model_name, is_alive
        self.validator = Validator(engine, tokenizer, model_name, limits)
        self.metrics = ServerMetrics(connector_stats)
        self.started = int(time.time())

    # Prompts are tokenized and checked in a worker thread: a 256k-token prompt takes long enough that doing it on
    # the event loop would stall every other stream's tokens meanwhile. TTFT counts from before parsing.

    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(CompletionRequest, await request.body())
        self.validator.check_model(body.model)
        self.validator.check_values(body)
        prompts = await asyncio.to_thread(self.validator.completion_prompts, body.prompt, body.add_special_tokens)
        response_id = new_request_id("cmpl")
        ids = [response_id] if len(prompts) == 1 else [f"{response_id}-{i}" for i in range(len(prompts))]
        prepared = [self.validator.prepare(body, prompt, body.max_tokens, 16, request_id, arrived)
                    for prompt, request_id in zip(prompts, ids)]
        fmt = CompletionFormat(response_id, self.model_name, logprobs=body.logprobs is not None)
        return await self._respond(request, prepared, fmt, COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(ChatRequest, await request.body())
        self.validator.check_model(body.model)
        self.validator.check_values(body)
        ids = await asyncio.to_thread(self.validator.chat_prompt, body.messages, body.add_generation_prompt)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        response_id = new_request_id("chatcmpl")
        prepared = self.validator.prepare(body, ids, asked, None, response_id, arrived)
        fmt = ChatFormat(response_id, self.model_name, logprobs=bool(body.logprobs))
        return await self._respond(request, [prepared], fmt, CHAT)

    async def _respond(self, request: Request, prepared: list[Prepared], fmt: Format, endpoint: str) -> Response:
        """Starts one engine request per prompt and answers with their merged pieces. Every started stream is closed
        however the response ends (one refused by the engine closes those started before it)."""
        streams: list[EventStream] = []

        def close() -> None:
            for stream in streams:
                stream.close()

        for one in prepared:
            stream = EventStream(self.engine, one.request)
            try:
                stream.start()
            except BaseException:
                close()
                raise
            streams.append(stream)
        made = merged([pieces(self, one, stream, endpoint) for one, stream in zip(prepared, streams)])
        first = prepared[0]
        if first.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return _ClosingStreamingResponse(sse_stream(made, fmt, len(prepared), first.include_usage), close,
                                             media_type="text/event-stream", headers=headers)
        try:
            return await _unless_disconnected(request, lambda: collect(made, fmt, len(prepared)))
        finally:
            close()

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "kvshare",
                "max_model_len": self.engine.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict:
        """GET /v1/models/{id}: this server's model card, or OpenAI's 404 for any other id."""
        if model_id != self.model_name:
            raise ApiError(404, f"model '{model_id}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return self.model_card()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: a client that disconnects before the body generator
    ever started would otherwise skip the generator's own cleanup (a never-started generator runs no `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(engine: EngineProtocol, tokenizer: TokenizerProtocol, model_name: str, *,
               is_alive: Callable[[], bool] | None = None,
               connector_stats: Callable[[], ConnectorStats | None] | None = None,
               engine_load: Callable[[], EngineLoad] | None = None,
               limits: RequestLimits = RequestLimits()) -> FastAPI:
    """The FastAPI app. `is_alive` answers /health (default: true while the server answers); `connector_stats`
    feeds the kvshare_pool_* metrics at every scrape (default: none, e.g. `--pool none`); `engine_load`, when given,
    the kvshare_engine_* and kvshare_kv_blocks_* gauges. The caller says what the engine offers: no probing."""
    server = Server(engine, tokenizer, model_name, is_alive or (lambda: True), connector_stats or (lambda: None),
                    limits)
    if engine_load is not None:
        server.metrics.registry.register(EngineLoadCollector(engine_load))
    app = FastAPI(title="kvshare replica", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, error: ClientDisconnect) -> Response:
        # The client closed the connection before its body was complete (or the body limit cut it off): nobody reads
        # an answer, and the HTTP layer has logged the one line it is worth.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        # Bodies are parsed by parse_body (400s of their own); this catches anything FastAPI itself validates, which
        # it would answer 422: OpenAI and vLLM answer 400.
        return ApiError(400, f"invalid request: {error.errors()}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # unknown paths and wrong methods: OpenAI's error shape too, not FastAPI's {"detail": ...}
        return ApiError(error.status_code, f"{error.detail}: {request.method} {request.url.path}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return ApiError(500, f"internal error: {type(error).__name__}: {error}").response()

    app.add_api_route(COMPLETIONS, server.completions, methods=["POST"])
    app.add_api_route(CHAT, server.chat, methods=["POST"])
    app.add_api_route(MODELS, server.models, methods=["GET"])
    app.add_api_route(MODELS + "/{model_id:path}", server.model, methods=["GET"])
    tokenization = Tokenization(server.validator, tokenizer, engine.max_model_len)
    app.add_api_route("/tokenize", tokenization.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenization.detokenize, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        if server.is_alive():
            return JSONResponse({"status": "ok"})
        return ApiError(503, "the engine loop is not running; restart the replica").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = server.metrics.render()
        return Response(data, media_type=content_type)

    app.add_middleware(CountRequests, metrics=server.metrics, endpoints=ENDPOINTS, patterns=PATTERNS)
    return app


def serve(engine: EngineProtocol, tokenizer: TokenizerProtocol, *, host: str, port: int, model_name: str,
          is_alive: Callable[[], bool] | None = None,
          connector_stats: Callable[[], ConnectorStats | None] | None = None,
          engine_load: Callable[[], EngineLoad] | None = None,
          limits: RequestLimits = RequestLimits(), http_limits: HttpLimits = HttpLimits(),
          sock: socket.socket | None = None) -> None:
    """Serves until SIGINT/SIGTERM (blocking), under `http_limits` (kvshare.httpguard), on `sock` when given (bound
    by kvshare.httpguard.serve.reserve_port before the engine loaded). The caller owns the engine and shuts it down
    afterwards."""
    from kvshare.httpguard.serve import serve as serve_http

    app = create_app(engine, tokenizer, model_name, is_alive=is_alive, connector_stats=connector_stats,
                     engine_load=engine_load, limits=limits)
    log.info("serving %s on http://%s:%d", model_name, host, port)
    serve_http(app, host, port, http_limits, sock=sock)
