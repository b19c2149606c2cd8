"""Write-behind: committed chunks go to a bounded queue that one worker thread drains into L2 in pipelined batches.

The asyncio loop only enqueues (put_nowait, never blocking); all Redis I/O happens on the worker thread, so a slow
or dead L2 can never delay a replica. A full queue drops the chunk's write-behind and counts it.

Page lifetime: each queued job holds an internal read lease on its chunk (taken by the loop before enqueueing), so
its pages cannot be evicted or reused (I3) while they wait in the queue or while the worker copies them. The worker
hands the lease back (through `unpin`, which hops to the loop thread) as soon as the copy is taken, before the
Redis call: L2 latency never extends how long arena pages stay pinned beyond the copy.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvshare import checksum as chunk_checksum
from kvshare.pool.l2 import codec
from kvshare.pool.l2.store import L2Unavailable, RedisStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    namespace: bytes
    key: bytes
    parent: bytes
    tokens: bytes
    nbytes: int
    checksum: int  # the writer's kvshare.checksum from COMMIT (0: not computed by the client)
    pages: list[int]
    lease: int  # internal read lease pinning `pages` until the copy is taken


class WriteBehind:
    def __init__(self, store: RedisStore, pages: np.ndarray, counters, unpin: Callable[[list[int]], None],
                 capacity: int, batch_bytes: int) -> None:
        self.store = store
        self.pages = pages  # uint8 [num_pages, page_size]: this process's mapping of the arena
        self.counters = counters
        self.unpin = unpin  # thread-safe: ends the given internal leases on the loop thread
        self.batch_bytes = batch_bytes
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=capacity)
        self.thread = threading.Thread(target=self._run, name="l2-write-behind", daemon=True)
        self.thread.start()

    def offer(self, job: Job) -> bool:
        """Enqueue without blocking; False if the queue is full (the caller unpins and counts the drop)."""
        try:
            self.queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def stop(self) -> None:
        try:
            self.queue.put(None, timeout=1.0)  # wakes the worker; daemon thread, so a stuck one cannot block exit
        except queue.Full:
            pass

    def _run(self) -> None:
        while True:
            batch, stopping = self._next_batch()
            if batch:
                try:
                    self._store(self._copy(batch))
                except Exception:  # the worker must survive anything: a lost write-behind only costs a miss
                    log.exception("L2 write-behind of %d chunk(s) failed", len(batch))
                    self.counters.add(l2_errors=1, l2_write_drops=len(batch))
            if stopping:
                return

    def _next_batch(self) -> tuple[list[Job], bool]:
        """Block for one job, then take whatever else is queued up to batch_bytes. (jobs, stop requested)."""
        job = self.queue.get()
        if job is None:
            return [], True
        batch, nbytes = [job], job.nbytes
        while nbytes < self.batch_bytes:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return batch, True
            batch.append(job)
            nbytes += job.nbytes
        return batch, False

    def _copy(self, batch: list[Job]) -> list[tuple[str, bytes]]:
        """Each job's L2 key and value (header + bytes copied out of the arena); then unpin every job's pages."""
        try:
            items = []
            for job in batch:
                value = self._value(job)
                if value is None:
                    self.counters.add(l2_write_drops=1)
                else:
                    items.append((codec.redis_key(job.namespace, job.key), value))
            return items
        finally:
            self.unpin([job.lease for job in batch])  # the copy is taken: the pages may be evicted or reused now

    def _value(self, job: Job) -> bytes | None:
        page_size = self.pages.shape[1]
        views = [self.pages[page, : min(page_size, job.nbytes - i * page_size)] for i, page in enumerate(job.pages)]
        checksum = chunk_checksum.parts_checksum(views, job.nbytes)  # the replicas' function, over the whole extent
        if job.checksum and checksum != job.checksum:
            log.warning("chunk %s: arena bytes do not match the writer's checksum; not written to L2", job.key.hex())
            return None
        header = codec.Header(codec.VERSION, job.namespace, job.key, job.parent, job.tokens, job.nbytes, checksum)
        return codec.encode_parts(header, views)  # the one copy out of the arena

    def _store(self, items: list[tuple[str, bytes]]) -> None:
        start = 0
        while start < len(items):  # values can be large: one pipeline per batch_bytes
            end, nbytes = start, 0
            while end < len(items) and (end == start or nbytes + len(items[end][1]) <= self.batch_bytes):
                nbytes += len(items[end][1])
                end += 1
            try:
                self.store.set_many(items[start:end])
                self.counters.add(l2_writes=end - start)
            except L2Unavailable as error:
                self.counters.add(l2_errors=int(error.attempted), l2_write_drops=end - start)
                if error.attempted:
                    log.warning("%s", error)
            start = end
