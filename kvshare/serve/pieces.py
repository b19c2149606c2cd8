"""Engine events -> text pieces: token ids to text deltas (holding back half characters and stop-string prefixes),
stop strings, usage, metrics. The formats (formats.py) turn pieces into SSE chunks or one body."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from kvshare.engine.api import Usage
from kvshare.hf.detokenize import IncrementalText
from kvshare.serve.bridge import EventStream
from kvshare.serve.validation import Prepared

if TYPE_CHECKING:
    from kvshare.serve.app import Server


@dataclass(frozen=True)
class Piece:
    """A step of a response: new text, and on the last piece the finish reason and usage (or an error)."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    request_caused: bool = False  # with error: the request failed alone (see TokenEvent)


async def pieces(app: "Server", prepared: Prepared, stream: EventStream, endpoint: str) -> AsyncIterator[Piece]:
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
