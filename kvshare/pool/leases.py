"""Leases: who holds which chunks, for how long. A read lease pins committed chunks; a write lease owns reserved ones.

Invariants: a lease belongs to one client connection and ends exactly once: by RELEASE (or COMMIT for a write lease),
by its deadline passing, or by its connection closing (I8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

READ, WRITE = "read", "write"


@dataclass
class Lease:
    id: int
    kind: str  # READ | WRITE
    client: int
    keys: list[bytes]
    deadline: float
    pages: int = 0  # pages it pins: counted against its client's lease limit


class LeaseTable:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._leases: dict[int, Lease] = {}
        self._pages: dict[int, int] = {}  # client -> pages its leases pin (kept by new/pop: read on every LOOKUP)
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):
        return iter(list(self._leases.values()))

    def new(self, kind: str, client: int, keys: list[bytes], now: float, pages: int) -> Lease:
        lease = Lease(self._next_id, kind, client, keys, now + self.timeout, pages)
        self._next_id += 1
        self._leases[lease.id] = lease
        self._pages[client] = self._pages.get(client, 0) + pages
        return lease

    def keep(self, lease: Lease) -> None:
        """Take away the lease's deadline: it ends only by RELEASE or COMMIT. For the pool's internal leases whose
        pages another thread is copying (an L2 write-behind's source, an L2 promotion's destination)."""
        lease.deadline = math.inf

    def get(self, lease_id: int, client: int) -> Lease | None:
        """The lease, if it exists and belongs to `client` (a client cannot end another's lease)."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.client == client else None

    def pop(self, lease_id: int) -> Lease:
        lease = self._leases.pop(lease_id)
        left = self._pages[lease.client] - lease.pages
        if left:
            self._pages[lease.client] = left
        else:
            del self._pages[lease.client]
        return lease

    def expired(self, now: float) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.deadline <= now]

    def of_client(self, client: int) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.client == client]

    def pages_of(self, client: int) -> int:
        """Pages the client's leases pin now (a chunk under two of its leases counts twice)."""
        return self._pages.get(client, 0)

    def pages_by_client(self) -> dict[int, int]:
        return {client: pages for client, pages in self._pages.items() if pages}

    def count(self, kind: str) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind == kind)
