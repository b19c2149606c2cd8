"""StripedPromoter: the default promotion path. The chunks after an L1 prefix are fetched on many connections at once
(lanes.py: striped over each node's lanes and over cluster masters, pipelined), each verified on a verify thread as
soon as it arrives, and installed into L1 in prefix order (install.py) while later chunks are still being fetched and
verified. So fetching chunk i+1, verifying chunk i and copying chunk i-1 into the arena overlap.

Guarantees, as on the redis-py path (promoter.py):
- Prefix order: chunk i is installed only after chunks 0..i-1; the first missing, rejected or failed chunk ends the
  promotion, and nothing after it is installed even if it arrived first (counters are taken in that order too:
  l2_hits counts the verified chunks before the stop, l2_rejected the rejection that stopped it).
- Verification: every value passes codec.decode_verified (every header field, then the checksum) before RESERVE.
- Bounded memory: at most `window` chunks are being fetched or verified (batch_bytes of them once the chunk size is
  known: the first promotion of a namespace fetches one chunk first to learn it), plus the run being installed: two
  windows at most, as the redis-py path's two batches.
- Nothing blocks the loop: submit() only queues, lanes.prepare() (cluster discovery) runs on a worker thread, and
  results come back through futures.
- The breaker: a promotion that finds it open does nothing; one that meets a failed GET reports one failure, one that
  met none reports success (so a half-open trial is decided by one promotion).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from kvshare.pool.l2 import codec
from kvshare.pool.l2.breaker import Breaker
from kvshare.pool.l2.install import Installer
from kvshare.pool.l2.lanes import Job, Lanes, Received, ValueTooLong
from kvshare.pool.l2.store import L2Unavailable

log = logging.getLogger(__name__)
_KNOWN_NAMESPACES = 4096  # chunk sizes remembered (one int each); forgotten all at once beyond that


@dataclass
class Verified:
    header: codec.Header
    payload: memoryview
    received: Received  # the buffer the payload lives in


@dataclass
class Stop:
    """Why a chunk ends the promotion: 'missing', 'rejected' (with the reason) or 'error'."""

    kind: str
    reason: str = ""
    index: int = -1  # which of the promotion's keys (set when the promoter takes it, in order)


class StripedPromoter:
    def __init__(self, lanes: Lanes, breaker: Breaker, installer: Installer, counters, executor: Executor,
                 verify_executor: Executor, batch_bytes: int) -> None:
        self.lanes = lanes
        self.breaker = breaker
        self.installer = installer
        self.counters = counters
        self.executor = executor  # blocking setup (lanes.prepare)
        self.verify_executor = verify_executor
        self.batch_bytes = batch_bytes
        self._sizes: dict[bytes, tuple[int, int]] = {}  # namespace -> (chunk bytes, value length) seen last

    async def promote(self, namespace: bytes, keys: list[bytes], tokens: list[bytes], parent: bytes) -> int:
        """Promote L2 hits for `keys` (which follow the L1 prefix ending at `parent`); returns how many committed."""
        if not self.breaker.allow():
            return 0
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.lanes.prepare)
        except L2Unavailable as error:
            self._failed(error)
            return 0
        run = _Run(self, namespace, keys, tokens, parent)
        try:
            done = await run.go()
        finally:
            run.abandon()
        if run.error is not None:
            self.lanes.invalidate()  # a node may have failed over: read the slot map again next time
            self._failed(run.error)
        else:
            self.breaker.succeeded()
        return done

    def _failed(self, error: L2Unavailable) -> None:
        log.warning("%s", error)
        self.counters.add(l2_errors=1)
        self.breaker.failed()

    def window(self, namespace: bytes) -> int:
        """How many chunks may be in flight (1 until the namespace's chunk size is known)."""
        nbytes, _ = self._sizes.get(namespace, (0, 0))
        return max(1, self.batch_bytes // nbytes) if nbytes else 1

    def expected_length(self, namespace: bytes) -> int:
        """The namespace's L2 value length as last seen (0: unknown); lets lanes fetch values in pieces."""
        return self._sizes.get(namespace, (0, 0))[1]

    def learn(self, namespace: bytes, verified: "Verified") -> None:
        if len(self._sizes) >= _KNOWN_NAMESPACES:
            self._sizes.clear()
        self._sizes[namespace] = (verified.header.nbytes, len(verified.received.data))

    def forget(self, namespace: bytes) -> None:
        self._sizes.pop(namespace, None)

    def verify_after(self, fetched: Future, namespace: bytes, key: bytes, parent: bytes, tokens: bytes) -> Future:
        """A future of the chunk's outcome (Verified or Stop): verification is submitted to the verify threads by
        the lane that completes the fetch, so it starts at once whatever the promoter is waiting for."""
        outcome: Future = Future()

        def on_fetched(done: Future) -> None:
            if done.cancelled():
                outcome.cancel()
                return
            error = done.exception()
            if isinstance(error, ValueTooLong):  # not the size seen before: fetch whole values next time
                self.forget(namespace)
                outcome.set_result(Stop("missing", str(error)))
                return
            if error is not None:
                outcome.set_result(Stop("error", str(error)))
                return
            received = done.result()
            if received is None:
                outcome.set_result(Stop("missing"))
                return
            try:
                self.verify_executor.submit(_verify, received, namespace, key, parent, tokens, outcome)
            except RuntimeError:  # the executor is shut down: the pool is stopping
                received.release()
                outcome.set_result(Stop("error", "shutting down"))

        fetched.add_done_callback(on_fetched)
        return outcome


def _verify(received: Received, namespace: bytes, key: bytes, parent: bytes, tokens: bytes, outcome: Future) -> None:
    """Runs on a verify thread."""
    try:
        header, payload = codec.decode_verified(received.data, namespace, key, parent, tokens)
    except codec.Rejected as error:
        received.release()
        outcome.set_result(Stop("rejected", str(error)))
        return
    except BaseException as error:  # never leave the outcome pending
        received.release()
        outcome.set_result(Stop("error", repr(error)))
        raise
    outcome.set_result(Verified(header, payload, received))


class _Run:
    """One promotion: dispatch a window of GETs, take outcomes in prefix order, install runs of verified chunks."""

    def __init__(self, promoter: StripedPromoter, namespace: bytes, keys: list[bytes], tokens: list[bytes],
                 parent: bytes) -> None:
        self.p = promoter
        self.namespace, self.keys, self.tokens = namespace, keys, tokens
        self.parents = [parent, *keys[:-1]]
        self.names = [codec.redis_key(namespace, key).encode() for key in keys]
        self.job = Job()
        self.pending: deque[Future] = deque()  # outcomes of dispatched, not yet installed chunks, in prefix order
        self.next = 0  # first key not dispatched yet
        self.taken = 0  # outcomes taken from pending so far (the next one is keys[taken]'s)
        self.error: L2Unavailable | None = None

    async def go(self) -> int:
        done = 0
        while True:
            self._dispatch()
            if not self.pending:
                return done
            batch, stop = await self._ready_run()
            if batch:
                self.p.learn(self.namespace, batch[0])
                self._dispatch()  # refill the window before installing: the fetches go on meanwhile
                try:
                    installed = await self.p.installer.install(self.namespace,
                                                               [(v.header, v.payload) for v in batch])
                finally:
                    for verified in batch:
                        verified.received.release()
                if not installed:
                    return done
                done += len(batch)
            if stop is not None:
                self._count_stop(stop)
                return done

    def _dispatch(self) -> None:
        room = self.p.window(self.namespace) - len(self.pending)
        count = min(room, len(self.keys) - self.next)
        if count <= 0:
            return
        start = self.next
        fetches = self.p.lanes.submit(self.names[start : start + count], self.job,
                                      self.p.expected_length(self.namespace))
        for offset, fetched in enumerate(fetches):
            i = start + offset
            self.pending.append(self.p.verify_after(fetched, self.namespace, self.keys[i], self.parents[i],
                                                    self.tokens[i]))
        self.next += count

    async def _ready_run(self) -> tuple[list[Verified], Stop | None]:
        """Wait for the first pending outcome, then take every following one that is already there, up to the first
        Stop: (verified run, the Stop that ended it or None)."""
        await asyncio.wrap_future(self.pending[0])
        batch: list[Verified] = []
        while self.pending and self.pending[0].done():
            outcome = self.pending.popleft().result()
            self.taken += 1
            if isinstance(outcome, Stop):
                outcome.index = self.taken - 1
                return batch, outcome
            batch.append(outcome)
            self.p.counters.add(l2_hits=1)
        return batch, None

    def _count_stop(self, stop: Stop) -> None:
        if stop.kind == "rejected":
            log.warning("L2 value of chunk %s rejected: %s", self.keys[stop.index].hex(), stop.reason)
            self.p.counters.add(l2_rejected=1)
        elif stop.kind == "error":
            self.error = L2Unavailable(stop.reason)

    def abandon(self) -> None:
        """Drop what is still pending: unsent GETs are cancelled, and buffers of values that still arrive are given
        back as they do."""
        self.job.cancelled = True
        while self.pending:
            self.pending.popleft().add_done_callback(_release_outcome)


def _release_outcome(outcome: Future) -> None:
    if not outcome.cancelled() and isinstance(outcome.result(), Verified):
        outcome.result().received.release()
