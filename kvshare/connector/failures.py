"""The connector's one error policy: every failure is counted (ConnectorStats.errors) and costs only recompute (I7);
the first failure of each kind is logged with its traceback, later ones of that kind at debug level (a pool that is
down fails every request the same way: one warning says so, the counter says how often)."""

from __future__ import annotations

import logging
import threading

from kvshare.connector.contract import ConnectorStats

log = logging.getLogger("kvshare.connector")


class Failures:
    def __init__(self, stats: ConnectorStats) -> None:
        self._stats = stats
        self._seen: set[str] = set()
        self._lock = threading.Lock()  # the engine, committer and hashing threads all record

    def record(self, what: str, error: BaseException, consequence: str = "recomputing") -> None:
        """Count `error` (from doing `what`) and log it: the first of its kind with its traceback."""
        key = f"{what}:{type(error).__name__}"
        with self._lock:
            self._stats.errors += 1
            first = key not in self._seen
            self._seen.add(key)
        if first:
            log.warning("pool %s failed (%s: %s); %s. Later failures of this kind are counted "
                        "(kvshare_pool_errors_total) and logged at debug level", what, type(error).__name__, error,
                        consequence, exc_info=error)
        else:
            log.debug("pool %s failed again (%s: %s)", what, type(error).__name__, error)

    def note(self, key: str, level: int, message: str) -> None:
        """A state change worth one line (connected, down): logged the first time only."""
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        log.log(level, message)
