"""The pool's request semantics without any I/O: HELLO, LOOKUP, RESERVE, COMMIT, RELEASE, DISCARD, CLEAR, and the
life of leases (expiry, fencing, holders that went away).

The server calls these from its single event-loop thread, so no method needs a lock; each either completes or
raises RequestError having changed nothing - except that a RESERVE refused for space may first have evicted
unleased chunks trying to make room, and a COMMIT of a fenced lease is refused but ends the fence (the holder has
finished copying). Unit tests drive this class directly, without sockets.

I10 (fencing) is enforced here: no page is handed out again while a process that was granted access to it may still
touch it. Expiry and a closed connection fence a lease instead of ending it (leases.py); its pages come back only
when the holder confirms (RELEASE/COMMIT, from any connection of the same process) or is gone (client_gone).
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
_PARENT, _NAMESPACE = attrgetter("parent"), attrgetter("namespace")
_TOKENS, _PAGES = attrgetter("tokens"), attrgetter("pages")


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
        max_leased_pages_per_client: int = 0, max_description: int = 1024, max_namespaces: int = 1024,
    ) -> None:
        self.page_size = page_size
        self.lease_limit = max_leased_pages_per_client  # 0: none; see _within_lease_limit
        self.allocator = PageAllocator(num_pages, num_pages if prepared is None else prepared)
        self.index = ChunkIndex()
        self.leases = LeaseTable(lease_timeout)
        self.namespaces: dict[bytes, str] = {}
        self.max_description, self.max_namespaces = max_description, max_namespaces
        self.said_hello: dict[int, set[bytes]] = {}  # client -> namespaces it sent HELLO for (while connected)
        self.processes: dict[int, int] = {}  # client -> the pid of its process, when the server knows it
        self.pages_quarantined = 0  # pages of fenced write leases: in no chunk, not free (I10)
        self.closed: set[int] = set()  # clients whose connection closed while they held (now fenced) leases
        self.high, self.low = high_watermark, low_watermark
        self.clock = clock
        self.counters = Counter()  # hit_chunks, miss_tokens, evictions, ... (names as in PoolStats)

    # ---- requests ----------------------------------------------------------------------------------------------

    def hello(self, namespace: bytes, description: str, client: int = 0) -> None:
        """Make `namespace` known (LOOKUP and RESERVE need it). A namespace stays known while a connected client has
        said HELLO for it or a chunk of it is in the index; after that it is reclaimed when room is needed."""
        _check_key(namespace, "namespace key")
        if len(description.encode()) > self.max_description:
            raise RequestError(ErrorCode.LIMIT, f"HELLO description of {len(description.encode())} bytes is over the "
                               f"pool's limit of {self.max_description} (--max-description)")
        if namespace not in self.namespaces and len(self.namespaces) >= self.max_namespaces:
            self._reclaim_namespaces()
            if len(self.namespaces) >= self.max_namespaces:
                raise RequestError(ErrorCode.LIMIT, f"the pool holds {self.max_namespaces} namespaces in use "
                                   "(--max-namespaces): stop replicas of unused models or raise the limit")
        self.namespaces.setdefault(namespace, description)
        self.said_hello.setdefault(client, set()).add(namespace)

    def _reclaim_namespaces(self) -> None:
        """Forget namespaces no connected client said HELLO for and no chunk belongs to (the L2 tier's own client 0
        counts as connected)."""
        in_use = set(self.index.chunks_of).union(*self.said_hello.values())
        for namespace in [n for n in self.namespaces if n not in in_use]:
            del self.namespaces[namespace]

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
            touch(entry.key)
        lease = self.pin(client, hits, pages)
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
            n = next(i for i, (e, p) in enumerate(zip(hits, expected_parents))
                     if e.parent != p or e.namespace != namespace)
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

    def pin(self, client: int, entries: list[Entry], pages: int | None = None) -> Lease:
        """A read lease on committed chunks: none of them is evicted or reused while it lives (I3)."""
        for entry in entries:
            entry.readers += 1
        if pages is None:
            pages = sum(len(entry.pages) for entry in entries)
        return self.leases.new(READ, client, entries, self.clock(), pages)

    def reserve(self, client: int, namespace: bytes, chunks: list[NewChunk], evict: bool = True) -> ReserveReply:
        """Pages for every chunk not already committed or reserved, under one write lease; all or nothing.
        evict=False takes free pages only and never drops a committed chunk (`kvshare pool check` on a live pool)."""
        self._check_namespace(namespace)
        wanted = self._new_chunks(chunks)
        needed = sum(self._pages_for(c.nbytes) for c in wanted)
        self._check_lease_limit(client, needed)
        if evict:
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
        lease = self.leases.new(WRITE, client, [], self.clock(), needed)
        refs: dict[bytes, ChunkRef] = {}
        for c in wanted:
            pages = self.allocator.allocate(self._pages_for(c.nbytes))
            entry = Entry(c.key, namespace, c.parent, c.tokens, c.nbytes, pages, lease=lease.id)
            self.index.add_reserved(entry)
            lease.entries.append(entry)
            refs[c.key] = ChunkRef(c.key, pages, c.nbytes, 0)
        return ReserveReply(lease.id, [refs.pop(c.key, None) for c in chunks])

    def commit(self, client: int, lease_id: int, checksums: list[int]) -> list[Entry]:
        """Publish the lease's chunks; returns their entries (the L2 tier writes them behind).

        A fenced lease's chunks are never published (another writer may have stored them since), but its COMMIT
        says the holder's copy is over, so its quarantined pages are freed and LEASE_EXPIRED is answered."""
        lease = self._lease(client, lease_id, "COMMIT")
        if lease.fenced:
            self._end(lease)
            raise RequestError(ErrorCode.LEASE_EXPIRED, f"COMMIT: lease {lease_id} expired (or its connection closed) "
                               f"before COMMIT; its chunks were not published: store them again")
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
        for reserved, checksum in reversed(list(zip(lease.entries, checksums))):
            entry = self.index.commit(reserved.key, checksum)
            self.counters["bytes_committed_total"] += entry.nbytes
            entries.append(entry)
        return entries[::-1]

    def release(self, client: int, lease_id: int) -> None:
        """End a lease, live or fenced: its holder no longer touches its pages."""
        self._end(self._lease(client, lease_id, "RELEASE"))

    def discard(self, namespace: bytes, keys: list[bytes]) -> int:
        """Remove committed chunks of `namespace` that a reader found corrupt (I11), so that the next store replaces
        them; returns how many were removed. Chunks under read leases leave the index now and free their pages with
        their last reader (index.condemn). Keys not committed in this namespace are ignored. Any client may discard,
        as any client may CLEAR: the pool trusts its clients (docs/security.md)."""
        self._check_namespace(namespace)
        for key in keys:  # all checked before any is removed: a refused DISCARD changes nothing
            _check_key(key, "DISCARD key")
        removed = 0
        for key in keys:
            entry = self.index.committed.get(key)
            if entry is None or entry.namespace != namespace:
                continue
            self.index.condemn(key)
            if not entry.condemned:
                self.allocator.free(entry.pages)
            removed += 1
        self.counters["discarded_chunks"] += removed
        return removed

    def clear(self) -> int:
        """Drop every committed chunk not under a read lease; returns how many."""
        return len(eviction.evict(self.index, self.allocator, self.allocator.num_pages + 1))

    def expire(self) -> int:
        """Fence every live lease past its deadline (I8, I10) and end fences whose grace has passed (holders the
        pool cannot watch); returns how many leases were fenced."""
        now = self.clock()
        expired = self.leases.expired(now)
        for lease in expired:
            self._fence(lease)
        for lease in self.leases.fence_ended(now):
            self._end(lease)
        self.counters["expired_leases"] += len(expired)
        return len(expired)

    def identify(self, client: int, pid: int) -> None:
        """The server learned the client's process (SO_PEERCRED, or ATTACH over TCP)."""
        self.processes[client] = pid

    def drop_client(self, client: int, watched: bool = True) -> None:
        """The client's connection closed. Its process may still be copying (a client closes a connection that
        timed out while its copies run), so its leases are fenced, not ended (I10); client_gone() ends them. A
        holder the server cannot watch (`watched` False) gets one lease timeout to stop copying."""
        self.said_hello.pop(client, None)
        until = math.inf if watched else self.clock() + self.leases.timeout
        for lease in self.leases.of_client(client):
            if lease.fenced:
                lease.fence_until = min(lease.fence_until, until)
            else:
                self._fence(lease, until)
        self.closed.add(client)
        self._forget_if_done(client)

    def client_gone(self, client: int) -> None:
        """The client's process has exited: nothing it held can be touched any more; end all its leases (I8)."""
        for lease in self.leases.of_client(client):
            self._end(lease)
        self.closed.add(client)
        self._forget_if_done(client)

    # ---- internals -------------------------------------------------------------------------------------------

    def _fence(self, lease: Lease, until: float = math.inf) -> None:
        """Take a live lease's rights away but keep what it holds (leases.py): a write lease's reserved chunks leave
        the index (their keys may be stored again by others) and their pages go into its quarantine."""
        self.leases.fence(lease, until)
        if lease.kind == WRITE:
            for entry in lease.entries:
                lease.quarantine.extend(self.index.drop_reserved(entry.key).pages)
            lease.entries = []
            self.pages_quarantined += len(lease.quarantine)

    def _end(self, lease: Lease) -> None:
        """Read lease: unpin its chunks (freeing condemned ones it held last). Write lease: abort, freeing its pages
        (nothing was published): the reserved ones if live, the quarantined ones if fenced."""
        self.leases.pop(lease.id)
        if lease.kind == READ:
            for entry in lease.entries:  # each is committed, or condemned while held (I3)
                entry.readers -= 1
                if self.index.unreferenced(entry):
                    self.allocator.free(entry.pages)
        elif lease.fenced:
            self.allocator.free(lease.quarantine)
            self.pages_quarantined -= len(lease.quarantine)
        else:
            for entry in lease.entries:
                self.allocator.free(self.index.drop_reserved(entry.key).pages)
        self._forget_if_done(lease.client)

    def _forget_if_done(self, client: int) -> None:
        """Forget a closed client once none of its leases is left."""
        if client in self.closed and not self.leases.pages_of(client) and not self.leases.of_client(client):
            self.closed.discard(client)
            self.processes.pop(client, None)

    def _lease(self, client: int, lease_id: int, verb: str) -> Lease:
        """The lease, if `client` may end it: its own, or a fenced lease of another connection of the same process
        (a client that reconnected confirms that its old connection's copies are over)."""
        lease = self.leases.get(lease_id)
        if lease is not None and (lease.client == client
                                  or (lease.fenced and self._same_process(lease.client, client))):
            return lease
        raise RequestError(
            ErrorCode.UNKNOWN_LEASE,
            f"{verb}: unknown lease {lease_id}: it was never granted to this connection (or its process), or has "
            "already ended (committed or released)",
        )

    def _same_process(self, a: int, b: int) -> bool:
        pid = self.processes.get(a)
        return pid is not None and pid == self.processes.get(b)

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
        fenced, fenced_pages = self.leases.fenced_count()
        return PoolStats(
            capacity_bytes=a.num_pages * self.page_size, page_size=self.page_size, num_pages=a.num_pages,
            pages_free=a.free_count, pages_used=a.prepared - a.free_count,
            pages_reserved=i.pages_reserved, pages_committed=i.pages_committed,
            pages_quarantined=self.pages_quarantined + i.pages_condemned, pages_prepared=a.prepared,
            ready=a.prepared == a.num_pages, chunks=len(i.committed), namespaces=len(self.namespaces),
            bytes_stored=i.bytes_stored, bytes_committed_total=c["bytes_committed_total"],
            hit_chunks=c["hit_chunks"], miss_chunks=c["miss_chunks"], hit_tokens=c["hit_tokens"],
            miss_tokens=c["miss_tokens"], verify_failures=c["verify_failures"], evictions=c["evictions"],
            evicted_bytes=c["evicted_bytes"], read_leases=self.leases.count(READ),
            write_leases=self.leases.count(WRITE), expired_leases=c["expired_leases"], fenced_leases=fenced,
            fenced_pages=fenced_pages, discarded_chunks=c["discarded_chunks"], no_space=c["no_space"],
            max_leased_pages_per_client=self.lease_limit, leased_pages_by_client=self.leases.pages_by_client(),
            lease_limited=c["lease_limited"],
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError unless: every prepared page is exactly one of free, in a reserved, committed or
        condemned chunk, or in a fenced write lease's quarantine; page counters match; every reserved chunk belongs
        to a live write lease; every condemned chunk is still read-leased; every chunk's reader count equals the read
        leases (live or fenced) that hold it; and every lease's page count equals the pages it pins or holds (the
        per-client limit is computed from those)."""
        a, i = self.allocator, self.index
        owner: dict[int, str] = {}

        def claim(page: int, what: str) -> None:
            _require(0 <= page < a.prepared, f"{what} holds page {page} outside the prepared range [0, {a.prepared})")
            _require(page not in owner, f"page {page} is both {owner.get(page)} and {what}")
            owner[page] = what

        for page in a.free_pages():
            claim(page, "free")
        held = [*i.reserved.values(), *i.committed.values(), *i.condemned]
        for entry in held:
            for page in entry.pages:
                claim(page, f"chunk {entry.key.hex()[:8]}")
        leases = list(self.leases)
        for lease in leases:
            for page in lease.quarantine:
                claim(page, f"fenced lease {lease.id}")
        _require(len(owner) == a.prepared, f"{a.prepared - len(owner)} prepared pages are neither free nor held")
        _require(i.pages_reserved == sum(len(e.pages) for e in i.reserved.values()), "pages_reserved counter is off")
        _require(i.pages_committed == sum(len(e.pages) for e in i.committed.values()), "pages_committed is off")
        _require(i.pages_condemned == sum(len(e.pages) for e in i.condemned), "pages_condemned is off")
        _require(self.pages_quarantined == sum(len(lease.quarantine) for lease in leases), "pages_quarantined is off")
        _require(a.free_count + i.pages_reserved + i.pages_committed + i.pages_condemned + self.pages_quarantined
                 + a.unprepared == a.num_pages, "page sum is off")
        _require(not set(i.reserved) & set(i.committed), "a key is both reserved and committed")
        _require(i.chunks_of == Counter(e.namespace for e in [*i.reserved.values(), *i.committed.values()]),
                 "the per-namespace chunk counts are off")
        readers: Counter = Counter()
        writers: dict[bytes, int] = {}
        by_client: Counter = Counter()
        for lease in leases:
            by_client[lease.client] += lease.pages
            pinned = sum(len(e.pages) for e in lease.entries) + len(lease.quarantine)
            _require(lease.pages == pinned, f"lease {lease.id} counts {lease.pages} pages but pins {pinned}")
            for entry in lease.entries:
                if lease.kind == READ:
                    _require(i.committed.get(entry.key) is entry or entry in i.condemned,
                             f"read lease {lease.id} holds a chunk that is neither committed nor condemned")
                    readers[entry] += 1
                else:
                    _require(not lease.fenced, f"fenced write lease {lease.id} still owns reserved chunks")
                    writers[entry.key] = lease.id
        _require(self.leases.pages_by_client() == {c: n for c, n in by_client.items() if n},
                 "the per-client leased-page counts disagree with the leases")
        for entry in [*i.committed.values(), *i.condemned]:
            _require(entry.readers == readers[entry], f"chunk {entry.key.hex()[:8]} readers {entry.readers} != "
                     f"{readers[entry]}")
        for entry in i.condemned:
            _require(entry.condemned and entry.readers > 0, f"condemned chunk {entry.key.hex()[:8]} has no reader")
        for key, entry in i.reserved.items():
            _require(writers.get(key) == entry.lease, f"reserved chunk {key.hex()[:8]} has no live write lease")
        _require(len(writers) == len(i.reserved), "a write lease holds a chunk that is not reserved")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)


def _check_key(key: bytes, what: str) -> None:
    if len(key) != KEY_BYTES:
        raise RequestError(ErrorCode.BAD_REQUEST, f"{what} must be {KEY_BYTES} bytes, got {len(key)}")
