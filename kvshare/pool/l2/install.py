"""Installer: verified L2 chunks into L1 — RESERVE (loop), copy into the arena (a worker thread), COMMIT (loop).
Both promotion paths (promoter.py, striped.py) install through it.

The internal write lease of a promotion has no deadline: the copy thread writes into its pages, so they must not be
freed under it. It always ends (COMMIT, or RELEASE in `finally`), and the copy is a bounded memcpy, not Redis I/O.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

import numpy as np

from kvshare.pool.l2 import codec
from kvshare.pool.protocol import NewChunk
from kvshare.pool.state import PoolState, RequestError

log = logging.getLogger(__name__)


class Installer:
    def __init__(self, state: PoolState, pages: np.ndarray, counters, executor: Executor, client: int) -> None:
        self.state = state  # touched only on the loop thread
        self.pages = pages  # uint8 [num_pages, page_size]: this process's mapping of the arena
        self.counters = counters
        self.executor = executor
        self.client = client  # the connection id that owns the promotions' write leases

    async def install(self, namespace: bytes, found: list[tuple[codec.Header, memoryview]]) -> bool:
        """RESERVE pages for the verified chunks (a contiguous run, in prefix order), copy them in off the loop,
        COMMIT; False if L1 had no room. Chunks already in L1 (or being written there by a replica) are skipped by
        RESERVE. When it returns, no thread reads the payloads any more (the caller may reuse their buffers)."""
        loop = asyncio.get_running_loop()
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
            self.counters.add(l2_promotions=len(chosen), l2_promoted_bytes=sum(len(p) for _, p, _ in chosen))
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
