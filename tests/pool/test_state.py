"""PoolState without sockets: LOOKUP/RESERVE/COMMIT/RELEASE semantics, eviction, leases, and churn (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.pool.protocol import ErrorCode, NewChunk
from kvshare.pool.state import PoolState, RequestError
from tests.pool.conftest import NS, Clock, new_chunks, prompt

PAGE = 4096


def make(num_pages: int = 16, **kw) -> PoolState:
    state = PoolState(num_pages, PAGE, **kw)
    state.hello(NS, "test")
    return state


def store(state: PoolState, keys, tokens, nbytes: int = PAGE, client: int = 1) -> None:
    r = state.reserve(client, NS, new_chunks(keys, tokens, nbytes))
    if r.lease:
        state.commit(client, r.lease, [7] * sum(c is not None for c in r.chunks))
    state.check_integrity()


def test_reserved_chunks_are_invisible_until_commit():  # I2
    state = make()
    keys, tokens = prompt(3)
    r = state.reserve(1, NS, new_chunks(keys, tokens, PAGE * 2))
    assert [len(c.pages) for c in r.chunks] == [2, 2, 2]
    assert state.lookup(2, NS, keys, tokens).num_chunks == 0
    state.commit(1, r.lease, [1, 2, 3])
    found = state.lookup(2, NS, keys, tokens).refs(keys)
    assert [c.checksum for c in found] == [1, 2, 3]
    assert [(c.key, c.pages, c.nbytes) for c in found] == [(c.key, c.pages, c.nbytes) for c in r.chunks]
    state.check_integrity()


def test_lookup_returns_longest_prefix_and_verifies_tokens():
    state = make()
    keys, tokens = prompt(4)
    store(state, keys[:2], tokens[:2])
    assert state.lookup(1, NS, keys, tokens).num_chunks == 2
    wrong = [tokens[0], tokens[1][:-4] + b"\0\0\0\0"]
    assert state.lookup(1, NS, keys[:2], wrong).num_chunks == 1  # a token mismatch is a miss, never a hit
    assert state.counters["verify_failures"] == 1
    other_ns = b"o" * 16
    state.hello(other_ns, "")
    assert state.lookup(1, other_ns, keys, tokens).num_chunks == 0  # another namespace's chunk: parent differs
    s = state.stats()
    assert (s.hit_chunks, s.miss_chunks, s.hit_tokens) == (3, 7, 3 * 16)
    state.check_integrity()


def test_reserve_skips_committed_and_reserved_chunks():
    state = make()
    keys, tokens = prompt(3)
    store(state, keys[:1], tokens[:1])
    first = state.reserve(1, NS, new_chunks(keys[:2], tokens[:2], PAGE))
    assert first.chunks[0] is None and first.chunks[1] is not None
    second = state.reserve(2, NS, new_chunks(keys, tokens, PAGE))
    assert second.chunks[:2] == [None, None] and second.chunks[2] is not None
    state.check_integrity()


def test_errors_are_typed_and_change_nothing():
    state = make(num_pages=4)
    keys, tokens = prompt(2)
    with pytest.raises(RequestError) as error:
        state.lookup(1, b"u" * 16, keys, tokens)
    assert error.value.code == ErrorCode.UNKNOWN_NAMESPACE
    r = state.reserve(1, NS, new_chunks(keys, tokens, PAGE))
    with pytest.raises(RequestError) as error:
        state.commit(2, r.lease, [0, 0])  # another client's lease
    assert error.value.code == ErrorCode.UNKNOWN_LEASE
    with pytest.raises(RequestError) as error:
        state.commit(1, r.lease, [0])  # wrong number of checksums
    assert error.value.code == ErrorCode.BAD_REQUEST
    state.commit(1, r.lease, [0, 0])
    with pytest.raises(RequestError) as error:
        state.commit(1, r.lease, [0, 0])  # double commit
    assert error.value.code == ErrorCode.UNKNOWN_LEASE
    with pytest.raises(RequestError) as error:
        state.reserve(1, NS, [NewChunk(b"short", NS, b"", 1)])
    assert error.value.code == ErrorCode.BAD_REQUEST
    state.check_integrity()


def test_eviction_is_lru_skips_leased_chunks_and_keeps_parents():  # I3
    state = make(num_pages=12, high_watermark=0.75, low_watermark=0.6)
    a_keys, a_tokens = prompt(4, seed=1)
    b_keys, b_tokens = prompt(4, seed=2)
    store(state, a_keys, a_tokens)
    store(state, b_keys, b_tokens)  # 8 of 10 pages used
    leased = state.lookup(1, NS, a_keys, a_tokens)  # A is pinned and more recent than B
    c_keys, c_tokens = prompt(2, seed=3)
    store(state, c_keys, c_tokens)  # 8 + 2 > 9 pages (high): evict down to 7 used after the allocation
    assert all(k in state.index.committed for k in a_keys)  # leased: untouched
    assert b_keys[0] in state.index.committed and b_keys[3] not in state.index.committed  # tail first
    state.release(1, leased.lease)
    state.check_integrity()


def test_no_space_when_everything_is_leased_and_nothing_leaks():
    state = make(num_pages=4)
    keys, tokens = prompt(4)
    store(state, keys, tokens)
    lease = state.lookup(1, NS, keys, tokens).lease
    more, more_tokens = prompt(1, seed=9)
    with pytest.raises(RequestError) as error:
        state.reserve(2, NS, new_chunks(more, more_tokens, PAGE))
    assert error.value.code == ErrorCode.NO_SPACE and "no space" in error.value.message
    state.release(1, lease)
    store(state, more, more_tokens)  # now the LRU chunk can go
    assert state.stats().evictions >= 1


def test_expired_leases_are_fenced_until_their_holder_confirms_or_is_gone():  # I8, I10
    """Expiry takes a lease's rights (COMMIT refused) but not its pages: a stalled writer resumed after expiry can
    only write pages nobody else was given. The pages come back when the holder confirms or its process is gone."""
    clock = Clock()
    state = make(num_pages=8, lease_timeout=5.0, clock=clock)
    keys, tokens = prompt(2)
    store(state, keys, tokens)
    state.lookup(1, NS, keys, tokens)
    wkeys, wtokens = prompt(2, seed=5)
    write = state.reserve(2, NS, new_chunks(wkeys, wtokens, PAGE))
    quarantined = [p for ref in write.chunks for p in ref.pages]
    clock.now = 4.9
    assert state.expire() == 0
    clock.now = 5.0
    assert state.expire() == 2
    state.check_integrity()
    stats = state.stats()
    assert (stats.fenced_leases, stats.fenced_pages, stats.pages_quarantined) == (2, 4, 2)
    assert stats.pages_free == 4 and state.index.committed[keys[0]].readers == 1  # still pinned: not evictable
    assert state.clear() == 0
    # Another writer stores the same chunks: it gets the keys (no longer reserved) but never the fenced pages.
    again = state.reserve(3, NS, new_chunks(wkeys, wtokens, PAGE))
    assert not {p for ref in again.chunks for p in ref.pages} & set(quarantined)
    state.commit(3, again.lease, [1, 2])
    # The stalled writer finishes and COMMITs: refused (nothing published over the new chunks), pages freed.
    with pytest.raises(RequestError) as error:
        state.commit(2, write.lease, [0, 0])
    assert error.value.code == ErrorCode.LEASE_EXPIRED
    assert state.index.committed[wkeys[0]].checksum == 1
    assert state.stats().pages_quarantined == 0 and state.stats().pages_free == 4
    state.client_gone(1)  # the reader's process exited: its fenced pin ends
    assert state.index.committed[keys[0]].readers == 0 and state.stats().fenced_leases == 0
    state.check_integrity()


def test_a_closed_connection_fences_its_leases_until_its_process_exits():  # I8, I10
    clock = Clock()
    state = make(num_pages=8, lease_timeout=5.0, clock=clock)
    keys, tokens = prompt(2)
    store(state, keys, tokens)
    state.identify(3, 4242)
    state.lookup(3, NS, keys, tokens)
    state.reserve(3, NS, new_chunks(*prompt(1, seed=6), PAGE))
    state.drop_client(3)
    clock.now = 100.0
    state.expire()
    assert state.stats().fenced_leases == 2 and state.stats().pages_free == 5  # watched holder: no time limit
    state.client_gone(3)
    assert state.stats().read_leases == state.stats().write_leases == 0 and state.stats().pages_free == 6
    assert state.processes == {} and state.closed == set()
    state.check_integrity()


def test_a_holder_the_pool_cannot_watch_gets_one_lease_timeout_after_its_connection_closed():
    clock = Clock()
    state = make(num_pages=8, lease_timeout=5.0, clock=clock)
    state.reserve(3, NS, new_chunks(*prompt(1, seed=6), PAGE))
    state.drop_client(3, watched=False)
    clock.now = 4.9
    state.expire()
    assert state.stats().fenced_leases == 1
    clock.now = 5.0
    state.expire()
    assert state.stats().fenced_leases == 0 and state.stats().pages_free == 8
    state.check_integrity()


def test_a_fenced_lease_can_be_ended_from_another_connection_of_the_same_process_only():
    """A client that reconnected after a timeout RELEASEs (or COMMITs) its old connection's leases once their
    copies are over; no other process may, and a live lease of another connection stays its own."""
    state = make(num_pages=8)
    keys, tokens = prompt(2)
    store(state, keys, tokens)
    for client, pid in ((1, 100), (2, 100), (3, 200)):
        state.identify(client, pid)
    read = state.lookup(1, NS, keys, tokens)
    with pytest.raises(RequestError):
        state.release(2, read.lease)  # live: only its own connection ends it
    state.drop_client(1)
    with pytest.raises(RequestError):
        state.release(3, read.lease)  # another process
    state.release(2, read.lease)
    assert state.stats().fenced_leases == 0 and state.index.committed[keys[0]].readers == 0
    assert 1 not in state.processes
    state.check_integrity()


def test_leased_pages_per_client_follow_every_way_a_lease_ends():
    """The per-client count the lease limit reads (kept by the lease table, not recomputed) goes up with each read
    and write lease, includes fenced leases, and goes back to zero by RELEASE, COMMIT and the holder's exit."""
    clock = Clock()
    state = make(num_pages=16, lease_timeout=5.0, clock=clock)
    keys, tokens = prompt(2)
    store(state, keys, tokens, nbytes=2 * PAGE)  # 4 pages
    leased = state.leases.pages_of
    read = state.lookup(1, NS, keys, tokens)
    write = state.reserve(1, NS, new_chunks(*prompt(1, seed=5), PAGE))
    assert (leased(1), leased(2)) == (5, 0) and state.leases.pages_by_client() == {1: 5}
    state.commit(1, write.lease, [7])
    assert leased(1) == 4
    state.release(1, read.lease)
    assert leased(1) == 0 and state.leases.pages_by_client() == {}
    state.lookup(2, NS, keys, tokens)
    state.lookup(3, NS, keys, tokens)
    clock.now = 5.0
    state.expire()
    assert leased(2) == leased(3) == 4  # fenced leases still count against their client
    state.client_gone(2)
    state.reserve(3, NS, new_chunks(*prompt(1, seed=6), PAGE))
    assert leased(2) == 0 and leased(3) == 5
    state.drop_client(3)
    state.client_gone(3)
    assert leased(3) == 0 and state.leases.pages_by_client() == {}
    state.check_integrity()


def test_discard_removes_a_chunk_at_once_and_frees_its_pages_with_its_last_reader():  # I11
    state = make(num_pages=8)
    keys, tokens = prompt(2)
    store(state, keys, tokens)
    read = state.lookup(1, NS, keys, tokens)
    assert state.discard(NS, [keys[1], b"\0" * 16]) == 1
    assert state.lookup(2, NS, keys, tokens).num_chunks == 1  # gone for every later LOOKUP
    stats = state.stats()
    assert (stats.discarded_chunks, stats.pages_quarantined, stats.chunks) == (1, 1, 1)
    store(state, keys, tokens)  # the next store replaces it, on other pages (the reader may still copy the old)
    assert state.index.committed[keys[1]].pages != read.refs(keys)[1].pages
    state.release(1, read.lease)
    state.check_integrity()
    assert state.stats().pages_quarantined == 0
    assert state.discard(NS, [keys[0]]) == 1 and state.stats().pages_free == 8 - 1 - 1  # unread: freed at once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "commit", "abort", "lookup", "release", "expire", "clear",
                                           "drop", "gone", "discard"]),
                          st.integers(0, 30), st.integers(1, 5 * PAGE)), max_size=60))
def test_random_churn_never_fragments_or_leaks(ops):
    """Any sequence of requests keeps the books exact, and whenever RESERVE fails for lack of space, the free pages
    really are fewer than it needed (free pages are always usable, however scattered: no fragmentation)."""
    clock = Clock()
    state = make(num_pages=24, lease_timeout=10.0, clock=clock)
    for op, n, nbytes in ops:
        keys, tokens = prompt(1 + n % 4, seed=n)
        writes = [lease for lease in state.leases if lease.kind == "write"]
        reads = [lease for lease in state.leases if lease.kind == "read"]
        if op == "reserve":
            try:
                state.reserve(n % 3, NS, new_chunks(keys, tokens, nbytes))
            except RequestError as error:
                assert error.code == ErrorCode.NO_SPACE
                assert state.allocator.free_count < (1 + n % 4) * -(-nbytes // PAGE)
        elif op in ("commit", "abort") and writes:
            lease = writes[n % len(writes)]
            if op == "commit" and lease.fenced:
                with pytest.raises(RequestError) as error:
                    state.commit(lease.client, lease.id, [])
                assert error.value.code == ErrorCode.LEASE_EXPIRED
            elif op == "commit":
                state.commit(lease.client, lease.id, [0] * len(lease.keys))
            else:
                state.release(lease.client, lease.id)
        elif op == "lookup":
            state.lookup(n % 3, NS, keys, tokens)
        elif op == "release" and reads:
            lease = reads[n % len(reads)]
            state.release(lease.client, lease.id)
        elif op == "expire":
            clock.now += n
            state.expire()
        elif op == "clear":
            state.clear()
        elif op == "drop":
            state.drop_client(n % 3, watched=bool(n % 2))
        elif op == "gone":
            state.client_gone(n % 3)
        elif op == "discard":
            state.discard(NS, keys)
        state.check_integrity()


def reference_prefix(state: PoolState, namespace: bytes, keys: list[bytes], tokens: list[bytes]) -> tuple[int, bool]:
    """LOOKUP's verification as the spec states it, one chunk at a time: (hit chunks, whether a found key failed)."""
    parent = namespace
    for i, (key, expected) in enumerate(zip(keys, tokens)):
        entry = state.index.committed.get(key)
        if entry is None:
            return i, False
        if entry.parent != parent or entry.namespace != namespace or entry.tokens != expected:
            return i, True
        parent = key
    return len(keys), False


@settings(max_examples=150, deadline=None)
@given(committed=st.lists(st.booleans(), min_size=6, max_size=6),
       edits=st.lists(st.sampled_from(["same", "flip", "short", "shift", "parent"]), min_size=6, max_size=6),
       n=st.integers(0, 6), limit=st.sampled_from([0, 3, 7]))
def test_lookup_matches_the_chunk_by_chunk_reference(committed, edits, n, limit):
    """The whole-prefix checks (C-level maps, one joined token comparison) answer exactly what a per-chunk loop
    answers: hit length, verify failures, lease-limit cut, and each hit's pages, nbytes and checksum."""
    state = make(num_pages=64, max_leased_pages_per_client=limit)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    tokens = [bytes(range(4 * (i + 1))) for i in range(6)]  # lengths differ chunk to chunk
    nbytes = [PAGE * (1 + i % 3) - i for i in range(6)]  # 1 to 3 pages
    for i in range(6):
        parent = b"x" * 16 if edits[i] == "parent" else (keys[i - 1] if i else NS)  # a writer that broke the chain
        r = state.reserve(1, NS, [NewChunk(keys[i], parent, tokens[i], nbytes[i])])
        if committed[i]:
            state.commit(1, r.lease, [1000 + i])
        else:
            state.release(1, r.lease)
    asked = list(tokens)
    for i, edit in enumerate(edits):
        if edit == "flip":
            asked[i] = asked[i][:-1] + bytes([asked[i][-1] ^ 1])
        elif edit == "short":
            asked[i] = asked[i][:-4]
        elif edit == "shift" and i + 1 < 6:  # same joined bytes, other chunk boundaries
            asked[i], asked[i + 1] = asked[i][:-4], asked[i][-4:] + asked[i + 1]
    expected_hits, expected_failed = reference_prefix(state, NS, keys[:n], asked[:n])
    if limit:
        pages = [len(state.index.committed[k].pages) for k in keys[:expected_hits]]
        while sum(pages) > limit:
            pages.pop()
        expected_hits = len(pages)
    reply = state.lookup(2, NS, keys[:n], asked[:n])
    assert reply.num_chunks == expected_hits
    assert state.counters["verify_failures"] == int(expected_failed)
    refs = reply.refs(keys[:n])
    assert [(r.key, r.pages, r.nbytes, r.checksum) for r in refs] == [
        (k, state.index.committed[k].pages, state.index.committed[k].nbytes, 1000 + i)
        for i, k in enumerate(keys[:expected_hits])]
    assert (reply.lease != 0) == bool(expected_hits)
    state.check_integrity()


def test_commit_refuses_checksums_that_are_not_64_bit():
    state = make()
    keys, tokens = prompt(1)
    r = state.reserve(1, NS, new_chunks(keys, tokens, PAGE))
    for bad in (-1, 1 << 64):
        with pytest.raises(RequestError) as error:
            state.commit(1, r.lease, [bad])
        assert error.value.code == ErrorCode.BAD_REQUEST
    state.commit(1, r.lease, [(1 << 64) - 1])
    assert state.lookup(1, NS, keys, tokens).refs(keys)[0].checksum == (1 << 64) - 1
    state.check_integrity()
