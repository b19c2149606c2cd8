"""Engine events -> text pieces: token ids to text deltas (holding back half characters and stop-string prefixes),
stop strings, usage, metrics. The formats (formats.py) turn pieces into SSE chunks or one body."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from kvshare.engine.api import TokenEvent, Usage
from kvshare.hf.detokenize import IncrementalText
from kvshare.serve.bridge import EventStream
from kvshare.serve.validation import Prepared

if TYPE_CHECKING:
    from kvshare.serve.app import Server


@dataclass(frozen=True)
class TokenInfo:
    """An output token with its logprobs (requests that asked for them): its text, its logprob, and the most likely
    tokens' (text, logprob), most likely first."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Piece:
    """A step of a response: new text (and, with logprobs, the tokens that brought it), and on the last piece the
    finish reason and usage (or an error)."""

    text: str = ""
    tokens: tuple[TokenInfo, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    request_caused: bool = False  # with error: the request failed alone (see TokenEvent)


async def pieces(app: "Server", prepared: Prepared, stream: EventStream, endpoint: str) -> AsyncIterator[Piece]:
    """Text deltas in order; ends with one Piece that has finish_reason (or error) set.

    Stop tokens (the request's stop_token_ids, and EOS unless ignore_eos) end generation and are not part of the text.
    A stop string cuts the text before it and aborts the engine request; its finished event still comes (it carries
    the usage), and the tokens it brings after the cut are dropped.
    Tokens with logprobs ride on the next piece that carries text (a token whose text is held back waits with it), the
    rest on the last text piece or the finishing one; so a stream's pieces carry every output token once, in order.
    """
    sampling = prepared.request.sampling
    hidden = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(app.engine.eos_token_ids))
    text = IncrementalText(app.tokenizer.decode, prepared.stop)
    tokens: list[TokenInfo] = []  # with logprobs: output tokens not yet on a piece
    accepted, last_token_at = 0, 0.0
    app.metrics.running.inc()
    try:
        async for event in stream.events():
            if event.token_id is not None:
                last_token_at = _observe_token(app, endpoint, prepared.arrived, last_token_at, accepted == 0)
            if event.token_id is not None and not text.stopped:
                accepted += 1
                if event.token_id not in hidden:
                    delta = text.add(event.token_id)
                    if event.logprobs is not None:
                        tokens.append(_token_info(app, event, prepared.tokens_as_ids))
                    if text.stopped:
                        stream.abort()
                    if delta:
                        yield Piece(delta, tuple(tokens))
                        tokens.clear()
            if event.finished:
                usage = _final_usage(event.usage, prepared, accepted, text.stopped)
                app.metrics.observe_usage(usage)
                if event.error is not None:
                    yield Piece(finish_reason="error", usage=usage, error=event.error,
                                request_caused=event.request_caused)
                    return
                tail = text.finish()
                if tail or tokens:
                    yield Piece(tail, tuple(tokens))
                app.metrics.observe_e2e(endpoint, time.perf_counter() - prepared.arrived)
                reason = "stop" if text.stopped else (event.finish_reason or "stop")
                yield Piece(finish_reason=reason, usage=usage)
    finally:
        stream.close()
        app.metrics.running.dec()


def _observe_token(app: "Server", endpoint: str, arrived: float, previous: float, first: bool) -> float:
    """TTFT for the first token, the gap since the previous one for every later token; returns now."""
    now = time.perf_counter()
    if first:
        app.metrics.observe_ttft(endpoint, now - arrived)
    else:
        app.metrics.observe_itl(endpoint, now - previous)
    return now


def _token_info(app: "Server", event: TokenEvent, as_ids: bool) -> TokenInfo:
    """The token's logprobs with each token named by its text (decoded alone), or as "token_id:<id>" when asked."""
    name = (lambda token: f"token_id:{token}") if as_ids else (lambda token: app.tokenizer.decode([token]))
    top = tuple((name(token), logprob) for token, logprob in event.logprobs.top)
    return TokenInfo(name(event.token_id), event.logprobs.logprob, top)


def _final_usage(usage: Usage | None, prepared: Prepared, accepted: int, cut: bool) -> Usage:
    """The engine's usage; after a stop-string cut, completion tokens are those up to the cut."""
    if usage is None:
        usage = Usage(len(prepared.request.prompt_ids), accepted, 0, 0)
    if cut:
        usage = Usage(usage.prompt_tokens, accepted, usage.local_hit_tokens, usage.pool_hit_tokens)
    return usage


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of a batch's streams (one per prompt), each tagged with its prompt's index, in the order they come;
    each stream's own pieces stay in order. However this ends (done, error, or closed by its consumer), every stream
    is closed, so every engine request is finished or aborted."""
    if len(streams) == 1:  # the common case: no tasks
        async with contextlib.aclosing(streams[0]) as only:
            async for piece in only:
                yield 0, piece
        return
    # One pending __anext__ per stream that has not ended; a stream's next one starts only after its piece is out.
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    piece = task.result()
                except StopAsyncIteration:
                    continue
                yield index, piece
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        # A stream whose __anext__ is still running cannot be closed: cancel that first and let it unwind.
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
