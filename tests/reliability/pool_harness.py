"""An in-process pool server over a real (small) arena, for fuzzing the decoder and handlers without sockets:
`handle(body)` runs exactly what the server runs for one frame, then the full integrity check."""

from __future__ import annotations

import asyncio
import os
import tempfile

import msgspec
import xxhash

from kvshare.pool import protocol as p
from kvshare.pool.arena import Arena
from kvshare.pool.config import PoolConfig
from kvshare.pool.server import Connection, PoolServer

PAGE = 4096
NUM_PAGES = 16
NAMESPACE = xxhash.xxh3_128_digest(b"tests/reliability/fuzz")
BAD_CODES = (p.ErrorCode.INTERNAL, p.ErrorCode.INTEGRITY)  # a handler bug, whatever the input


class Harness:
    def __init__(self, lease_limit: int = NUM_PAGES // 2) -> None:
        arena_path = f"/dev/shm/kvshare-fuzz-{os.getpid()}-{os.urandom(4).hex()}.arena"
        config = PoolConfig(PAGE * NUM_PAGES, socket=os.path.join(tempfile.gettempdir(), "unused.sock"),
                            arena=arena_path, page_size=PAGE, max_leased_pages_per_client=lease_limit,
                            lease_timeout=5.0)
        self.arena = Arena.create(arena_path, config.size)
        os.unlink(arena_path)  # nothing maps it by name here, and a fuzzer that exits from C leaves no file behind
        self.loop = asyncio.new_event_loop()  # the handler is a coroutine (a LOOKUP may await an L2 promotion)
        self.server = PoolServer(config, self.arena)
        self.server.state.allocator.add_prepared(NUM_PAGES // 2)  # half prepared: the rest arrives while serving
        self.connections = [Connection(i, authenticated=True) for i in (1, 2)]
        self.server.state.hello(NAMESPACE, "fuzz")

    def handle(self, body: bytes, client: int = 0) -> p.Reply:
        """One frame's body through the server's handler; raises if the reply is an internal error or the pool's
        bookkeeping is inconsistent afterwards."""
        reply = self.loop.run_until_complete(self._handle(self.connections[client % 2], body))
        assert isinstance(reply, p.Reply), reply
        if isinstance(reply, p.Error):
            assert reply.code not in BAD_CODES, reply.message
            assert reply.message  # every error says what was wrong
        self.server.state.check_integrity()
        return reply

    async def _handle(self, conn: Connection, body: bytes) -> p.Reply:
        """The server's handler awaited to its reply (a LOOKUP may return a coroutine), without a connection."""
        reply = self.server.handle(conn, body)
        return reply if isinstance(reply, p.Reply) else await reply

    def drop(self, client: int) -> None:
        self.server.state.drop_client(self.connections[client % 2].id)
        self.server.state.check_integrity()

    def close(self) -> None:
        self.loop.close()
        self.arena.close(remove=True)


def encode(message: dict | msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(message)
