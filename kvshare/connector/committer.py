"""The committer thread: COMMITs each store once its copies are done (I2), so the engine never waits for it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.connector.core import ConnectorCore

log = logging.getLogger("kvshare.connector")


class Committer:
    """Background thread that commits stores once their copies complete, so the engine never waits for COMMIT."""

    def __init__(self, core: ConnectorCore):
        self._core = core
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvshare-committer", daemon=True)
        self._thread.start()

    def submit(self, lease, refs, handle, started) -> None:
        self._queue.put((lease, refs, handle, started))

    def flush(self, timeout: float) -> None:
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            lease, refs, handle, started = item
            core = self._core
            try:
                handle.wait()  # the bytes are in the pages only after this (I2, I4)
                checksums = handle.checksums()
            except Exception as error:  # noqa: BLE001 - an unfinished store is dropped; its lease times out
                core.stats.errors += 1
                log.warning("pool store copy failed (%s); dropping it", error)
                continue
            if core._link.call("commit", lambda c: c.commit(lease, checksums) or True):
                core.stats.stores += len(refs)
                core.stats.store_bytes += sum(ref.nbytes for ref in refs)
                core.stats.store_seconds += time.perf_counter() - started
