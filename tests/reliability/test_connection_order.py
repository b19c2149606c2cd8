"""The connection's two guards around a request that waits (a LOOKUP awaiting L2 promotion): replies leave in
request order, because reading pauses until the waiting request is answered; and a client that leaves while it
waits loses the lease its request then grants. Driven through ClientProtocol with a transport that, like asyncio's,
delivers no bytes while reading is paused."""

from __future__ import annotations

import asyncio
import time

import pytest
import xxhash

from kvshare.pool import protocol as p
from kvshare.pool.connection import ClientProtocol
from kvshare.pool.server import Connection

from .pool_harness import NAMESPACE, PAGE, Harness

KEY = xxhash.xxh3_128_digest(b"tests/reliability/connection-order")
TOKENS = bytes(64)


class HeldL2:
    """An L2 tier whose LOOKUP waits until released, then answers from L1 (what a promotion that found nothing does)."""

    def __init__(self, state) -> None:
        self.state, self.release = state, asyncio.Event()

    async def lookup(self, client: int, namespace: bytes, keys: list[bytes], blob: bytes | memoryview,
                     lengths: list[int], promote: bool = True) -> p.LookupReply:
        blob = bytes(blob)  # as the real tier: the answer outlives the frame it came in
        await self.release.wait()
        return self.state.lookup_joined(client, namespace, keys, blob, lengths)

    def fill(self, stats) -> None:  # STATS asks the tier for its counters
        pass


class PausingTransport(asyncio.Transport):
    """Feeds bytes to the protocol only while reading is not paused; records what the server writes."""

    def __init__(self, protocol: ClientProtocol) -> None:
        super().__init__()
        self.protocol, self.inbox, self.paused, self.written, self.closed = protocol, bytearray(), False, [], False

    def feed(self, data: bytes) -> None:
        self.inbox += data
        self._deliver()

    def _deliver(self) -> None:
        while self.inbox and not self.paused:
            buffer = self.protocol.get_buffer(len(self.inbox))
            n = min(len(buffer), len(self.inbox))
            buffer[:n] = self.inbox[:n]
            del self.inbox[:n]
            self.protocol.buffer_updated(n)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        self._deliver()

    def write(self, data) -> None:
        self.written.append(p.reply_decoder.decode(bytes(data)[p.HEADER.size :]))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def waiting():
    """A pool with one committed chunk, and one client connection whose LOOKUPs wait in HeldL2 until released:
    (harness, protocol, transport, held)."""
    harness = Harness()
    try:
        state = harness.server.state
        reservation = state.reserve(9, NAMESPACE, [p.NewChunk(KEY, NAMESPACE, TOKENS, PAGE)])
        state.commit(9, reservation.lease, [0])
        harness.server.l2 = held = HeldL2(state)
        protocol = ClientProtocol(harness.server, Connection(1, authenticated=True))
        transport = PausingTransport(protocol)
        protocol.connection_made(transport)
        yield harness, protocol, transport, held
    finally:
        harness.close()


def test_a_waiting_lookup_is_answered_before_the_requests_sent_after_it(waiting):
    harness, protocol, transport, held = waiting

    async def scenario():
        transport.feed(p.frame(p.Lookup.of(NAMESPACE, [KEY], [TOKENS])) + p.frame(p.Stats()))
        await asyncio.sleep(0.05)
        assert transport.written == []  # STATS is not answered ahead of the waiting LOOKUP
        held.release.set()
        for _ in range(100):
            if len(transport.written) == 2:
                break
            await asyncio.sleep(0.01)

    harness.loop.run_until_complete(scenario())
    assert [type(r) for r in transport.written] == [p.LookupReply, p.StatsReply]
    assert transport.written[0].lease


def test_a_client_gone_while_its_lookup_waits_holds_no_live_lease_after_it_is_answered(waiting):
    harness, protocol, transport, held = waiting

    async def scenario():
        transport.feed(p.frame(p.Lookup.of(NAMESPACE, [KEY], [TOKENS])))
        await asyncio.sleep(0.05)
        protocol.connection_lost(None)  # the client leaves while the LOOKUP waits
        held.release.set()
        for _ in range(100):
            if protocol._pending is None:
                break
            await asyncio.sleep(0.01)

    harness.loop.run_until_complete(scenario())
    state = harness.server.state
    # The read lease the LOOKUP granted is fenced with the client (no rights; I10). This transport has no socket,
    # so the pool cannot watch its process: the fence ends one lease timeout later.
    assert [lease.fenced for lease in state.leases] == [True]
    state.check_integrity()
    state.clock = lambda: time.monotonic() + state.leases.timeout + 1
    state.expire()
    assert len(state.leases) == 0
    state.check_integrity()
