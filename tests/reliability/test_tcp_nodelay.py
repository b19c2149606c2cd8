"""Every connection that `kvshare serve` and `kvshare route` accept writes at once (TCP_NODELAY): with Nagle on, the
router's first SSE chunk, written right after its headers, waited for the client's delayed ACK (~40 ms on Linux) on
keep-alive connections. The servers listen on the socket reserve_port made, so that is the socket checked here, under
the same guarded protocol the servers run."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from uvicorn.server import ServerState

from kvshare.httpguard.limits import HttpLimits
from kvshare.httpguard.protocol import GuardedH11Protocol
from kvshare.httpguard.serve import reserve_port


async def _empty_app(scope, receive, send) -> None:
    return None


async def _server_side_nodelay(listening: socket.socket) -> int:
    """TCP_NODELAY of the server's end of one accepted connection."""
    config = uvicorn.Config(_empty_app, log_level="warning")
    config.load()
    state = ServerState()
    limits = HttpLimits()
    server = await asyncio.get_running_loop().create_server(
        lambda: GuardedH11Protocol(config, state, {}, limits=limits), sock=listening)
    try:
        _, writer = await asyncio.open_connection(*listening.getsockname()[:2])
        for _ in range(500):  # bounded: the accept runs on this loop within a few iterations
            if state.connections:
                break
            await asyncio.sleep(0.01)
        (accepted,) = state.connections
        value = accepted.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        return value
    finally:
        server.close()


def test_a_connection_the_servers_accept_has_nagle_off():
    listening = reserve_port("127.0.0.1", 0)
    try:
        assert asyncio.run(_server_side_nodelay(listening)) != 0
    finally:
        listening.close()
