"""The engine-thread -> asyncio bridge: one request's TokenEvents delivered into the server's event loop."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from kvshare.engine.api import EngineProtocol, GenerationRequest, TokenEvent
from kvshare.serve.schema import ApiError

log = logging.getLogger("kvshare.serve")


class EventStream:
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
