"""L2Tier: what the pool server calls — write-behind after COMMIT, promotion inside LOOKUP, counters for STATS.

Runs on the server's loop thread except where noted. Design choice for LOOKUP (documented in docs/architecture.md):
promotion runs off the loop and the LOOKUP's answer waits for it at most `promote_timeout` seconds; a promotion that
takes longer keeps going in the background and serves the next LOOKUP, while this one answers with what L1 holds.
Other connections are served meanwhile. Every L2 failure is counted and becomes fewer hits, never an error reply.

Internal leases: the tier pins chunks with ordinary leases owned by internal client ids (connections start at 1), so
the pool's own bookkeeping (eviction skips them, check_integrity counts them) covers them; they show in STATS'
read_leases/write_leases while held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kvshare.pool.arena import Mapping
from kvshare.pool.index import Entry
from kvshare.pool.l2.buffers import BufferPool
from kvshare.pool.l2.config import L2Config
from kvshare.pool.l2.install import Installer
from kvshare.pool.l2.lanes import Lanes
from kvshare.pool.l2.promoter import Promoter
from kvshare.pool.l2.store import RedisStore
from kvshare.pool.l2.striped import StripedPromoter
from kvshare.pool.l2.writer import Job, WriteBehind
from kvshare.pool.protocol import LookupReply
from kvshare.pool.state import PoolState

log = logging.getLogger(__name__)
INTERNAL_CLIENT = 0  # owns the pins (write-behind, the L1 prefix during promotion)
PROMOTION_CLIENT = -1  # owns promotions' write leases: a separate per-client lease budget from the pins
FIELDS = ("l2_writes", "l2_write_drops", "l2_errors", "l2_hits", "l2_promotions", "l2_rejected", "l2_promoted_bytes",
          "l2_promote_seconds")


class Counters:
    """The L2 counters of PoolStats; added to from the worker threads, hence the lock (held for an add only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = Counter()

    def add(self, **deltas: int) -> None:
        with self._lock:
            self._values.update(deltas)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: self._values[name] for name in FIELDS}


class L2Tier:
    def __init__(self, config: L2Config, state: PoolState, arena_path: str, page_size: int, num_pages: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.state = state
        self.loop = loop
        self.counters = Counters()
        self.store = RedisStore(config)
        self._mapping = Mapping(arena_path, page_size, num_pages)  # the server's own view: copies out and in
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="l2-promote")  # arena copies, cluster discovery
        self.writer = WriteBehind(self.store, self._mapping.pages, self.counters, self._unpin_threadsafe,
                                  config.queue, config.batch_bytes)
        installer = Installer(state, self._mapping.pages, self.counters, self._executor, PROMOTION_CLIENT)
        self._lanes: Lanes | None = None
        self._verify_executor: ThreadPoolExecutor | None = None
        if config.fetch == "striped":
            self._lanes = Lanes(config, BufferPool(retain_bytes=2 * config.batch_bytes))
            self._verify_executor = ThreadPoolExecutor(config.verify_threads, thread_name_prefix="l2-verify")
            self.promoter = StripedPromoter(self._lanes, self.store.breaker, installer, self.counters, self._executor,
                                            self._verify_executor, config.batch_bytes)
        else:
            self.promoter = Promoter(self.store, installer, self.counters, self._executor, config.batch_bytes)
        self._promotions: dict[tuple[bytes, bytes], asyncio.Task] = {}  # (namespace, first key) -> running task

    # ---- write-behind ------------------------------------------------------------------------------------------

    def after_commit(self, entries: list[Entry]) -> None:
        """Queue freshly committed chunks for L2, each pinned until the worker has copied it; never blocks."""
        for e in entries:
            lease = self._pin([e.key])
            if not self.writer.offer(Job(e.namespace, e.key, e.parent, e.tokens, e.nbytes, e.checksum, list(e.pages),
                                         lease)):
                self._unpin([lease])
                self.counters.add(l2_write_drops=1)

    def _pin(self, keys: list[bytes]) -> int:
        """An internal read lease on committed chunks, without deadline: it ends only by _unpin."""
        lease = self.state.pin(INTERNAL_CLIENT, [self.state.index.committed[key] for key in keys])
        self.state.leases.keep(lease)
        return lease.id

    def _unpin(self, lease_ids: list[int]) -> None:
        for lease_id in lease_ids:
            self.state.release(INTERNAL_CLIENT, lease_id)

    def _unpin_threadsafe(self, lease_ids: list[int]) -> None:
        """Called on the worker thread: PoolState belongs to the loop thread."""
        try:
            self.loop.call_soon_threadsafe(self._unpin, lease_ids)
        except RuntimeError:
            pass  # the loop has closed: shutting down, the pages no longer matter

    # ---- lookup ------------------------------------------------------------------------------------------------

    async def lookup(self, client: int, namespace: bytes, keys: list[bytes], blob: bytes | memoryview,
                     lengths: list[int], promote: bool = True) -> LookupReply:
        """LOOKUP with promotion: if L1's prefix ends early, wait (bounded) for L2's next chunks to be promoted.
        promote=False answers from L1 at once (the replica decides whether promotion pays, and asks again).

        `blob` holds every chunk's token bytes back to back (`lengths` each, checked by the caller); it is copied
        first (the answer is awaited, and a promotion keeps slices of it in the index). One copy per LOOKUP (it was
        three: per-chunk slices, a join for L1's check, a join in PoolState)."""
        if not promote:  # nothing awaited before the answer: the receive buffer's view is still valid
            return self.state.lookup_joined(client, namespace, keys, blob, lengths)
        blob = bytes(blob)  # the server passes its receive buffer's view; this answer outlives the frame
        n = self._l1_prefix(namespace, keys, blob, lengths)
        if n is not None and n < len(keys) and self.store.breaker.may_try():
            pin = self._pin(keys[:n]) if n else 0  # keep the L1 prefix while promotion reserves (and may evict)
            missing = list(itertools.accumulate(lengths, initial=0))[n:]  # byte offsets of chunks n.. and the end
            tokens = [blob[a:b] for a, b in itertools.pairwise(missing)]  # bytes: they go into the index as they are
            try:
                await self._wait_promotion(namespace, keys[n:], tokens, keys[n - 1] if n else namespace)
            finally:
                if pin:
                    self._unpin([pin])
        return self.state.lookup_joined(client, namespace, keys, blob, lengths)

    async def _wait_promotion(self, namespace: bytes, keys: list[bytes], tokens: list[bytes], parent: bytes) -> None:
        slot = (namespace, keys[0])
        task = self._promotions.get(slot)
        if task is None:  # a LOOKUP of the same missing chunks joins the running promotion instead of repeating it
            task = asyncio.ensure_future(self._promote(namespace, keys, tokens, parent))
            self._promotions[slot] = task
            task.add_done_callback(lambda _: self._promotions.pop(slot, None))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.promote_timeout)
        except asyncio.TimeoutError:
            log.debug("promotion still running after %g s: answering with L1 only", self.config.promote_timeout)

    async def _promote(self, namespace: bytes, keys: list[bytes], tokens: list[bytes], parent: bytes) -> None:
        started = time.monotonic()
        try:
            if await self.promoter.promote(namespace, keys, tokens, parent):  # its rate: bytes (install.py) / time
                self.counters.add(l2_promote_seconds=time.monotonic() - started)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must cost hits, never a LOOKUP
            log.exception("L2 promotion failed")
            self.counters.add(l2_errors=1)

    def _l1_prefix(self, namespace: bytes, keys: list[bytes], blob: bytes, lengths: list[int]) -> int | None:
        """How many leading keys L1 would hit (PoolState's own verification, without side effects); None for a
        request that PoolState.lookup will refuse anyway."""
        if namespace not in self.state.namespaces:
            return None
        hits, _ = self.state.verified_prefix(namespace, keys, blob, lengths)
        return len(hits)

    # ---- observation and shutdown ------------------------------------------------------------------------------

    def fill(self, stats) -> None:
        stats.l2_enabled = True
        for name, value in self.counters.snapshot().items():
            setattr(stats, name, value)

    def close(self) -> None:
        self.writer.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._lanes is not None:
            self._lanes.close()
            self._verify_executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()
