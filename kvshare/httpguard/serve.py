"""Runs an ASGI app under uvicorn with every limit of `HttpLimits`: the body limit around the app, the guarded h11
protocol (always h11, whatever else is installed, so the limits do not depend on the environment), and uvicorn's own
keep-alive and header-size settings."""

from __future__ import annotations

import functools
import socket

from kvshare.httpguard.asgi import RequestLimit
from kvshare.httpguard.limits import HttpLimits
from kvshare.httpguard.protocol import GuardedH11Protocol


def guarded(app, limits: HttpLimits):
    """The ASGI app as the server runs it: heads and bodies over the limits never reach `app`."""
    return RequestLimit(app, limits.max_body_bytes, limits.max_header_bytes)


def reserve_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound now and listening once serve() starts: a caller that binds before its slow start-up
    (loading a model) fails at once on a busy port, with one line (an OSError) naming the address, instead of after
    announcing that it serves. Until serve() listens, connections are refused (not left hanging in a backlog)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # as getaddrinfo gives uvicorn's own bind
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a port in TIME_WAIT
    try:
        sock.bind((host, port))  # fails while another socket listens on the port, SO_REUSEADDR or not
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error} (another server on that port? pass "
                      "another --port)") from None
    return sock


def serve(app, host: str, port: int, limits: HttpLimits, sock: socket.socket | None = None) -> None:
    """Serves until SIGINT/SIGTERM (blocking), on `sock` when given (from reserve_port(host, port); the event loop
    makes it listen), else on a socket uvicorn binds itself."""
    import uvicorn

    config = uvicorn.Config(
        guarded(app, limits), host=host, port=port, log_level="warning", access_log=False,
        http=functools.partial(GuardedH11Protocol, limits=limits),
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,
    )
    uvicorn.Server(config).run(sockets=None if sock is None else [sock])
