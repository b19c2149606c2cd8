"""Resource limits: one client cannot pin more than its share of the arena (LOOKUP answers a shorter prefix,
RESERVE is refused with lease_limit), STATS shows the limit and who holds what, and the default is half the arena.
(A size beyond memory is refused at start: tests/pool/test_serve.py.)"""

from __future__ import annotations

import pytest
import xxhash

from kvshare.pool.client import NewChunk, PoolClient, PoolError, read_stats
from kvshare.pool.protocol import ErrorCode
from kvshare.pool.testing import start_pool
from tests.pool.conftest import new_chunks, prompt

PAGE = 64 << 10
NS = xxhash.xxh3_128_digest(b"tests/reliability/limits")


def chain(seed: int, n: int) -> tuple[list[NewChunk], list[bytes], list[bytes]]:
    """n chained one-page chunks of a prompt in NS: (chunks to RESERVE, keys, tokens)."""
    keys, tokens = prompt(n, seed=seed, ns=NS)
    return new_chunks(keys, tokens, PAGE, first_parent=NS), keys, tokens


def store(client: PoolClient, chunks: list[NewChunk]) -> None:
    r = client.reserve(NS, chunks)
    client.commit(r.lease, [0] * len(chunks))


@pytest.fixture
def pool():
    with start_pool("1MiB", page_size=PAGE, max_leased_pages_per_client=6) as (address, _):  # 16 pages, limit 6
        yield address


def test_lookup_beyond_the_limit_answers_a_shorter_prefix(pool):
    with PoolClient.connect(pool) as greedy, PoolClient.connect(pool) as other:
        greedy.hello(NS)
        chunks, keys, tokens = chain(1, 8)
        store(greedy, chunks[:4])
        store(greedy, chunks[4:])  # committed: no lease held any more
        first = greedy.lookup(NS, keys, tokens)
        assert len(first.chunks) == 6  # 8 cached, 6 pages allowed: the longest prefix that fits
        assert greedy.lookup(NS, keys, tokens).chunks == []  # budget spent: a miss, not an error
        stats = other.stats()
        assert stats.max_leased_pages_per_client == 6 and stats.lease_limited == 2
        assert list(stats.leased_pages_by_client.values()) == [6]
        other.hello(NS)
        assert len(other.lookup(NS, keys, tokens).chunks) == 6  # another client has its own budget
        greedy.release(first.lease)
        assert len(greedy.lookup(NS, keys[:2], tokens[:2]).chunks) == 2  # released pages count no more
        assert other.health(deep=True)


def test_reserve_beyond_the_limit_is_refused_and_changes_nothing(pool):
    with PoolClient.connect(pool) as client:
        client.hello(NS)
        chunks, _, _ = chain(2, 8)
        held = client.reserve(NS, chunks[:4])  # 4 pages under a write lease
        before = client.stats()
        with pytest.raises(PoolError) as error:
            client.reserve(NS, chunks[4:7])  # 4 + 3 > 6
        assert error.value.code == ErrorCode.LEASE_LIMIT
        assert "--max-leased-pages-per-client" in str(error.value) and "holds 4" in str(error.value)
        after = client.stats()
        assert (after.pages_reserved, after.pages_free, after.write_leases) == (
            before.pages_reserved, before.pages_free, before.write_leases)
        client.reserve(NS, chunks[4:6])  # 4 + 2 fits
        client.commit(held.lease, [0] * 4)  # COMMIT ends the lease: its pages no longer count
        assert client.reserve(NS, chunks[6:8]).lease
        assert client.health(deep=True)


def test_default_limit_is_half_the_arena():
    with start_pool("1MiB", page_size=PAGE) as (address, _):
        assert read_stats(address).max_leased_pages_per_client == 8
