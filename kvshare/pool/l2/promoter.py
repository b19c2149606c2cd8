"""Promotion: the chunks that follow an L1 prefix are fetched from L2, verified, and committed into L1.

Runs as an asyncio task with its blocking parts (Redis GETs with verification, copies into the arena) on a thread
pool, so the loop keeps serving other connections. Order per batch: GET + verify (thread) -> RESERVE (loop) -> copy
(thread) -> COMMIT (loop). Chunks are taken strictly in prefix order, stopping at the first miss or rejected value,
because a LOOKUP can only use a contiguous prefix.

The internal write lease of a promotion has no deadline: the copy thread writes into its pages, so they must not be
freed under it. It always ends (COMMIT, or RELEASE in `finally`), and the copy is a bounded memcpy, not Redis I/O.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

import numpy as np

from kvshare.pool.l2 import codec
from kvshare.pool.l2.store import L2Unavailable, RedisStore
from kvshare.pool.protocol import NewChunk
from kvshare.pool.state import PoolState, RequestError

log = logging.getLogger(__name__)


class Promoter:
    def __init__(self, store: RedisStore, state: PoolState, pages: np.ndarray, counters, executor: Executor,
                 client: int, batch_bytes: int) -> None:
        self.store = store
        self.state = state  # touched only on the loop thread
        self.pages = pages  # uint8 [num_pages, page_size]: this process's mapping of the arena
        self.counters = counters
        self.executor = executor
        self.client = client  # the connection id that owns the tier's internal leases
        self.batch_bytes = batch_bytes

    async def promote(self, namespace: bytes, keys: list[bytes], tokens: list[bytes], parent: bytes) -> int:
        """Promote L2 hits for `keys` (which follow the L1 prefix ending at `parent`); returns how many committed.

        The GET of the next batch runs while the current batch is installed (two batches of memory at most). The first
        batch is one chunk, which tells the chunk size; later ones fill batch_bytes."""
        loop = asyncio.get_running_loop()

        def fetch(start: int, count: int, parent: bytes):
            end = min(len(keys), start + count)
            return loop.run_in_executor(self.executor, self._fetch, namespace, keys[start:end], tokens[start:end],
                                        parent)

        done, pending = 0, fetch(0, 1, parent)
        while pending is not None:
            found, complete = await pending
            pending = None
            if complete and done + len(found) < len(keys):
                batch = max(1, self.batch_bytes // found[0][0].nbytes)
                pending = fetch(done + len(found), batch, found[-1][0].key)
            if found and not await self._install(loop, namespace, found):
                break  # no room in L1; a prefetched batch is dropped
            done += len(found)
        return done

    def _fetch(self, namespace: bytes, keys: list[bytes], tokens: list[bytes], parent: bytes):
        """(verified (header, payload) prefix, whether every key was found and verified). Runs on a thread."""
        try:
            values = self.store.get_many([codec.redis_key(namespace, k) for k in keys])
        except L2Unavailable as error:
            self.counters.add(l2_errors=int(error.attempted))
            return [], False
        found = []
        for key, expected, value in zip(keys, tokens, values):
            if value is None:
                return found, False
            try:
                header, payload = codec.decode_verified(value, namespace, key, parent, expected)
            except codec.Rejected as error:
                log.warning("L2 value of chunk %s rejected: %s", key.hex(), error)
                self.counters.add(l2_rejected=1)
                return found, False
            found.append((header, payload))
            self.counters.add(l2_hits=1)
            parent = key
        return found, True

    async def _install(self, loop: asyncio.AbstractEventLoop, namespace: bytes, found) -> bool:
        """RESERVE pages for the verified chunks, copy them in off the loop, COMMIT; False if L1 had no room. Chunks
        already in L1 (or being written there by a replica) are skipped by RESERVE."""
        try:
            reply = self.state.reserve(self.client, namespace,
                                       [NewChunk(h.key, h.parent, h.tokens, h.nbytes) for h, _ in found])
        except RequestError as error:  # no space: L1 is full of leased chunks; the LOOKUP reports fewer hits
            log.info("L2 promotion skipped: %s", error.message)
            return False
        if not reply.lease:
            return True
        self.state.leases.keep(self.state.leases.get(reply.lease))  # see the module docstring
        chosen = [(ref, payload, h.checksum) for ref, (h, payload) in zip(reply.chunks, found) if ref is not None]
        committed = False
        try:
            await loop.run_in_executor(self.executor, self._copy_in, chosen)
            self.state.commit(self.client, reply.lease, [checksum for _, _, checksum in chosen])
            committed = True
            self.counters.add(l2_promotions=len(chosen))
        except asyncio.CancelledError:
            # Only at shutdown. The copy thread may still be writing these pages: keep the lease (and the pages).
            committed = True
            raise
        finally:
            if not committed:
                self.state.release(self.client, reply.lease)
        return True

    def _copy_in(self, chosen) -> None:
        page_size = self.pages.shape[1]
        for ref, payload, _ in chosen:
            src = np.frombuffer(payload, dtype=np.uint8)
            for i, page in enumerate(ref.pages):
                part = src[i * page_size : (i + 1) * page_size]
                self.pages[page, : part.size] = part
