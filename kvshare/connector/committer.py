"""The committer thread: COMMITs each store once its copies are done (I2), so the engine never waits for it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvshare.connector.contract import ConnectorStats
from kvshare.connector.failures import Failures
from kvshare.connector.queue_worker import QueueWorker
from kvshare.pool.client import ChunkRef
from kvshare.transfer import TransferHandle


@dataclass(frozen=True)
class PendingStore:
    """A store whose copies are in flight: COMMIT its lease once `handle` is done, with the checksums of the bytes it
    wrote."""

    lease: int
    refs: list[ChunkRef]
    handle: TransferHandle
    started: float  # perf_counter() when the store began
    on_copied: Callable[[], None] = lambda: None  # once the copies and their checksums are over (or failed)
    settled: threading.Event = field(default_factory=threading.Event)  # set once committed and counted, or dropped


class Committer:
    """Background thread that commits stores once their copies complete, so the engine never waits for COMMIT.

    `commit(lease, checksums)` is the core's (it returns False when the pool refused or was unreachable); a store
    whose copy failed is dropped: its lease is fenced by the pool and its pages freed once this process moves on."""

    def __init__(self, commit: Callable[[int, list[int]], bool], stats: ConnectorStats, failures: Failures):
        self._commit, self._stats, self._failures = commit, stats, failures
        self._worker: QueueWorker[PendingStore] = QueueWorker("kvshare-committer", self._finish)

    def submit(self, store: PendingStore) -> None:
        self._worker.submit(store)

    def flush(self, timeout: float) -> None:
        self._worker.flush(timeout)

    def _finish(self, item: PendingStore) -> None:
        try:
            self._settle(item)
        finally:
            item.settled.set()  # after the counters: whoever reports the store over reports them with it

    def _settle(self, item: PendingStore) -> None:
        try:
            item.handle.wait()  # the bytes are in the pages only after this (I2, I4)
            checksums = item.handle.checksums()
        except Exception as error:  # noqa: BLE001 - an unfinished store is dropped, never committed
            self._failures.record("store copy", error, "dropping that store")
            return
        finally:
            item.on_copied()  # nothing reads or writes the arena for this store any more
        if self._commit(item.lease, checksums):
            self._stats.stores += len(item.refs)
            self._stats.store_bytes += sum(ref.nbytes for ref in item.refs)
            self._stats.store_seconds += time.perf_counter() - item.started
