"""The replica's OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions (SSE or whole), /v1/models,
/health and /metrics, over any engine that implements `EngineProtocol`.

Request flow: parse + validate (pydantic, OpenAI-style errors) -> `Prepared` (prompt ids + sampling) ->
`_EventStream` (engine-thread callbacks bridged into asyncio) -> `_pieces` (token ids -> text deltas, stop strings,
metrics) -> a `_Format` (completion or chat) writes SSE chunks or one JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Protocol, Sequence

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvshare.engine.api import (ConnectorStats, EngineLoad, EngineProtocol, GenerationRequest, SamplingParams,
                                TokenEvent, Usage)
from kvshare.engine.detokenize import IncrementalText
from kvshare.engine.metrics import ServerMetrics
from kvshare.engine.openai_schema import (ApiError, ChatMessage, ChatRequest, Chunk, CompletionRequest, Delta,
                                          DeltaChoice, Message, MessageChoice, SamplingFields, TextChoice, UsageBody,
                                          Whole, hits_of, parse_body)
from kvshare.httpguard.limits import HttpLimits

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")


class TokenizerProtocol(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_token_chars: int  # characters of the longest token (bounds the token count of a text from below)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


# ---------------------------------------------------------------- validated request -> engine request

SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as vLLM; torch's generators take any of these


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the replica beyond its size (`kvshare serve` flags). Stop strings are matched
    against the text after every token, so their number and length bound that work."""

    max_stop_strings: int = 16
    max_stop_chars: int = 256


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check: what the engine gets and what the response needs."""

    request: GenerationRequest
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    arrived: float  # perf_counter() at arrival, for TTFT


class _Validator:
    """Semantic checks that need the model: limits, vocabulary, model name. Each failure is a 4xx ApiError."""

    def __init__(self, engine: EngineProtocol, tokenizer: TokenizerProtocol, model_name: str,
                 limits: RequestLimits) -> None:
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{self.model_name}' "
                                "(see /v1/models)", param="model", code="model_not_found")

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} in '{param}' is outside the vocabulary [0, {vocab})", param=param)

    def max_tokens(self, asked: int | None, prompt_len: int, default: int | None) -> int:
        """The completion budget; the prompt plus it must fit in max_model_len (both numbers in the message)."""
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise ApiError(400, f"the prompt has {prompt_len} tokens but this model's maximum context length is "
                                f"{limit} tokens (prompt + at least 1 generated token); shorten the prompt",
                           param="prompt", code="context_length_exceeded")
        if asked is None:
            return min(default, limit - prompt_len) if default is not None else limit - prompt_len
        if asked < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {asked}", param="max_tokens")
        if prompt_len + asked > limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the request has "
                                f"{prompt_len} prompt tokens and asks for {asked} completion tokens; shorten the "
                                "prompt or lower max_tokens", param="max_tokens", code="context_length_exceeded")
        return asked

    def check_values(self, body: SamplingFields) -> None:
        """OpenAI's ranges (vLLM's for its extensions), checked before the prompt is tokenized: every value that
        passes can be sampled."""
        if body.n < 1:
            raise ApiError(400, f"n must be at least 1, got {body.n}", param="n")
        if body.n != 1:
            raise ApiError(400, f"n={body.n} is not supported; send n=1 (one choice per request)", param="n")
        _check_number("temperature", body.temperature, 0.0, 2.0)
        _check_number("top_p", body.top_p, 0.0, 1.0, open_below=True)
        top_k = 0 if body.top_k is None else body.top_k
        if top_k < -1:
            raise ApiError(400, f"top_k must be -1 or 0 (no top-k cut) or at least 1, got {top_k}", param="top_k")
        _check_no_penalty("presence_penalty", body.presence_penalty)
        _check_no_penalty("frequency_penalty", body.frequency_penalty)
        if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
            raise ApiError(400, f"seed must be a 64-bit signed integer, got {body.seed}", param="seed")
        self.check_stop_strings(_stop_strings(body.stop))

    def sampling(self, body: SamplingFields, prompt_len: int, max_tokens: int | None, default: int | None
                 ) -> SamplingParams:
        """The engine's parameters for a body that passed check_values."""
        stop_ids = tuple(body.stop_token_ids or ())
        self.check_ids(stop_ids, "stop_token_ids")
        return SamplingParams(max_tokens=self.max_tokens(max_tokens, prompt_len, default),
                              temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, top_k=max(body.top_k or 0, 0))

    def check_stop_strings(self, strings: tuple[str, ...]) -> None:
        if len(strings) > self.limits.max_stop_strings:
            raise ApiError(400, f"stop has {len(strings)} strings; this server accepts at most "
                                f"{self.limits.max_stop_strings} (--max-stop-strings)", param="stop")
        longest = max(map(len, strings), default=0)
        if longest > self.limits.max_stop_chars:
            raise ApiError(400, f"a stop string has {longest} characters; this server accepts at most "
                                f"{self.limits.max_stop_chars} (--max-stop-chars)", param="stop")

    def refuse_hopeless_text(self, chars: int, param: str) -> None:
        """A text longer than max_model_len * max_token_chars characters cannot fit: refuse it before tokenizing,
        which for megabytes of text would hold the process for seconds."""
        limit = self.engine.max_model_len * self.tokenizer.max_token_chars
        if chars > limit:
            raise ApiError(400, f"the prompt has {chars} characters, more than the model's maximum context length of "
                                f"{self.engine.max_model_len} tokens can hold (at most {limit} characters); send a "
                                "shorter prompt", param=param)

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.refuse_hopeless_text(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = list(prompt)
            self.check_ids(ids, "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty; send at least one token", param="prompt")
        return ids

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise ApiError(400, "messages is empty; send at least one message", param="messages")
        plain = [{"role": m.role, "content": _message_text(m)} for m in messages]
        self.refuse_hopeless_text(sum(len(m["content"]) for m in plain), "messages")
        try:
            rendered = self.tokenizer.apply_chat_template(plain)
        except ValueError as error:  # e.g. the model has no chat template
            raise ApiError(400, str(error), param="messages") from None
        ids = self.tokenizer.encode(rendered)
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt", param="messages")
        return ids

    def prepare(self, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None, default: int | None,
                prefix: str, arrived: float) -> Prepared:
        """`default`: the completion budget when max_tokens is absent (None: up to the context limit)."""
        sampling = self.sampling(body, len(prompt_ids), max_tokens, default)
        stop = tuple(s for s in _stop_strings(body.stop) if s)
        request = GenerationRequest(request_id=f"{prefix}-{uuid.uuid4().hex}", prompt_ids=tuple(prompt_ids),
                                    sampling=sampling, cache_salt=body.cache_salt or "")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared(request, stop, body.stream, include_usage, arrived)


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _check_number(name: str, value: float, low: float, high: float, open_below: bool = False) -> None:
    """A finite number in [low, high] (or (low, high]); NaN and infinities fail every comparison, so they are named."""
    inside = math.isfinite(value) and (low < value if open_below else low <= value) and value <= high
    if not inside:
        interval = f"{'(' if open_below else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"{name} must be a finite number in {interval}, got {value}", param=name)


def _check_no_penalty(name: str, value: float | None) -> None:
    if value is None:
        return
    _check_number(name, value, -2.0, 2.0)
    if value != 0:
        raise ApiError(400, f"{name}={value} is not supported: this server samples without penalties; send 0 or "
                            "leave it out", param=name)


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content part of type '{part.type}' is not supported; send text parts only",
                           param="messages")
    return "".join(part.text or "" for part in message.content)


# ---------------------------------------------------------------- engine events -> asyncio


class _EventStream:
    """One request's TokenEvents, delivered from the engine thread into the server's event loop.

    The engine calls back on its own thread, and asyncio.Queue is not thread-safe, so the callback hands each event
    to the loop with `call_soon_threadsafe`, which also wakes the loop at once: the first token leaves without any
    polling delay. The queue is unbounded so the engine thread never blocks on a slow client.
    Invariant: a submitted request either delivers its finished event or is aborted by `close()`, which every
    response path calls when it ends (normally, on client disconnect, or before its body ever started).
    """

    def __init__(self, engine: EngineProtocol, request: GenerationRequest) -> None:
        self._engine, self._request = engine, request
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._submitted = self.finished = self._aborted = False

    def start(self) -> None:
        """Submits the request; an engine that refuses it (ValueError) gives the client a 400."""
        try:
            self._engine.submit(self._request, self._on_event)
        except ValueError as error:
            raise ApiError(400, f"the engine refused the request: {error}") from None
        self._submitted = True

    def _on_event(self, event: TokenEvent) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[TokenEvent]:
        while not self.finished:
            event = await self._queue.get()
            self.finished = event.finished
            yield event

    def abort(self) -> None:
        """Ask the engine to stop early; it still ends the stream with a finished event. Idempotent."""
        if self._submitted and not self.finished and not self._aborted:
            self._aborted = True
            self._engine.abort(self._request.request_id)

    def close(self) -> None:
        """The response is over: a request still running has lost its reader, so stop it."""
        if self._submitted and not self.finished and not self._aborted:
            log.info("request %s ended before the engine finished it (client gone); aborting",
                     self._request.request_id)
        self.abort()


# ---------------------------------------------------------------- events -> text pieces


@dataclass(frozen=True)
class Piece:
    """A step of a response: new text, and on the last piece the finish reason and usage (or an error)."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    request_caused: bool = False  # with error: the request failed alone (see TokenEvent)


async def _pieces(app: "_Server", prepared: Prepared, stream: _EventStream, endpoint: str) -> AsyncIterator[Piece]:
    """Text deltas in order; ends with one Piece that has finish_reason (or error) set.

    Stop tokens (the request's stop_token_ids, and EOS unless ignore_eos) end generation and are not part of the text.
    A stop string cuts the text before it and aborts the engine request; its finished event still comes (it carries
    the usage), and the tokens it brings after the cut are dropped.
    """
    sampling = prepared.request.sampling
    hidden = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(app.engine.eos_token_ids))
    text = IncrementalText(app.tokenizer.decode, prepared.stop)
    accepted = 0
    app.metrics.running.inc()
    try:
        async for event in stream.events():
            if accepted == 0 and event.token_id is not None:
                app.metrics.observe_ttft(endpoint, time.perf_counter() - prepared.arrived)
            if event.token_id is not None and not text.stopped:
                accepted += 1
                if event.token_id not in hidden:
                    delta = text.add(event.token_id)
                    if text.stopped:
                        stream.abort()
                    if delta:
                        yield Piece(delta)
            if event.finished:
                usage = _final_usage(event.usage, prepared, accepted, text.stopped)
                app.metrics.observe_usage(usage)
                if event.error is not None:
                    yield Piece(finish_reason="error", usage=usage, error=event.error,
                                request_caused=event.request_caused)
                    return
                tail = text.finish()
                if tail:
                    yield Piece(tail)
                reason = "stop" if text.stopped else (event.finish_reason or "stop")
                yield Piece(finish_reason=reason, usage=usage)
    finally:
        stream.close()
        app.metrics.running.dec()


def _final_usage(usage: Usage | None, prepared: Prepared, accepted: int, cut: bool) -> Usage:
    """The engine's usage; after a stop-string cut, completion tokens are those up to the cut."""
    if usage is None:
        usage = Usage(len(prepared.request.prompt_ids), accepted, 0, 0)
    if cut:
        usage = Usage(usage.prompt_tokens, accepted, usage.local_hit_tokens, usage.pool_hit_tokens)
    return usage


_encoder = msgspec.json.Encoder()


def _sse(payload: msgspec.Struct | dict) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class _Format:
    """How one endpoint spells its pieces: chunks while streaming, one body otherwise."""

    object_chunk: str
    object_whole: str

    def __init__(self, request_id: str, model: str) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())

    def chunk(self, choices: list, **extra) -> Chunk:
        return Chunk(self.id, self.object_chunk, self.created, self.model, choices, **extra)

    def opening(self) -> list[Chunk]:
        return []

    def delta(self, text: str, finish_reason: str | None = None) -> object: ...

    def whole_choice(self, text: str, finish_reason: str) -> object: ...

    def whole(self, text: str, finish_reason: str, usage: Usage) -> Whole:
        return Whole(self.id, self.object_whole, self.created, self.model, [self.whole_choice(text, finish_reason)],
                     UsageBody.of(usage), hits_of(usage))


class _CompletionFormat(_Format):
    object_chunk = object_whole = "text_completion"

    def delta(self, text: str, finish_reason: str | None = None) -> TextChoice:
        return TextChoice(0, text, finish_reason)

    def whole_choice(self, text: str, finish_reason: str) -> TextChoice:
        return TextChoice(0, text, finish_reason)


class _ChatFormat(_Format):
    object_chunk, object_whole = "chat.completion.chunk", "chat.completion"

    def opening(self) -> list[Chunk]:
        # The role goes out at once (before any token), as OpenAI does; content deltas follow.
        return [self.chunk([DeltaChoice(0, Delta(role="assistant", content=""), None)])]

    def delta(self, text: str, finish_reason: str | None = None) -> DeltaChoice:
        return DeltaChoice(0, Delta(content=text) if text else Delta(), finish_reason)

    def whole_choice(self, text: str, finish_reason: str) -> MessageChoice:
        return MessageChoice(0, Message("assistant", text), finish_reason)


async def _sse_stream(pieces: AsyncIterator[Piece], fmt: _Format, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE bytes, one yield per chunk so each leaves at once; always ends with `data: [DONE]`."""
    for chunk in fmt.opening():
        yield _sse(chunk)
    async with contextlib.aclosing(pieces):  # closed at once, never left to the garbage collector
        async for piece in pieces:
            if piece.error is not None:
                yield _sse(_generation_failed(piece).payload())
                break
            if piece.text:
                yield _sse(fmt.chunk([fmt.delta(piece.text)]))
            if piece.finish_reason is not None:
                hits = hits_of(piece.usage) if piece.usage else None
                yield _sse(fmt.chunk([fmt.delta("", piece.finish_reason)], kvshare=hits))
                if include_usage and piece.usage is not None:
                    yield _sse(fmt.chunk([], usage=UsageBody.of(piece.usage)))
    yield b"data: [DONE]\n\n"


async def _collect(pieces: AsyncIterator[Piece], fmt: _Format) -> Response:
    parts: list[str] = []
    async with contextlib.aclosing(pieces):  # closed at once, never left to the garbage collector
        async for piece in pieces:
            if piece.error is not None:
                return _generation_failed(piece).response()
            parts.append(piece.text)
            if piece.finish_reason is not None:
                body = fmt.whole("".join(parts), piece.finish_reason, piece.usage)
                return Response(_encoder.encode(body), media_type="application/json")
    return ApiError(500, "the engine ended the request without a finished event").response()


def _generation_failed(piece: Piece) -> ApiError:
    """A request that failed alone is marked so (code and header): a router must not retry it elsewhere."""
    return ApiError(500, f"generation failed: {piece.error}", code="request_failed" if piece.request_caused else None,
                    request_caused=piece.request_caused)


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


# ---------------------------------------------------------------- the app


class _Server:
    """What the route handlers share: engine, tokenizer, validator, metrics."""

    def __init__(self, engine: EngineProtocol, tokenizer: TokenizerProtocol, model_name: str,
                 is_alive: Callable[[], bool], connector_stats: Callable[[], ConnectorStats | None],
                 limits: RequestLimits) -> None:
        self.engine, self.tokenizer, self.model_name, self.is_alive = engine, tokenizer, model_name, is_alive
        self.validator = _Validator(engine, tokenizer, model_name, limits)
        self.metrics = ServerMetrics(connector_stats)
        self.started = int(time.time())

    # Prompts are tokenized and checked in a worker thread: a 256k-token prompt takes long enough that doing it on
    # the event loop would stall every other stream's tokens meanwhile. TTFT counts from before parsing.

    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(CompletionRequest, await request.body())
        self.validator.check_model(body.model)
        self.validator.check_values(body)
        ids = await asyncio.to_thread(self.validator.completion_prompt, body.prompt)
        prepared = self.validator.prepare(body, ids, body.max_tokens, 16, "cmpl", arrived)
        return await self._respond(request, prepared, _CompletionFormat(prepared.request.request_id,
                                                                        self.model_name), COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(ChatRequest, await request.body())
        self.validator.check_model(body.model)
        self.validator.check_values(body)
        ids = await asyncio.to_thread(self.validator.chat_prompt, body.messages)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = self.validator.prepare(body, ids, asked, None, "chatcmpl", arrived)
        return await self._respond(request, prepared, _ChatFormat(prepared.request.request_id, self.model_name),
                                   CHAT)

    async def _respond(self, request: Request, prepared: Prepared, fmt: _Format, endpoint: str) -> Response:
        stream = _EventStream(self.engine, prepared.request)
        stream.start()
        pieces = _pieces(self, prepared, stream, endpoint)
        if prepared.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return _ClosingStreamingResponse(_sse_stream(pieces, fmt, prepared.include_usage), stream.close,
                                             media_type="text/event-stream", headers=headers)
        try:
            return await _unless_disconnected(request, lambda: _collect(pieces, fmt))
        finally:
            stream.close()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started,
                                            "owned_by": "kvshare", "max_model_len": self.engine.max_model_len}]}


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


class EngineLoadCollector(Collector):
    """kvshare_engine_requests and kvshare_kv_blocks_{used,total}, read from the engine at scrape time: what requests
    hold now (a request whose client left releases its blocks at the engine's next step)."""

    def __init__(self, source: Callable[[], EngineLoad]) -> None:
        self._source = source

    def collect(self):
        load = self._source()
        yield GaugeMetricFamily("kvshare_engine_requests", "requests the engine holds (queued or running)",
                                value=load.requests)
        yield GaugeMetricFamily("kvshare_kv_blocks_used", "KV blocks held by requests or by pool stores",
                                value=load.blocks_used)
        yield GaugeMetricFamily("kvshare_kv_blocks_total", "KV blocks in the cache", value=load.blocks_total)


class _CountRequests:
    """ASGI middleware: counts every HTTP response by endpoint and status (streams count at their start line)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: EngineProtocol, tokenizer: TokenizerProtocol, model_name: str, *,
               is_alive: Callable[[], bool] | None = None,
               connector_stats: Callable[[], ConnectorStats | None] | None = None,
               engine_load: Callable[[], EngineLoad] | None = None,
               limits: RequestLimits = RequestLimits()) -> FastAPI:
    """The FastAPI app. `is_alive` answers /health (default: the engine's `is_alive()` if it has one, else true
    while the server answers); `connector_stats` feeds the kvshare_pool_* metrics at scrape time (default: the
    stats of the engine's optional `connector` attribute); `engine_load`, when given, the kvshare_engine_* and
    kvshare_kv_blocks_* gauges."""
    server = _Server(engine, tokenizer, model_name, is_alive or _default_liveness(engine),
                     connector_stats or (lambda: _engine_connector_stats(engine)), limits)
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
    app.add_api_route("/v1/models", server.models, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        if server.is_alive():
            return JSONResponse({"status": "ok"})
        return ApiError(503, "the engine loop is not running; restart the replica").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = server.metrics.render()
        return Response(data, media_type=content_type)

    app.add_middleware(_CountRequests, metrics=server.metrics)
    return app


def _engine_connector_stats(engine: EngineProtocol) -> ConnectorStats | None:
    # The engine's optional `connector` (None or absent with --pool none), read at every scrape, so a connector
    # attached after the app was built is still exported.
    connector = getattr(engine, "connector", None)
    return connector.stats if connector is not None else None


def _default_liveness(engine: EngineProtocol) -> Callable[[], bool]:
    probe = getattr(engine, "is_alive", None)  # optional in EngineProtocol; kvshare's Engine has it
    return probe if callable(probe) else (lambda: True)


def serve(engine: EngineProtocol, tokenizer: TokenizerProtocol, *, host: str, port: int, model_name: str,
          is_alive: Callable[[], bool] | None = None,
          connector_stats: Callable[[], ConnectorStats | None] | None = None,
          engine_load: Callable[[], EngineLoad] | None = None,
          limits: RequestLimits = RequestLimits(), http_limits: HttpLimits = HttpLimits()) -> None:
    """Serves until SIGINT/SIGTERM (blocking), under `http_limits` (kvshare.httpguard). The caller owns the engine and
    shuts it down afterwards."""
    from kvshare.httpguard.serve import serve as serve_http

    app = create_app(engine, tokenizer, model_name, is_alive=is_alive, connector_stats=connector_stats,
                     engine_load=engine_load, limits=limits)
    log.info("serving %s on http://%s:%d", model_name, host, port)
    serve_http(app, host, port, http_limits)
