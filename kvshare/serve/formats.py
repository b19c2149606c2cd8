"""How each endpoint spells its pieces: SSE chunks while streaming, one JSON body otherwise; OpenAI's shapes plus the
`kvshare` hits extension."""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

import msgspec
from fastapi.responses import Response

from kvshare.engine.api import Usage
from kvshare.serve.pieces import Piece
from kvshare.serve.schema import (
    ApiError,
    Chunk,
    Delta,
    DeltaChoice,
    Message,
    MessageChoice,
    TextChoice,
    UsageBody,
    Whole,
    hits_of,
)

_encoder = msgspec.json.Encoder()


def _sse(payload: msgspec.Struct | dict) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class Format:
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


class CompletionFormat(Format):
    object_chunk = object_whole = "text_completion"

    def delta(self, text: str, finish_reason: str | None = None) -> TextChoice:
        return TextChoice(0, text, finish_reason)

    def whole_choice(self, text: str, finish_reason: str) -> TextChoice:
        return TextChoice(0, text, finish_reason)


class ChatFormat(Format):
    object_chunk, object_whole = "chat.completion.chunk", "chat.completion"

    def opening(self) -> list[Chunk]:
        # The role goes out at once (before any token), as OpenAI does; content deltas follow.
        return [self.chunk([DeltaChoice(0, Delta(role="assistant", content=""), None)])]

    def delta(self, text: str, finish_reason: str | None = None) -> DeltaChoice:
        return DeltaChoice(0, Delta(content=text) if text else Delta(), finish_reason)

    def whole_choice(self, text: str, finish_reason: str) -> MessageChoice:
        return MessageChoice(0, Message("assistant", text), finish_reason)


async def sse_stream(pieces: AsyncIterator[Piece], fmt: Format, include_usage: bool) -> AsyncIterator[bytes]:
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


async def collect(pieces: AsyncIterator[Piece], fmt: Format) -> Response:
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
