"""Leases: who holds which chunks, for how long. A read lease pins committed chunks; a write lease owns reserved ones.

A lease is live, then possibly fenced, then ended:
- live: its holder may COMMIT (write) or copy out (read) until its deadline.
- fenced: its deadline passed or its connection closed while the holder's process may still be copying. It has no
  rights left (a COMMIT is refused), but what it held is kept out of reach: a read lease keeps its chunks pinned, a
  write lease keeps its pages in quarantine (no chunk has them, nobody is given them). Fencing is what lets I3, I8
  and I10 hold together: a stalled writer resumed after its lease expired writes only pages nobody else was given.
- ended: by RELEASE or COMMIT from its holder (live or fenced: the holder sends them only once its copies are done),
  or, for a fenced lease, once its holder's process is known to have exited (server.py watches it) or, for a holder
  the pool cannot watch, one lease timeout after its connection closed.

Invariants: a lease belongs to one client connection and ends exactly once; a fenced lease never becomes live again;
the pages of a client's leases, live and fenced, count against that client's lease limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.pool.index import Entry

READ, WRITE = "read", "write"


@dataclass(eq=False)
class Lease:
    id: int
    kind: str  # READ | WRITE
    client: int
    entries: list["Entry"]  # read: the committed chunks it pins; write: the reserved chunks it owns (until fenced)
    deadline: float  # when a live lease is fenced; math.inf once fenced or kept
    pages: int = 0  # pages it pins or holds: counted against its client's lease limit
    fenced: bool = False
    quarantine: list[int] = field(default_factory=list)  # a fenced write lease's pages (in no chunk, not free)
    fence_until: float = math.inf  # a fenced lease whose holder cannot be watched ends at this time

    @property
    def keys(self) -> list[bytes]:
        return [entry.key for entry in self.entries]


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

    def new(self, kind: str, client: int, entries: list["Entry"], now: float, pages: int) -> Lease:
        lease = Lease(self._next_id, kind, client, entries, now + self.timeout, pages)
        self._next_id += 1
        self._leases[lease.id] = lease
        self._pages[client] = self._pages.get(client, 0) + pages
        return lease

    def keep(self, lease: Lease) -> None:
        """Take away the lease's deadline: it ends only by RELEASE or COMMIT. For the pool's internal leases whose
        pages another thread is copying (an L2 write-behind's source, an L2 promotion's destination)."""
        lease.deadline = math.inf

    def fence(self, lease: Lease, until: float = math.inf) -> None:
        """Make a live lease fenced (see the module docstring); `until` bounds it only for unwatchable holders."""
        lease.fenced, lease.deadline, lease.fence_until = True, math.inf, until

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: int) -> Lease:
        lease = self._leases.pop(lease_id)
        left = self._pages[lease.client] - lease.pages
        if left:
            self._pages[lease.client] = left
        else:
            del self._pages[lease.client]
        return lease

    def expired(self, now: float) -> list[Lease]:
        """Live leases past their deadline."""
        return [lease for lease in self._leases.values() if lease.deadline <= now]

    def fence_ended(self, now: float) -> list[Lease]:
        """Fenced leases of unwatchable holders whose grace has passed."""
        return [lease for lease in self._leases.values() if lease.fenced and lease.fence_until <= now]

    def of_client(self, client: int) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.client == client]

    def fenced_clients(self) -> set[int]:
        return {lease.client for lease in self._leases.values() if lease.fenced}

    def pages_of(self, client: int) -> int:
        """Pages the client's leases pin now, fenced ones included (a chunk under two of its leases counts twice)."""
        return self._pages.get(client, 0)

    def pages_by_client(self) -> dict[int, int]:
        return {client: pages for client, pages in self._pages.items() if pages}

    def count(self, kind: str) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind == kind)

    def fenced_count(self) -> tuple[int, int]:
        """(fenced leases, pages they hold)."""
        fenced = [lease for lease in self._leases.values() if lease.fenced]
        return len(fenced), sum(lease.pages for lease in fenced)
