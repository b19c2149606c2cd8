"""Topology: which Redis node holds a key. Standalone: the one node. Cluster: the masters' slot ranges, read with
CLUSTER SLOTS from the first configured node that answers, and the key's slot (CRC16 of its hash tag, the cluster's
own rule; L2 keys carry the chunk key as hash tag, see codec.py).

Discovery does blocking I/O: call it from a worker thread, never from the pool's event loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from redis.crc import key_slot

from kvshare.pool.l2.resp import RespConnection, RespError, command

SLOTS = 16384
Node = tuple[str, int]


@dataclass(frozen=True)
class Topology:
    nodes: list[Node]  # every master, in a fixed order
    starts: list[int]  # sorted first slots of the ranges (cluster only)
    ends: list[int]  # last slot of the range starting at starts[i]
    owners: list[int]  # index into nodes of the master serving that range

    def node_of(self, name: bytes) -> int | None:
        """Index of the node that holds key `name`; None if no master serves its slot."""
        if not self.starts:
            return 0
        slot = key_slot(name)
        i = bisect.bisect_right(self.starts, slot) - 1
        return self.owners[i] if i >= 0 and slot <= self.ends[i] else None


def standalone(node: Node) -> Topology:
    return Topology([node], [], [], [])


def discover_cluster(seeds: list[Node], timeout: float) -> Topology:
    """The slot map as the first answering seed sees it. Raises OSError/RespError if no seed answers."""
    last: Exception | None = None
    for host, port in seeds:
        try:
            connection = RespConnection(host, port, timeout)
        except OSError as error:
            last = error
            continue
        try:
            connection.send(command("CLUSTER", "SLOTS"))
            reply = connection.read_reply()
        except (OSError, RespError) as error:
            last = error
            continue
        finally:
            connection.close()
        return _from_slots(reply, host)
    raise last if last is not None else OSError("no L2 node configured")


def _from_slots(reply: list, seed_host: str) -> Topology:
    """CLUSTER SLOTS: [[start, end, [host, port, id, ...], replica...], ...] -> Topology (masters only). A master that
    reports an empty host is reached at the seed's host (Redis does that for the node answering)."""
    nodes: list[Node] = []
    ranges = []
    for start, end, master, *_replicas in reply:
        host = master[0].decode() or seed_host
        node = (host, int(master[1]))
        if node not in nodes:
            nodes.append(node)
        ranges.append((int(start), int(end), nodes.index(node)))
    ranges.sort()
    return Topology(nodes, [r[0] for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges])
