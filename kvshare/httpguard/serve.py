"""Runs an ASGI app under uvicorn with every limit of `HttpLimits`: the body limit around the app, the guarded h11
protocol (always h11, whatever else is installed, so the limits do not depend on the environment), and uvicorn's own
keep-alive and header-size settings."""

from __future__ import annotations

import functools

from kvshare.httpguard.asgi import RequestLimit
from kvshare.httpguard.limits import HttpLimits
from kvshare.httpguard.protocol import GuardedH11Protocol


def guarded(app, limits: HttpLimits):
    """The ASGI app as the server runs it: heads and bodies over the limits never reach `app`."""
    return RequestLimit(app, limits.max_body_bytes, limits.max_header_bytes)


def serve(app, host: str, port: int, limits: HttpLimits) -> None:
    """Serves until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    config = uvicorn.Config(
        guarded(app, limits), host=host, port=port, log_level="warning", access_log=False,
        http=functools.partial(GuardedH11Protocol, limits=limits),
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,
    )
    uvicorn.Server(config).run()
