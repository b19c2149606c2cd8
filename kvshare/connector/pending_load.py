"""A pool load whose copies may still be running: the engine computes on the layers that have landed and settles the
load once its forward is over (ConnectorCore.start_load)."""

from __future__ import annotations

from typing import Callable

from kvshare.connector.failures import Failures
from kvshare.transfer import TransferHandle


class PendingLoad:
    """Invariants: finish() settles the load exactly once (later calls return the first answer) and only after the
    copies are over: it verifies the bytes where asked, releases the arena and the read lease, and says whether the
    loaded blocks count as computed. A reader of layer l's loaded blocks calls wait_layer(l) first. Neither raises:
    a failure of either makes finish() return False, and the engine recomputes what it read (I7)."""

    def __init__(self, handle: TransferHandle | None, settle: Callable[[TransferHandle | None, bool], bool],
                 failures: Failures):
        self._handle = handle  # None: nothing was started (finish() says False)
        self._settle = settle  # (handle, usable) -> whether the load counts: waits, verifies, releases, counts
        self._failures = failures
        self._failed = False  # the blocks may have been read before their copies: the load cannot count
        self._result: bool | None = None

    def wait_layer(self, layer: int) -> None:
        """Order the caller's next reads of `layer`'s loaded blocks after their copies (kernels on the current
        stream on a GPU, the caller itself on a CPU)."""
        if self._handle is None or self._failed:
            return
        try:
            self._handle.wait_layer(layer)
        except Exception as error:  # noqa: BLE001 - a failed wait makes the load a miss, never a failed request
            self._failures.record("load", error)
            self._failed = True

    def discard(self) -> None:
        """The caller may have read some layer without waiting for it: finish() will say False (and count a failed
        load) whatever the copies did."""
        self._failed = True

    def finish(self) -> bool:
        """Wait for the copies, then settle: True if the loaded blocks hold the pool's bytes (verified where
        verification is on) and were read only after their waits; False otherwise, and the caller recomputes them."""
        if self._result is None:
            self._result = self._settle(self._handle, not self._failed)
        return self._result
