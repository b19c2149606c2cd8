"""The chunk index: key -> pages, size, checksum and the data that verifies a hit; committed chunks in LRU order.

Invariants: a key is in at most one of `committed` and `reserved`; only committed chunks are visible to LOOKUP (I2);
`committed` is ordered least recently used first; an entry's `readers` counts the read leases that hold it.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from kvshare.pool.protocol import CHUNK_RECORD


@dataclass(eq=False)  # entries are records of one chunk each: equal only to themselves (and compared fast)
class Entry:
    key: bytes
    namespace: bytes
    parent: bytes
    tokens: bytes
    nbytes: int
    pages: list[int]
    checksum: int = 0
    lease: int = 0  # the write lease while reserved; 0 once committed
    readers: int = 0  # read leases holding this chunk: never evicted while > 0 (I3)
    # The chunk as a LOOKUP reply carries it, packed once here so a 1,024-chunk hit is two bytes joins:
    page_bytes: bytes = b""  # pages as little-endian uint32 (set by add_reserved; pages never change)
    record: bytes = b""  # CHUNK_RECORD (set by commit, when the checksum is known)


@dataclass
class ChunkIndex:
    committed: OrderedDict[bytes, Entry] = field(default_factory=OrderedDict)
    reserved: dict[bytes, Entry] = field(default_factory=dict)
    bytes_stored: int = 0
    pages_committed: int = 0
    pages_reserved: int = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.committed or key in self.reserved

    def add_reserved(self, entry: Entry) -> None:
        entry.page_bytes = struct.pack(f"<{len(entry.pages)}I", *entry.pages)
        self.reserved[entry.key] = entry
        self.pages_reserved += len(entry.pages)

    def drop_reserved(self, key: bytes) -> Entry:
        entry = self.reserved.pop(key)
        self.pages_reserved -= len(entry.pages)
        return entry

    def commit(self, key: bytes, checksum: int) -> Entry:
        """Publish a reserved chunk as the most recently used."""
        entry = self.drop_reserved(key)
        entry.checksum, entry.lease = checksum, 0
        entry.record = CHUNK_RECORD.pack(entry.nbytes, checksum, len(entry.pages))
        self.committed[key] = entry
        self.pages_committed += len(entry.pages)
        self.bytes_stored += entry.nbytes
        return entry

    def remove(self, key: bytes) -> Entry:
        entry = self.committed.pop(key)
        assert entry.readers == 0, "removing a chunk under a read lease"
        self.pages_committed -= len(entry.pages)
        self.bytes_stored -= entry.nbytes
        return entry
