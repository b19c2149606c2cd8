"""One connection to the pool, reopened after failures; every pool error becomes None and a counted miss (I7)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvshare.connector.config import ConnectorConfig
from kvshare.connector.contract import ConnectorStats
from kvshare.keys import Namespace

log = logging.getLogger("kvshare.connector")


class PoolLink:
    """One connection to the pool, reopened after failures; turns every pool error into None and a counted miss.

    The lock serialises (re)connection only; the client itself is thread-safe per request.
    """

    def __init__(self, config: ConnectorConfig, stats: ConnectorStats, on_connect: Callable[[object], None]):
        self._config, self._stats, self._on_connect = config, stats, on_connect
        self._client = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._hello_sent: set[bytes] = set()

    def client(self):
        """The connected client, or None while the pool is down (then it is retried after retry_interval)."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                return None
            from kvshare.pool.client import PoolClient

            try:
                client = PoolClient.connect(self._config.address, timeout=self._config.timeout)
                self._on_connect(client)
            except Exception as error:  # noqa: BLE001 - any failure to connect or attach is a miss
                self._mark_down(error)
                return None
            self._client, self._hello_sent = client, set()
            self._log_once("connected", logging.INFO, f"connected to pool {self._config.address}")
            return client

    def call(self, what: str, fn: Callable, namespace: Namespace | None = None):
        """fn(client) -> result, or None if the pool is down or answered an error (counted, logged once)."""
        client = self.client()
        if client is None:
            return None
        from kvshare.pool.client import PoolError, PoolUnavailable

        try:
            if namespace is not None and namespace.key not in self._hello_sent:
                client.hello(namespace.key, namespace.describe())
                self._hello_sent.add(namespace.key)
            return fn(client)
        except PoolUnavailable as error:
            with self._lock:
                if self._client is client:
                    self._client = None
                    self._mark_down(error)
            return None
        except (PoolError, OSError, ValueError) as error:
            self._stats.errors += 1
            self._log_once(f"{what}:{type(error).__name__}", logging.WARNING, f"pool {what} failed ({error}); recomputing")
            return None

    def _mark_down(self, error: Exception) -> None:
        self._stats.errors += 1
        self._down_until = time.monotonic() + self._config.retry_interval
        self._log_once("down", logging.WARNING, f"pool {self._config.address} unavailable ({error}); serving without the shared cache until it returns")

    def _log_once(self, key: str, level: int, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, message)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
