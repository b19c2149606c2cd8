"""QueueWorker: one daemon thread that handles submitted items in submission order, and a flush that waits for
everything submitted before it. The committer and the CPU storer are each one."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


class QueueWorker(Generic[T]):
    """`handle(item)` runs on the worker's thread, one item at a time, in the order submitted; it must not raise (its
    owner records failures). `on_start()` runs once on the thread before the first item."""

    def __init__(self, name: str, handle: Callable[[T], None], on_start: Callable[[], None] = lambda: None):
        self._handle, self._on_start = handle, on_start
        self._queue: queue.Queue[T | _Flush] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> None:
        self._queue.put(item)

    def flush(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until every item submitted before this call has been handled."""
        marker = _Flush()
        self._queue.put(marker)
        marker.done.wait(timeout)

    def _loop(self) -> None:
        self._on_start()
        while True:
            item = self._queue.get()
            if isinstance(item, _Flush):
                item.done.set()
            else:
                self._handle(item)
