"""The chunk index: key -> pages, size, checksum and the data that verifies a hit; committed chunks in LRU order.

Invariants: a key is in at most one of `committed` and `reserved`; only committed chunks are visible to LOOKUP (I2);
`committed` is ordered least recently used first; an entry's `readers` counts the read leases that hold it.
A discarded chunk (it failed a reader's verification, I11) leaves `committed` at once, so LOOKUP no longer finds it
and a new RESERVE may store the key again; while read leases still hold it, it waits in `condemned` and keeps its
pages (I3), which are freed when its last reader ends.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
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
    condemned: bool = False  # discarded while readers held it: out of the index, pages freed with the last reader
    # The chunk as a LOOKUP reply carries it, packed once here so a 1,024-chunk hit is two bytes joins:
    page_bytes: bytes = b""  # pages as little-endian uint32 (set by add_reserved; pages never change)
    record: bytes = b""  # CHUNK_RECORD (set by commit, when the checksum is known)


@dataclass
class ChunkIndex:
    committed: OrderedDict[bytes, Entry] = field(default_factory=OrderedDict)
    reserved: dict[bytes, Entry] = field(default_factory=dict)
    condemned: set[Entry] = field(default_factory=set)  # discarded chunks still under read leases
    bytes_stored: int = 0
    pages_committed: int = 0
    pages_reserved: int = 0
    pages_condemned: int = 0
    chunks_of: Counter = field(default_factory=Counter)  # namespace -> its reserved and committed chunks

    def __contains__(self, key: bytes) -> bool:
        return key in self.committed or key in self.reserved

    def add_reserved(self, entry: Entry) -> None:
        entry.page_bytes = struct.pack(f"<{len(entry.pages)}I", *entry.pages)
        self.reserved[entry.key] = entry
        self.pages_reserved += len(entry.pages)
        self.chunks_of[entry.namespace] += 1

    def drop_reserved(self, key: bytes) -> Entry:
        entry = self.reserved.pop(key)
        self.pages_reserved -= len(entry.pages)
        self._uncount(entry.namespace)
        return entry

    def commit(self, key: bytes, checksum: int) -> Entry:
        """Publish a reserved chunk as the most recently used."""
        entry = self.drop_reserved(key)
        entry.checksum, entry.lease = checksum, 0
        entry.record = CHUNK_RECORD.pack(entry.nbytes, checksum, len(entry.pages))
        self.committed[key] = entry
        self.pages_committed += len(entry.pages)
        self.chunks_of[entry.namespace] += 1
        self.bytes_stored += entry.nbytes
        return entry

    def remove(self, key: bytes) -> Entry:
        entry = self._unpublish(key)
        assert entry.readers == 0, "removing a chunk under a read lease"
        return entry

    def condemn(self, key: bytes) -> Entry:
        """Take a committed chunk out of the index while read leases may still hold it (see the module docstring).
        Returns the entry; the caller frees its pages now if it has no readers, else when the last one ends."""
        entry = self._unpublish(key)
        if entry.readers:
            entry.condemned = True
            self.condemned.add(entry)
            self.pages_condemned += len(entry.pages)
        return entry

    def unreferenced(self, entry: Entry) -> bool:
        """Called when a read lease on `entry` ended: True if it was condemned and that was its last reader (the
        caller frees its pages)."""
        if not entry.condemned or entry.readers:
            return False
        self.condemned.discard(entry)
        self.pages_condemned -= len(entry.pages)
        return True

    def _unpublish(self, key: bytes) -> Entry:
        entry = self.committed.pop(key)
        self.pages_committed -= len(entry.pages)
        self.bytes_stored -= entry.nbytes
        self._uncount(entry.namespace)
        return entry

    def _uncount(self, namespace: bytes) -> None:
        left = self.chunks_of[namespace] - 1
        if left:
            self.chunks_of[namespace] = left
        else:
            del self.chunks_of[namespace]
