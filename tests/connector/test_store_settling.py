"""A store's handle is done once the copies out of the engine's blocks are over, and settled only once the store is
also committed and counted in the connector's stats. vLLM's worker reports a request's stores over when settled and
hands vLLM its stats in the same step; a replica that goes idle after that step must already have reported them."""

from __future__ import annotations

import threading
import time

from kvshare.connector import ConnectorConfig
from kvshare.engine.pool_connector import PoolConnector
from kvshare.pool.testing import start_pool

CHUNK = 32


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


def test_a_store_is_settled_only_once_committed_and_counted(engines, monkeypatch):
    _, engine, _ = engines
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        connector = PoolConnector.for_engine(engine, ConnectorConfig(address=address, chunk_tokens=CHUNK))
        engine.set_connector(connector)
        core = connector.core
        gate = threading.Event()  # COMMIT waits here: the copies are over long before
        commit = core._committer._commit
        monkeypatch.setattr(core._committer, "_commit", lambda lease, sums: gate.wait(30) and commit(lease, sums))

        tokens = [(i * 104729) % 1000 + 3 for i in range(2 * CHUNK)]  # two full chunks from blocks 0-3
        handle = core.store(tokens, list(range(len(tokens) // engine.block_size)), 0)
        assert handle is not None
        wait_for(handle.done, "the store's copies done")
        assert not handle.settled() and core.stats.stores == 0  # done, not committed: not yet settled

        gate.set()
        wait_for(handle.settled, "the store settled")
        assert core.stats.stores == 2  # counted before settled: read at once, no waiting for the committer
