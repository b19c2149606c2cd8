"""One pool life as this process maps it: the transfer over its arena, the copies using it, and its end.

A pool that dies or restarts leaves this process holding a mapping of its arena (the file is gone, the memory is
not: an unlinked /dev/shm file's pages live as long as a mapping of them) and, on a GPU, a DMA registration of that
mapping. Both must go, in order, once nothing copies through them:

1. retire: the connection to that life ended (a newer one replaced it, or it failed). No new copy may start.
2. the last copy that started before ends (`release`).
3. close: the transfer unregisters the arena's pieces (cudaHostUnregister) while the mapping still exists, then
   every reference to the mapping is dropped so it is unmapped.

Why the order matters: unmapping a registered range leaves the driver's registration pointing at the old physical
pages, which stay pinned (a second 100 GiB arena then fails for memory); and a new mapping placed at the same
address would be taken as registered, so a DMA would read or write the old life's pages instead of the new one's.
Unregistering while a copy runs would fault that copy. Hence: unregister after the last user, before the unmap.

Invariants:
- `acquire` succeeds only before `retire`; every successful `acquire` is matched by one `release`.
- `close` runs exactly once, after `retire`, when no acquired use is open, on the thread that made that true.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.pool.client import PoolClient
    from kvshare.transfer import Transfer

log = logging.getLogger("kvshare.connector")


class ArenaLife:
    """A pool life (`instance`), and the transfer over its arena when this half has KV tensors."""

    def __init__(self, instance: str = "", transfer: "Transfer | None" = None, client: "PoolClient | None" = None):
        self.instance = instance  # "" before the first connection
        self.transfer = transfer
        self._client = client  # owns the mapping; kept until close so the mapping outlives every copy through it
        self._lock = threading.Lock()
        self._users = 0
        self._retired = self.closed = False

    def acquire(self) -> bool:
        """Start a use of the arena (a load, or a store until its copies are over); False once retired."""
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        """End a use begun by a successful `acquire`; the last one after `retire` closes the life."""
        with self._lock:
            self._users -= 1
            last = self._retired and self._users == 0
        if last:
            self._close()

    def retire(self) -> None:
        """No new use may start; the life closes now if none is open, else when the last one ends. Idempotent."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            idle = self._users == 0
        if idle:
            self._close()

    def _close(self) -> None:
        transfer, client = self.transfer, self._client
        self.transfer = self._client = None
        try:
            if transfer is not None:
                transfer.close()  # unregister while the mapping is still there
        except Exception:  # noqa: BLE001 - a failed unregistration must not stop the unmap or the replica
            log.exception("unregistering the arena of pool life %s failed", self.instance)
        finally:
            if client is not None:
                client.close()
            self.closed = True
