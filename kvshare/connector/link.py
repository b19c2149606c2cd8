"""One connection to the pool, reopened after failures; every pool error becomes None and a counted miss (I7)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from kvshare.connector.config import ConnectorConfig
from kvshare.connector.failures import Failures
from kvshare.keys import Namespace
from kvshare.pool.client import PoolClient, PoolError, PoolUnavailable

T = TypeVar("T")


class PoolLink:
    """One connection to the pool, reopened after failures; turns every pool error into None and a counted miss.

    Only pool failures (PoolError, including PoolUnavailable, and OSError) are turned into misses here; any other
    exception is a bug and propagates to the connector's public method, which records it (failures.py) with its
    traceback. The lock serialises (re)connection only; the client itself is thread-safe per request.
    """

    def __init__(self, config: ConnectorConfig, failures: Failures, on_connect: Callable[[PoolClient], None],
                 on_disconnect: Callable[[PoolClient], None] = lambda client: client.close()):
        """on_connect(client) runs under the lock for each new connection before it is used; on_disconnect(client)
        once that connection has failed or is closed, under the lock, and must close the client (the owner of the
        arena mapping) once nothing copies through it (kvshare.connector.arena_life)."""
        self._config, self._failures = config, failures
        self._on_connect, self._on_disconnect = on_connect, on_disconnect
        self._client: PoolClient | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._hello_sent: set[bytes] = set()

    def client(self) -> PoolClient | None:
        """The connected client, or None while the pool is down (then it is retried after retry_interval)."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                return None
            try:
                client = PoolClient.connect(self._config.address, timeout=self._config.timeout)
            except (PoolError, OSError) as error:
                self._mark_down(error)
                return None
            try:
                self._on_connect(client)
            except (PoolError, OSError) as error:
                client.close()
                self._mark_down(error)
                return None
            self._client, self._hello_sent = client, set()
            self._failures.note("connected", logging.INFO, f"connected to pool {self._config.address}")
            return client

    def call(self, what: str, fn: Callable[[PoolClient], T], namespace: Namespace | None = None) -> T | None:
        """fn(client), or None if the pool is down or answered an error (counted; the first of a kind logged)."""
        client = self.client()
        if client is None:
            return None
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
                    # At once, not at the next connection: the dead pool's arena stays in memory while mapped.
                    self._on_disconnect(client)
            return None
        except (PoolError, OSError) as error:
            self._failures.record(what, error)
            return None

    def _mark_down(self, error: Exception) -> None:
        self._down_until = time.monotonic() + self._config.retry_interval
        self._failures.record("connection", error, f"serving without the shared cache; retrying in "
                              f"{self._config.retry_interval:g} s")

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._on_disconnect(self._client)
                self._client = None
