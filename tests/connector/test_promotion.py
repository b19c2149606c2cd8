"""The connector's L2 decision (kvshare.connector.promotion) between a connector core and a real pool whose L2 is a
real Redis: a LOOKUP answers from the pool's memory first, then promotes from L2 only where the cost model, fed with
this replica's prefill times and the pool's L2 rate, says promotion beats recompute; decisions counted both ways."""

from __future__ import annotations

import pytest
import redis

from kvshare.connector import ConnectorConfig, ConnectorCore
from kvshare.connector.contract import ConnectorStats
from kvshare.connector.promotion import PromotionPolicy
from kvshare.keys import Namespace
from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.l2 import codec
from kvshare.pool.l2.testing import REDIS_MISSING, redis_available, start_redis, url_of
from kvshare.pool.testing import start_pool

pytestmark = pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
CHUNK = 32  # tokens
CHUNK_BYTES = 64 << 10  # 2 KiB a token
NAMESPACE = Namespace("promotion-test-model", "float32", "test-layout", CHUNK)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(n)]


def _in_l2(client: redis.Redis, core: ConnectorCore, ids: list[int]) -> None:
    """Every full chunk of ids, in L2 as another host's write-behind would have put it."""
    namespace, keys, tokens = core.chunk_plan(ids)
    parents = [namespace.key, *keys[:-1]]
    for i, (key, parent, token_bytes) in enumerate(zip(keys, parents, tokens)):
        data = bytes([i % 251]) * CHUNK_BYTES
        header = codec.Header(codec.VERSION, namespace.key, key, parent, token_bytes, len(data), checksum(data))
        client.set(codec.redis_key(namespace.key, key), codec.encode(header, data))


def _in_l1(address: str, core: ConnectorCore, ids: list[int], chunks: int) -> None:
    """The first `chunks` chunks of ids in the pool's own memory (a LOOKUP that promotes them, from another client)."""
    namespace, keys, tokens = core.chunk_plan(ids[: chunks * CHUNK])
    with PoolClient.connect(address) as other:
        other.hello(namespace.key, "test: fill L1")
        found = other.lookup(namespace.key, keys, tokens)
        assert len(found.chunks) == chunks
        other.release(found.lease)


@pytest.fixture
def setup():
    """(pool address, Redis client, a connector core deciding with a settable clock, the clock)."""
    with start_redis() as server, start_pool("16MiB", page_size="64KiB", l2=url_of(server)) as (address, _):
        client = redis.Redis(port=server.port)
        core = ConnectorCore(ConnectorConfig(address=address, chunk_tokens=CHUNK), NAMESPACE)
        clock = Clock()
        core.promotion = PromotionPolicy("decide", CHUNK, core.stats, clock=clock)
        yield address, client, core, clock
        core.close()
        client.close()


def _pool_stats(address: str):
    with PoolClient.connect(address, map_arena=False) as c:
        return c.stats()


def _measured(core: ConnectorCore, clock: Clock, seconds_per_token: float) -> None:
    """Prefills as the engine reports them, and a fresh read of the pool's L2 rate."""
    for n in (64, 256, 1024):
        core.observe_prefill(n, 0, n * seconds_per_token)
    clock.now += 60


def test_promotes_while_unmeasured_then_declines_where_recompute_is_faster(setup):
    address, client, core, clock = setup
    first, second = _ids(8 * CHUNK + 1, 1), _ids(8 * CHUNK + 1, 2)
    _in_l2(client, core, first)
    _in_l2(client, core, second)

    hit = core.find(first, 0)  # no rates yet: today's behaviour, which also measures the L2 rate
    assert hit is not None and hit.num_chunks == 8
    core.release_hit(hit)
    assert core.stats.l2_promote_unmeasured == 1

    _measured(core, clock, seconds_per_token=1e-9)  # a replica that recomputes at a billion tokens a second
    assert core.find(second, 0) is None
    assert (core.stats.l2_promote_declined, core.stats.l2_promote_chosen) == (1, 0)
    stats = _pool_stats(address)
    assert stats.l2_promotions == 8 and stats.read_leases == 0  # nothing promoted for `second`, no lease left


def test_chooses_promotion_where_recompute_is_slower_and_ends_the_first_lease(setup):
    address, client, core, clock = setup
    warm, ids = _ids(2 * CHUNK + 1, 3), _ids(8 * CHUNK + 1, 4)
    _in_l2(client, core, warm)
    _in_l2(client, core, ids)
    core.release_hit(core.find(warm, 0))  # measures the L2 rate (unmeasured: promoted)
    _in_l1(address, core, ids, chunks=2)  # the pool holds the first two chunks itself

    _measured(core, clock, seconds_per_token=1.0)  # a replica that needs a second a token
    hit = core.find(ids, 0)
    assert hit is not None and hit.num_chunks == 8
    assert (core.stats.l2_promote_chosen, core.stats.l2_promote_declined) == (1, 0)
    assert _pool_stats(address).read_leases == 1  # the first LOOKUP's lease (two chunks) ended: only the hit's
    core.release_hit(hit)
    assert _pool_stats(address).read_leases == 0


def test_decision_off_promotes_every_time_without_deciding(setup):
    address, client, _, _ = setup
    core = ConnectorCore(ConnectorConfig(address=address, chunk_tokens=CHUNK, l2_promotion="always"), NAMESPACE)
    try:
        ids = _ids(4 * CHUNK + 1, 5)
        _in_l2(client, core, ids)
        for n in (64, 256, 1024):
            core.observe_prefill(n, 0, n * 1e-9)  # recompute would win, but nobody asks
        hit = core.find(ids, 0)
        assert hit is not None and hit.num_chunks == 4
        core.release_hit(hit)
        stats = core.stats
        assert (stats.l2_promote_chosen, stats.l2_promote_declined, stats.l2_promote_unmeasured) == (0, 0, 0)
    finally:
        core.close()


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="decide, always"):
        PromotionPolicy("sometimes", CHUNK, ConnectorStats())
