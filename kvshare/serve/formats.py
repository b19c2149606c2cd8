"""How each endpoint spells its pieces: SSE chunks while streaming, one JSON body otherwise; OpenAI's shapes (one
choice per prompt, logprobs when asked) plus the `kvshare` hits extension."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec
from fastapi.responses import Response

from kvshare.engine.api import Usage
from kvshare.serve.pieces import Piece, TokenInfo
from kvshare.serve.schema import (
    ApiError,
    ChatLogprobs,
    Chunk,
    CompletionLogprobs,
    Delta,
    DeltaChoice,
    Message,
    MessageChoice,
    TextChoice,
    TokenLogprob,
    TopLogprob,
    UsageBody,
    Whole,
    hits_of,
)

_encoder = msgspec.json.Encoder()


def _sse(payload: msgspec.Struct | dict) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def total_usage(usages: list[Usage]) -> Usage:
    """A batch request's usage: its prompts' usages summed."""
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(u.local_hit_tokens for u in usages), sum(u.pool_hit_tokens for u in usages))


class Format:
    """How one endpoint spells its pieces: chunks while streaming, one body otherwise. `logprobs`: the request asked
    for them, so every choice carries a logprobs object (else null)."""

    object_chunk: str
    object_whole: str

    def __init__(self, request_id: str, model: str, logprobs: bool = False) -> None:
        self.id, self.model, self.created, self.logprobs = request_id, model, int(time.time()), logprobs

    def chunk(self, choices: list, **extra) -> Chunk:
        return Chunk(self.id, self.object_chunk, self.created, self.model, choices, **extra)

    def opening(self, count: int) -> list[Chunk]:
        return []

    def delta(self, index: int, text: str, tokens: tuple[TokenInfo, ...] = (),
              finish_reason: str | None = None) -> object: ...

    def whole_choice(self, index: int, text: str, tokens: list[TokenInfo], finish_reason: str) -> object: ...

    def whole(self, choices: list, usage: Usage) -> Whole:
        return Whole(self.id, self.object_whole, self.created, self.model, choices, UsageBody.of(usage),
                     hits_of(usage))


class CompletionFormat(Format):
    object_chunk = object_whole = "text_completion"

    def __init__(self, request_id: str, model: str, logprobs: bool = False) -> None:
        super().__init__(request_id, model, logprobs)
        self._offsets: dict[int, int] = {}  # streaming: per choice, the text offset its next token starts at

    def delta(self, index: int, text: str, tokens: tuple[TokenInfo, ...] = (),
              finish_reason: str | None = None) -> TextChoice:
        logprobs = None
        if self.logprobs and finish_reason is None:
            logprobs, self._offsets[index] = _completion_logprobs(tokens, self._offsets.get(index, 0))
        return TextChoice(index, text, finish_reason, logprobs)

    def whole_choice(self, index: int, text: str, tokens: list[TokenInfo], finish_reason: str) -> TextChoice:
        return TextChoice(index, text, finish_reason, _completion_logprobs(tokens, 0)[0] if self.logprobs else None)


def _completion_logprobs(tokens: tuple[TokenInfo, ...] | list[TokenInfo], offset: int
                         ) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs for `tokens`, whose first token starts at character `offset`; and the offset after
    them. Offsets add up the tokens' texts (a token that holds part of a character counts its replacement
    character), as vLLM counts them; each top_logprobs dict also holds the emitted token, as vLLM's does."""
    out = CompletionLogprobs([], [], [], [])
    for token in tokens:
        out.tokens.append(token.text)
        out.token_logprobs.append(token.logprob)
        top = dict(token.top)
        top.setdefault(token.text, token.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token.text)
    return out, offset


class ChatFormat(Format):
    object_chunk, object_whole = "chat.completion.chunk", "chat.completion"

    def opening(self, count: int) -> list[Chunk]:
        # The role goes out at once (before any token), as OpenAI does; content deltas follow.
        return [self.chunk([DeltaChoice(i, Delta(role="assistant", content=""), None)]) for i in range(count)]

    def delta(self, index: int, text: str, tokens: tuple[TokenInfo, ...] = (),
              finish_reason: str | None = None) -> DeltaChoice:
        logprobs = _chat_logprobs(tokens) if self.logprobs and finish_reason is None else None
        return DeltaChoice(index, Delta(content=text) if text else Delta(), finish_reason, logprobs)

    def whole_choice(self, index: int, text: str, tokens: list[TokenInfo], finish_reason: str) -> MessageChoice:
        return MessageChoice(index, Message("assistant", text), finish_reason,
                             _chat_logprobs(tokens) if self.logprobs else None)


def _chat_logprobs(tokens: tuple[TokenInfo, ...] | list[TokenInfo]) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text, logprob and UTF-8 bytes, and the top tokens' (exactly top_logprobs
    of them)."""
    return ChatLogprobs([TokenLogprob(t.text, t.logprob, list(t.text.encode()),
                                      [TopLogprob(text, logprob, list(text.encode())) for text, logprob in t.top])
                         for t in tokens])


async def sse_stream(pieces: AsyncIterator[tuple[int, Piece]], fmt: Format, count: int,
                     include_usage: bool) -> AsyncIterator[bytes]:
    """SSE bytes of `count` choices' tagged pieces, one yield per chunk so each leaves at once; the usage chunk (when
    asked) after every choice finished; always ends with `data: [DONE]`."""
    for chunk in fmt.opening(count):
        yield _sse(chunk)
    usages: list[Usage] = []
    async with contextlib.aclosing(pieces):  # closed at once, never left to the garbage collector
        async for index, piece in pieces:
            if piece.error is not None:
                yield _sse(_generation_failed(piece).payload())
                break
            if piece.text or piece.tokens:
                yield _sse(fmt.chunk([fmt.delta(index, piece.text, piece.tokens)]))
            if piece.finish_reason is not None:
                hits = hits_of(piece.usage) if piece.usage else None
                yield _sse(fmt.chunk([fmt.delta(index, "", (), piece.finish_reason)], kvshare=hits))
                if piece.usage is not None:
                    usages.append(piece.usage)
    if include_usage and usages and len(usages) == count:
        yield _sse(fmt.chunk([], usage=UsageBody.of(total_usage(usages))))
    yield b"data: [DONE]\n\n"


@dataclass
class _Choice:
    parts: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


async def collect(pieces: AsyncIterator[tuple[int, Piece]], fmt: Format, count: int) -> Response:
    """One body once all `count` choices finished; the first error fails the whole request (as vLLM does)."""
    choices = [_Choice() for _ in range(count)]
    async with contextlib.aclosing(pieces):  # closed at once, never left to the garbage collector
        async for index, piece in pieces:
            if piece.error is not None:
                return _generation_failed(piece).response()
            choice = choices[index]
            choice.parts.append(piece.text)
            choice.tokens.extend(piece.tokens)
            if piece.finish_reason is not None:
                choice.finish_reason, choice.usage = piece.finish_reason, piece.usage
            if all(c.finish_reason is not None for c in choices):
                body = fmt.whole([fmt.whole_choice(i, "".join(c.parts), c.tokens, c.finish_reason)
                                  for i, c in enumerate(choices)], total_usage([c.usage for c in choices]))
                return Response(_encoder.encode(body), media_type="application/json")
    return ApiError(500, "the engine ended the request without a finished event").response()


def _generation_failed(piece: Piece) -> ApiError:
    """A request that failed alone is marked so (code and header): a router must not retry it elsewhere."""
    return ApiError(500, f"generation failed: {piece.error}", code="request_failed" if piece.request_caused else None,
                    request_caused=piece.request_caused)
