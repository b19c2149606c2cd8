"""RedisStore: the pool's connection to L2 (redis.Redis, or redis.cluster.RedisCluster when several nodes are given),
with a timeout on every call, no client-side retries, and a circuit breaker in front.

Thread-safe: redis-py clients keep a connection pool; a pipeline is created per call. The client is built lazily,
on first use, so a pool can start while L2 is still down.
"""

from __future__ import annotations

import logging
import threading

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvshare.pool.l2.breaker import Breaker
from kvshare.pool.l2.config import L2Config

log = logging.getLogger(__name__)


class L2Unavailable(Exception):
    """A Redis call failed or was not attempted. `attempted` is False when the open breaker skipped it."""

    def __init__(self, message: str, attempted: bool = True) -> None:
        super().__init__(message)
        self.attempted = attempted


class RedisStore:
    def __init__(self, config: L2Config) -> None:
        self.config = config
        self.breaker = Breaker(config.failures, config.retry_after)
        self._client: redis.Redis | RedisCluster | None = None
        self._lock = threading.Lock()  # guards building _client once; never held during a Redis call

    def set_many(self, items: list[tuple[str, bytes]]) -> None:
        """SET every (name, value) in one pipeline, with the configured TTL."""
        px = int(self.config.ttl * 1000) or None

        def run(client):
            pipe = client.pipeline(transaction=False)
            for name, value in items:
                pipe.set(name, value, px=px)
            pipe.execute()

        self._call(run, f"SET of {len(items)} chunk(s)")

    def get_many(self, names: list[str]) -> list[bytes | None]:
        def run(client):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()

        return self._call(run, f"GET of {len(names)} chunk(s)")

    def delete_many(self, names: list[str]) -> None:
        """DEL every name (one pipeline; in a cluster one DEL per key, so no command spans slots)."""

        def run(client):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute()

        self._call(run, f"DEL of {len(names)} chunk(s)")

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _call(self, run, what: str):
        if not self.breaker.allow():
            raise L2Unavailable(f"L2 {self.config.url} skipped: circuit open after repeated failures", attempted=False)
        try:
            result = run(self._connected())
        except (redis.RedisError, OSError) as error:
            self.breaker.failed()
            if self.breaker.state == "open":
                self._drop_client()  # rebuild on the trial call: a cluster may have changed its topology
            raise L2Unavailable(f"L2 {self.config.url}: {what} failed: {error!r}") from None
        self.breaker.succeeded()
        return result

    def _connected(self):
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def _drop_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (redis.RedisError, OSError):
                pass

    def _build(self):
        c = self.config
        common = dict(socket_timeout=c.timeout, socket_connect_timeout=c.timeout, retry=Retry(NoBackoff(), 0))
        if not c.cluster:
            host, port = c.nodes[0]
            return redis.Redis(host=host, port=port, **common)
        # RedisCluster reads the slot map from the first node that answers; it raises if none does (-> breaker).
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in c.nodes], require_full_coverage=False,
                            **common)
