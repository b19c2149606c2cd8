"""The storer thread: runs a CPU replica's stores (RESERVE, the copies out of the engine's blocks, the hand-over to
the committer) after the call that asked for them has returned, so the request that stores never waits for them.

On a CPU the copies are synchronous work on the calling thread (kvshare.transfer.cpu); in vLLM that thread is the
worker's, between the forward and the sampling of the token the client waits for. A GPU replica's copies are already
asynchronous (side streams ordered by events recorded on the caller's stream), so its stores stay on the caller.

Invariants:
- A task's StoreHandle is done only once its copies have finished or it gave up (I4): the engine keeps the blocks
  until then. The blocks hold KV the engine has computed and never writes again (whole blocks of computed tokens;
  a decode step writes the block after them), so reading them later reads the same bytes.
- It is settled once the store it ran is settled too (committed and counted, or dropped), never before it is done.
- Tasks run one at a time in submission order, so a request's chunks are reserved parent before child.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from kvshare.connector.contract import StoreHandle
from kvshare.connector.failures import Failures
from kvshare.connector.queue_worker import QueueWorker
from kvshare.transfer.checksum import run_on_every_cpu


@dataclass
class StoreTask:
    token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_stored: int
    salt: str
    tail: bool
    states: Mapping[int, Any] | None = None  # a hybrid model's packed states by chunk boundary (never changed)
    finished: threading.Event = field(default_factory=threading.Event)
    ran: StoreHandle | None = None  # the store the task ran (None: nothing to store, or it failed); set before finished

    def settled(self) -> bool:
        return self.finished.is_set() and (self.ran is None or self.ran.settled())


class Storer:
    """`run(task)` is the core's synchronous store, returning its handle; it must not raise (failures are the core's
    to record)."""

    def __init__(self, run: Callable[[StoreTask], StoreHandle | None], failures: Failures):
        self._run, self._failures = run, failures
        # run_on_every_cpu: its copies run beside the model's next steps, not in turns with them
        self._worker: QueueWorker[StoreTask] = QueueWorker("kvshare-storer", self._store, on_start=run_on_every_cpu)

    def submit(self, token_ids: Sequence[int], block_ids: Sequence[int], num_stored: int, salt: str,
               tail: bool, states: Mapping[int, Any] | None = None) -> StoreHandle:
        """Queue a store; the handle names every block it may read (the engine holds them until it is done)."""
        task = StoreTask(list(token_ids), list(block_ids), num_stored, salt, tail, dict(states or {}))
        self._worker.submit(task)
        return StoreHandle(is_done=task.finished.is_set, block_ids=tuple(task.block_ids), is_settled=task.settled)

    def flush(self, timeout: float) -> None:
        """Wait until every task submitted so far has run."""
        self._worker.flush(timeout)

    def _store(self, task: StoreTask) -> None:
        try:
            task.ran = self._run(task)
        except Exception as error:  # noqa: BLE001 - a store that fails is a future miss
            self._failures.record("store", error, "continuing without it")
        finally:
            task.finished.set()  # after the copies (CPU transfers return once they are done)
