"""The pool's request semantics without any I/O: HELLO, LOOKUP, RESERVE, COMMIT, RELEASE, CLEAR, lease expiry.

The server calls these from its single event-loop thread, so no method needs a lock; each either completes or
raises RequestError having changed nothing - except that a RESERVE refused for space may first have evicted
unleased chunks trying to make room. Unit tests drive this class directly, without sockets.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from itertools import accumulate
from operator import attrgetter

from kvshare.pool import eviction
from kvshare.pool.allocator import PageAllocator
from kvshare.pool.index import ChunkIndex, Entry
from kvshare.pool.leases import READ, WRITE, Lease, LeaseTable
from kvshare.pool.protocol import ChunkRef, ErrorCode, LookupReply, NewChunk, ReserveReply
from kvshare.pool.stats import PoolStats

KEY_BYTES = 16
_PARENT, _NAMESPACE, _TOKENS, _PAGES = attrgetter("parent"), attrgetter("namespace"), attrgetter("tokens"), attrgetter("pages")


class RequestError(Exception):
    """A request the pool refuses; becomes an Error reply with this code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class IntegrityError(AssertionError):
    """check_integrity() found the pool's bookkeeping inconsistent: a bug in the pool."""


class PoolState:
    def __init__(
        self, num_pages: int, page_size: int, *, prepared: int | None = None, lease_timeout: float = 30.0,
        high_watermark: float = 0.95, low_watermark: float = 0.90, clock=time.monotonic,
        max_leased_pages_per_client: int = 0,
    ) -> None:
        self.page_size = page_size
        self.lease_limit = max_leased_pages_per_client  # 0: none; see _within_lease_limit
        self.allocator = PageAllocator(num_pages, num_pages if prepared is None else prepared)
        self.index = ChunkIndex()
        self.leases = LeaseTable(lease_timeout)
        self.namespaces: dict[bytes, str] = {}
        self.high, self.low = high_watermark, low_watermark
        self.clock = clock
        self.counters = Counter()  # hit_chunks, miss_tokens, evictions, ... (names as in PoolStats)

    # ---- requests ----------------------------------------------------------------------------------------------

    def hello(self, namespace: bytes, description: str) -> None:
        _check_key(namespace, "namespace key")
        self.namespaces.setdefault(namespace, description)

    def lookup(self, client: int, namespace: bytes, keys: list[bytes], tokens: list[bytes]) -> LookupReply:
        """The longest prefix of `keys` whose committed chunks match namespace, parent and tokens, read-leased."""
        return self.lookup_joined(client, namespace, keys, memoryview(b"".join(tokens)), [len(t) for t in tokens])

    def lookup_joined(self, client: int, namespace: bytes, keys: list[bytes], blob: bytes | memoryview,
                      lengths: list[int]) -> LookupReply:
        """lookup() with the expected tokens as the wire carries them: concatenated in `blob`, `lengths` bytes each
        (a view into the receive buffer, not kept). Runs once per prompt with ~1,024 keys on the server's only
        thread, so the per-chunk work is kept to C-level maps and joins; one LOOKUP of 1,024 hits takes ~0.3 ms."""
        self._check_namespace(namespace)
        if len(keys) != len(lengths):
            raise RequestError(ErrorCode.BAD_REQUEST, f"LOOKUP has {len(keys)} keys but {len(lengths)} token lists")
        if sum(lengths) != len(blob) or min(lengths, default=0) < 0:
            raise RequestError(ErrorCode.BAD_REQUEST, f"LOOKUP token lengths add up to {sum(lengths)}, not to the "
                               f"{len(blob)} token bytes sent")
        hits, failed = self.verified_prefix(namespace, keys, blob, lengths)
        if failed:
            self.counters["verify_failures"] += 1
        hits, pages = self._within_lease_limit(client, hits)
        n = len(hits)
        hit_bytes = sum(lengths[:n])
        c = self.counters
        c["hit_chunks"] += n
        c["miss_chunks"] += len(keys) - n
        c["hit_tokens"] += hit_bytes // 4
        c["miss_tokens"] += (len(blob) - hit_bytes) // 4
        if not hits:
            return LookupReply(0)
        touch = self.index.committed.move_to_end
        for entry in reversed(hits):  # last chunk first: parents stay more recent than children (see eviction.py)
            entry.readers += 1
            touch(entry.key)
        lease = self.leases.new(READ, client, keys[:n], self.clock(), pages)
        return LookupReply(lease.id, b"".join([e.record for e in hits]), b"".join([e.page_bytes for e in hits]))

    def verified_prefix(self, namespace: bytes, keys: list[bytes], blob: bytes | memoryview,
                        lengths: list[int]) -> tuple[list[Entry], bool]:
        """The committed entries of the longest prefix of `keys` whose namespace, parent chain and tokens match, and
        whether a found key failed verification. No side effects (the L2 tier asks before it promotes).

        Each check runs over the whole prefix at once (map and list comparisons run in C: a Python loop over 1,024
        chunks costs ~0.3 ms) and chunk by chunk only to find where one fails. Tokens are compared as one joined
        memcmp; comparing the lengths too makes that exactly the per-chunk comparison. A found key whose parent,
        namespace or tokens differ is a verify failure: a hash collision or a caller bug is a miss, never wrong KV."""
        hits = list(map(self.index.committed.get, keys))  # committed only: a reserved chunk is invisible (I2)
        if None in hits:  # Entry compares by identity, so this is a C scan
            hits = hits[: hits.index(None)]
        n = len(hits)
        failed = False
        expected_parents = [namespace, *keys[: n - 1]] if n else []
        if list(map(_PARENT, hits)) != expected_parents or list(map(_NAMESPACE, hits)).count(namespace) != n:
            n = next(i for i, (e, p) in enumerate(zip(hits, expected_parents)) if e.parent != p or e.namespace != namespace)
            hits, failed = hits[:n], True
        # Equal lengths, then bytes.startswith(same-length view): a memcmp. (bytes == memoryview is ~100x slower.)
        stored = list(map(_TOKENS, hits))
        joined = b"".join(stored)
        if list(map(len, stored)) != lengths[:n] or not joined.startswith(blob[: len(joined)]):
            offset = 0
            for i, (expected_length, tokens) in enumerate(zip(lengths, stored)):
                if len(tokens) != expected_length or not tokens.startswith(blob[offset : offset + expected_length]):
                    hits, failed = hits[:i], True
                    break
                offset += expected_length
        return hits, failed

    def reserve(self, client: int, namespace: bytes, chunks: list[NewChunk]) -> ReserveReply:
        """Pages for every chunk not already committed or reserved, under one write lease; all or nothing."""
        self._check_namespace(namespace)
        wanted = self._new_chunks(chunks)
        needed = sum(self._pages_for(c.nbytes) for c in wanted)
        self._check_lease_limit(client, needed)
        self._make_room(needed)
        if needed > self.allocator.free_count:
            self.counters["no_space"] += 1
            raise RequestError(
                ErrorCode.NO_SPACE,
                f"no space: {needed} pages needed, {self.allocator.free_count} free, the rest leased or not yet "
                f"prepared ({self.allocator.num_pages} pages of {self.page_size} bytes); store less or retry later",
            )
        if not wanted:
            return ReserveReply(0, [None] * len(chunks))
        lease = self.leases.new(WRITE, client, [c.key for c in wanted], self.clock(), needed)
        refs: dict[bytes, ChunkRef] = {}
        for c in wanted:
            pages = self.allocator.allocate(self._pages_for(c.nbytes))
            self.index.add_reserved(Entry(c.key, namespace, c.parent, c.tokens, c.nbytes, pages, lease=lease.id))
            refs[c.key] = ChunkRef(c.key, pages, c.nbytes, 0)
        return ReserveReply(lease.id, [refs.pop(c.key, None) for c in chunks])

    def commit(self, client: int, lease_id: int, checksums: list[int]) -> list[Entry]:
        """Publish the lease's chunks; returns their entries (the L2 tier writes them behind)."""
        lease = self._lease(client, lease_id, "COMMIT")
        if lease.kind != WRITE:
            raise RequestError(ErrorCode.BAD_REQUEST, f"lease {lease_id} is a read lease: COMMIT needs a RESERVE lease")
        if len(checksums) != len(lease.keys):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"COMMIT of lease {lease_id} has {len(checksums)} checksums for {len(lease.keys)} reserved chunks",
            )
        if not all(0 <= c < 1 << 64 for c in checksums):
            raise RequestError(ErrorCode.BAD_REQUEST, f"COMMIT of lease {lease_id}: checksums must be xxh3-64 values "
                               "(unsigned 64-bit integers)")
        self.leases.pop(lease_id)
        # Last chunk first, so each parent ends more recent than its children (see eviction.py).
        entries = []
        for key, checksum in reversed(list(zip(lease.keys, checksums))):
            entry = self.index.commit(key, checksum)
            self.counters["bytes_committed_total"] += entry.nbytes
            entries.append(entry)
        return entries[::-1]

    def release(self, client: int, lease_id: int) -> None:
        self._end(self._lease(client, lease_id, "RELEASE"))

    def clear(self) -> int:
        """Drop every committed chunk not under a read lease; returns how many."""
        return len(eviction.evict(self.index, self.allocator, self.allocator.num_pages + 1))

    def expire(self) -> int:
        """End every lease past its deadline (I8); returns how many."""
        expired = self.leases.expired(self.clock())
        for lease in expired:
            self._end(lease)
        self.counters["expired_leases"] += len(expired)
        return len(expired)

    def drop_client(self, client: int) -> None:
        """The client's connection closed: end its leases (I8)."""
        for lease in self.leases.of_client(client):
            self._end(lease)

    # ---- internals -------------------------------------------------------------------------------------------

    def _end(self, lease: Lease) -> None:
        """Read lease: unpin its chunks. Write lease: abort, freeing the reserved pages (nothing was published)."""
        self.leases.pop(lease.id)
        if lease.kind == READ:
            committed = self.index.committed  # a read lease's chunks stay committed while it lives (I3)
            for key in lease.keys:
                committed[key].readers -= 1
        else:
            for key in lease.keys:
                self.allocator.free(self.index.drop_reserved(key).pages)

    def _lease(self, client: int, lease_id: int, verb: str) -> Lease:
        lease = self.leases.get(lease_id, client)
        if lease is None:
            raise RequestError(
                ErrorCode.UNKNOWN_LEASE,
                f"{verb}: unknown lease {lease_id}: it was never granted to this connection, already ended "
                f"(committed or released), or expired after {self.leases.timeout:g} s",
            )
        return lease

    def _check_namespace(self, namespace: bytes) -> None:
        if namespace not in self.namespaces:
            raise RequestError(
                ErrorCode.UNKNOWN_NAMESPACE, f"unknown namespace {namespace.hex()}: send HELLO with it first"
            )

    def _new_chunks(self, chunks: list[NewChunk]) -> list[NewChunk]:
        """The chunks to write: valid, not in the index, first occurrence only."""
        seen: set[bytes] = set()
        wanted = []
        for c in chunks:
            _check_key(c.key, "chunk key")
            _check_key(c.parent, "parent key")
            if not 0 < c.nbytes <= self.allocator.num_pages * self.page_size:
                raise RequestError(ErrorCode.BAD_REQUEST, f"chunk nbytes must be in [1, pool capacity], got {c.nbytes}")
            if len(c.tokens) % 4:
                raise RequestError(ErrorCode.BAD_REQUEST, "chunk tokens must be little-endian uint32 (4 bytes each)")
            if c.key not in self.index and c.key not in seen:
                seen.add(c.key)
                wanted.append(c)
        return wanted

    # Per-client lease limit: one replica must not pin the whole arena (a stalled or leaking client would otherwise
    # leave every other replica with NO_SPACE until its leases time out). LOOKUP answers the longest prefix that
    # fits in the client's remaining budget (a shorter hit is still correct, and the client recomputes the rest);
    # RESERVE is all or nothing, so it is refused with LEASE_LIMIT before anything is evicted.

    def _within_lease_limit(self, client: int, hits: list[Entry]) -> tuple[list[Entry], int]:
        """The longest prefix of `hits` within the client's remaining budget, and the pages it pins."""
        counts = list(map(len, map(_PAGES, hits)))
        total = sum(counts)
        if not self.lease_limit or not hits:
            return hits, total
        budget = self.lease_limit - self.leases.pages_of(client)
        if total <= budget:
            return hits, total
        self.counters["lease_limited"] += 1
        n = bisect.bisect_right(list(accumulate(counts)), budget)
        return hits[:n], sum(counts[:n])

    def _check_lease_limit(self, client: int, needed: int) -> None:
        if not (self.lease_limit and needed):
            return
        held = self.leases.pages_of(client)
        if held + needed > self.lease_limit:
            self.counters["lease_limited"] += 1
            raise RequestError(
                ErrorCode.LEASE_LIMIT,
                f"lease limit: this connection holds {held} leased pages and RESERVE needs {needed} more, over the "
                f"limit of {self.lease_limit} pages per client; COMMIT or RELEASE leases first, store less per "
                "RESERVE, or raise --max-leased-pages-per-client",
            )

    def _make_room(self, needed: int) -> None:
        goal = eviction.pages_to_free(self.allocator, needed, self.high, self.low)
        if goal:
            evicted = eviction.evict(self.index, self.allocator, goal)
            self.counters["evictions"] += len(evicted)
            self.counters["evicted_bytes"] += sum(e.nbytes for e in evicted)

    def _pages_for(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.page_size)

    # ---- observation -----------------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        a, i = self.allocator, self.index
        c = self.counters
        return PoolStats(
            capacity_bytes=a.num_pages * self.page_size, page_size=self.page_size, num_pages=a.num_pages,
            pages_free=a.free_count, pages_used=i.pages_reserved + i.pages_committed,
            pages_reserved=i.pages_reserved, pages_committed=i.pages_committed, pages_prepared=a.prepared,
            ready=a.prepared == a.num_pages, chunks=len(i.committed), namespaces=len(self.namespaces),
            bytes_stored=i.bytes_stored, bytes_committed_total=c["bytes_committed_total"],
            hit_chunks=c["hit_chunks"], miss_chunks=c["miss_chunks"], hit_tokens=c["hit_tokens"],
            miss_tokens=c["miss_tokens"], verify_failures=c["verify_failures"], evictions=c["evictions"],
            evicted_bytes=c["evicted_bytes"], read_leases=self.leases.count(READ),
            write_leases=self.leases.count(WRITE), expired_leases=c["expired_leases"], no_space=c["no_space"],
            max_leased_pages_per_client=self.lease_limit, leased_pages_by_client=self.leases.pages_by_client(),
            lease_limited=c["lease_limited"],
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError unless: every page is exactly one of unprepared/free/reserved/committed, no page is
        in two chunks, page counters match, every reserved chunk belongs to a live write lease, and every chunk's
        reader count equals the read leases that hold it, and
        every lease's page count equals the pages of its chunks (the per-client limit is computed from those)."""
        a, i = self.allocator, self.index
        owner: dict[int, str] = {}

        def claim(page: int, what: str) -> None:
            _require(0 <= page < a.prepared, f"{what} holds page {page} outside the prepared range [0, {a.prepared})")
            _require(page not in owner, f"page {page} is both {owner.get(page)} and {what}")
            owner[page] = what

        for page in a.free_pages():
            claim(page, "free")
        for entry in list(i.reserved.values()) + list(i.committed.values()):
            for page in entry.pages:
                claim(page, f"chunk {entry.key.hex()[:8]}")
        _require(len(owner) == a.prepared, f"{a.prepared - len(owner)} prepared pages are neither free nor in a chunk")
        _require(i.pages_reserved == sum(len(e.pages) for e in i.reserved.values()), "pages_reserved counter is off")
        _require(i.pages_committed == sum(len(e.pages) for e in i.committed.values()), "pages_committed is off")
        _require(a.free_count + i.pages_reserved + i.pages_committed + a.unprepared == a.num_pages, "page sum is off")
        _require(not set(i.reserved) & set(i.committed), "a key is both reserved and committed")
        readers = Counter()
        writers: dict[bytes, int] = {}
        by_client = Counter()
        for lease in self.leases:
            by_client[lease.client] += lease.pages
            table = i.committed if lease.kind == READ else i.reserved
            pinned = sum(len(table[k].pages) for k in lease.keys if k in table)
            _require(lease.pages == pinned, f"lease {lease.id} counts {lease.pages} pages but pins {pinned}")
            for key in lease.keys:
                if lease.kind == READ:
                    _require(key in i.committed, f"read lease {lease.id} holds a chunk that is not committed")
                    readers[key] += 1
                else:
                    writers[key] = lease.id
        _require(self.leases.pages_by_client() == {c: n for c, n in by_client.items() if n},
                 "the per-client leased-page counts disagree with the leases")
        for key, entry in i.committed.items():
            _require(entry.readers == readers[key], f"chunk {key.hex()[:8]} readers {entry.readers} != {readers[key]}")
        for key, entry in i.reserved.items():
            _require(writers.get(key) == entry.lease, f"reserved chunk {key.hex()[:8]} has no live write lease")
        _require(len(writers) == len(i.reserved), "a write lease holds a chunk that is not reserved")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)


def _check_key(key: bytes, what: str) -> None:
    if len(key) != KEY_BYTES:
        raise RequestError(ErrorCode.BAD_REQUEST, f"{what} must be {KEY_BYTES} bytes, got {len(key)}")
