"""The replicas behind the router: their health, in-flight counts, and the loop that probes `/health`.

All state here is read and written only from the router's single asyncio event loop, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One upstream server. `index` is its position in the configured list (policies use it as a stable order)."""

    index: int
    url: str
    healthy: bool = True  # optimistic until the first probe; a failed request or probe takes it out of rotation
    in_flight: int = 0  # requests dispatched and not yet finished streaming
    last_error: str = ""
    last_checked: float = 0.0

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("replica %s out of rotation: %s", self.url, reason)
        self.healthy = False
        self.last_error = reason

    def mark_up(self) -> None:
        if not self.healthy:
            log.info("replica %s back in rotation", self.url)
        self.healthy = True


class ReplicaSet:
    def __init__(self, urls: tuple[str, ...]) -> None:
        self.replicas = [Replica(i, url.rstrip("/")) for i, url in enumerate(urls)]

    def healthy(self, exclude: frozenset[int] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.index not in exclude]

    async def probe_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self._probe(client, r, timeout_s) for r in self.replicas))

    async def health_loop(self, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        """Probe every replica (unhealthy ones too: that is how they come back) every `interval_s`, forever."""
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_all(client, timeout_s)

    @staticmethod
    async def _probe(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
        replica.last_checked = time.time()
        try:
            response = await client.get(f"{replica.url}/health", timeout=timeout_s)
        except httpx.HTTPError as error:
            replica.mark_down(f"health check failed: {type(error).__name__}: {error}")
            return
        if response.status_code == 200:
            replica.mark_up()
        else:
            replica.mark_down(f"health check answered HTTP {response.status_code}")
