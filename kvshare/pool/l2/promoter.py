"""Promoter: the original ("redis-py") promotion path, kept beside the striped one (striped.py) so that one benchmark
run can compare them (`kvshare bench l2`, `--l2-fetch redis-py`).

The chunks that follow an L1 prefix are fetched from L2 through redis-py (one pipelined GET per batch), verified, and
installed into L1. Runs as an asyncio task with its blocking parts on a thread pool, so the loop keeps serving other
connections. Order per batch: GET + verify (thread) -> RESERVE (loop) -> copy (thread) -> COMMIT (loop), see
install.py. Chunks are taken strictly in prefix order, stopping at the first miss or rejected value, because a
LOOKUP can only use a contiguous prefix.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from kvshare.pool.l2 import codec
from kvshare.pool.l2.install import Installer
from kvshare.pool.l2.store import L2Unavailable, RedisStore

log = logging.getLogger(__name__)


class Promoter:
    def __init__(self, store: RedisStore, installer: Installer, counters, executor: Executor,
                 batch_bytes: int) -> None:
        self.store = store
        self.installer = installer
        self.counters = counters
        self.executor = executor
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
            if found and not await self.installer.install(namespace, found):
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
