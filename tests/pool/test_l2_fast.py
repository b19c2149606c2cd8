"""The striped L2 read path (kvshare.pool.l2.lanes, striped.py) against real redis-server processes: chunks spread
over several connections, fetches that go on past a stalled node, a corrupted value in the middle of a striped batch,
a cluster master killed mid-promotion. Values are written into Redis in the L2 format directly (the write-behind has
its own tests in test_l2.py), so each test knows exactly which node holds which chunk."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.l2 import codec
from kvshare.pool.l2.testing import REDIS_MISSING, redis_available, start_redis, start_redis_cluster, url_of
from kvshare.pool.testing import start_pool
from tests.pool.conftest import prompt, random_bytes

pytestmark = pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
CHUNK = 3 * (1 << 19)  # 1.5 MiB: two 1 MiB pages
NS = b"\x22" * 16


def _chunks(n: int, seed: int):
    keys, tokens = prompt(n, seed=seed, ns=NS)
    datas = [random_bytes(CHUNK, seed * 100 + i) for i in range(n)]
    return keys, tokens, datas


def _put(client, keys, tokens, datas) -> None:
    """SET each chunk's L2 value, exactly as the write-behind encodes it."""
    parents = [NS, *keys[:-1]]
    for key, parent, token_bytes, data in zip(keys, parents, tokens, datas):
        header = codec.Header(codec.VERSION, NS, key, parent, token_bytes, len(data), checksum(data))
        client.set(codec.redis_key(NS, key), codec.encode(header, data))


def _load(client: PoolClient, keys, tokens) -> list[bytes]:
    found = client.lookup(NS, keys, tokens)
    out = [client.read(ref).tobytes() for ref in found.chunks]
    if found.lease:
        client.release(found.lease)
    return out


def _connect(address: str, timeout: float = 5.0) -> PoolClient:
    client = PoolClient.connect(address, timeout=timeout)
    client.hello(NS, "l2 fast tests")
    return client


def _wait(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _hits(server) -> int:
    return int(server.cli("info", "stats").split("keyspace_hits:")[1].split()[0])


def _warm(pool: PoolClient, put, servers) -> int:
    """Promote two single-chunk prompts: the first teaches the pool the namespace's chunk size (its window opens,
    values then come in pieces); returns how many keyspace hits one chunk costs from then on."""
    for seed in (900, 901):
        keys, tokens, datas = _chunks(1, seed=seed)
        put(keys, tokens, datas)
        before = sum(_hits(s) for s in servers)
        assert _load(pool, keys, tokens) == datas
    return sum(_hits(s) for s in servers) - before


def _idle(client: PoolClient) -> bool:
    stats = client.stats()
    return stats.read_leases == 0 and stats.write_leases == 0


@contextlib.contextmanager
def _pool_over_redis(keys, tokens, datas):
    """A standalone Redis holding the chunks as the write-behind would have put them, and a connected client of a pool
    with it as L2: yields (server, a plain Redis client, the pool client)."""
    with start_redis() as server:
        plain = redis.Redis(port=server.port)
        try:
            _put(plain, keys, tokens, datas)
            with start_pool("32MiB", page_size=1 << 20, l2=url_of(server)) as (address, _):
                with _connect(address) as pool:
                    yield server, plain, pool
        finally:
            plain.close()


def test_promotion_is_striped_over_several_connections():
    keys, tokens, datas = _chunks(8, seed=1)
    with _pool_over_redis(keys, tokens, datas) as (server, plain, pool):
        _warm(pool, lambda *chunks: _put(plain, *chunks), [server])
        assert _load(pool, keys, tokens) == datas
        stats = pool.stats()
        assert (stats.l2_hits, stats.l2_promotions, stats.l2_rejected) == (10, 10, 0)
        getters = [c["addr"] for c in plain.client_list() if c["cmd"] in ("get", "getrange")]
    assert len(getters) >= 2, f"one connection carried every GET: {getters}"


def test_corrupted_value_in_the_middle_of_a_striped_batch_stops_the_promotion_there():
    keys, tokens, datas = _chunks(8, seed=2)
    with _pool_over_redis(keys, tokens, datas) as (server, plain, pool):
        name = codec.redis_key(NS, keys[4])
        value = bytearray(plain.get(name))
        value[-100] ^= 0x01  # one flipped bit in chunk 4's KV bytes
        plain.set(name, bytes(value))
        per_chunk = _warm(pool, lambda *chunks: _put(plain, *chunks), [server])  # chunks 0..7 go out at once
        before = _hits(server)
        assert _load(pool, keys, tokens) == datas[:4]
        stats = pool.stats()
        assert (stats.l2_rejected, stats.l2_hits, stats.l2_promotions) == (1, 2 + 4, 2 + 4)
        assert _hits(server) - before == 8 * per_chunk  # chunks 5..7 were in flight too, not installed
        assert stats.pages_used == (2 + 4) * 2
        _wait(lambda: _idle(pool), "every internal lease ended")


def test_cluster_master_stalled_then_killed_mid_promotion():
    """Fetches go on past a stalled master (chunks on the others all arrive, and the prefix before its first chunk is
    installed); when it dies, the promotion stops exactly at that chunk, and the pool serves on."""
    with start_redis_cluster() as servers:
        cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in servers])

        def port_of(key: bytes) -> int:
            return cluster.get_node_from_key(codec.redis_key(NS, key)).port

        for seed in range(3, 200):  # a prompt whose chunks 0..2 are on other masters than chunk 3's
            keys, tokens, datas = _chunks(12, seed=seed)
            victim = port_of(keys[3])
            if victim not in {port_of(key) for key in keys[:3]}:
                break
        first_lost = 3
        _put(cluster, keys, tokens, datas)
        others = [s for s in servers if s.port != victim]
        on_others = {s.port: sum(port_of(k) == s.port for k in keys) for s in others}
        stalled = next(s for s in servers if s.port == victim)

        opts = dict(page_size=1 << 20, l2=url_of(servers), l2_timeout=20, l2_promote_timeout=30)
        with start_pool("48MiB", **opts) as (address, _):
            with _connect(address) as pool, _connect(address, timeout=60) as waiting:
                per_chunk = _warm(pool, lambda *chunks: _put(cluster, *chunks), servers)
                cluster.close()
                hits_before = {s.port: _hits(s) for s in others}
                stalled.process.send_signal(signal.SIGSTOP)
                result: list[list[bytes]] = []
                lookup = threading.Thread(target=lambda: result.append(_load(waiting, keys, tokens)))
                lookup.start()
                try:
                    _wait(lambda: all(_hits(s) - hits_before[s.port] == on_others[s.port] * per_chunk
                                      for s in others),
                          "every chunk on the running masters fetched while one master is stalled")
                    _wait(lambda: pool.stats().l2_promotions == 2 + first_lost, "the prefix before it installed")
                finally:
                    stalled.process.send_signal(signal.SIGKILL)
                    stalled.process.send_signal(signal.SIGCONT)
                lookup.join(60)
                assert not lookup.is_alive()
                assert result == [datas[:first_lost]]
                stats = pool.stats()
                assert stats.l2_errors >= 1 and stats.l2_promotions == 2 + first_lost
                assert _load(pool, keys[:first_lost], tokens[:first_lost]) == datas[:first_lost]  # from L1
                _wait(lambda: _idle(pool), "every internal lease ended")
                assert pool.health(deep=True)


def test_value_longer_than_the_namespace_size_seen_before_is_fetched_whole_next_time():
    """Values of a known length come in pieces; one longer than that is a miss once, then fetched whole."""
    keys, tokens, _ = _chunks(1, seed=5)
    data = random_bytes(3 * CHUNK, 5)  # three times the size the pool learns from the warm-up
    with _pool_over_redis(keys, tokens, [data]) as (server, plain, pool):
        _warm(pool, lambda *chunks: _put(plain, *chunks), [server])
        assert _load(pool, keys, tokens) == []
        assert _load(pool, keys, tokens) == [data]
        stats = pool.stats()
        assert (stats.l2_errors, stats.l2_rejected, stats.l2_promotions) == (0, 0, 3)
        _wait(lambda: _idle(pool), "every internal lease ended")


def test_lookup_without_promotion_answers_from_l1_and_the_rate_is_reported():
    keys, tokens, datas = _chunks(4, seed=6)
    with _pool_over_redis(keys, tokens, datas) as (server, _plain, pool):
        before = _hits(server)
        found = pool.lookup(NS, keys, tokens, promote=False)
        assert found.chunks == [] and _hits(server) == before  # L2 not even asked
        stats = pool.stats()
        assert (stats.l2_hits, stats.l2_promotions, stats.l2_promoted_bytes) == (0, 0, 0)
        assert _load(pool, keys, tokens) == datas  # promote=True (the default): promoted
        stats = pool.stats()
        assert stats.l2_promotions == 4 and stats.l2_promoted_bytes == 4 * CHUNK
        assert stats.l2_promote_seconds > 0
        again = pool.lookup(NS, keys, tokens, promote=False)
        assert [c.key for c in again.chunks] == keys  # now in L1
        pool.release(again.lease)


def _move_slot(cluster: RedisCluster, servers, name: bytes, to_port: int) -> None:
    """Reshard as `redis-cli --cluster reshard` does, for the one slot of `name`: IMPORTING on the target, MIGRATING
    on the source, MIGRATE the slot's keys, then every master learns the slot's new owner."""
    slot = cluster.keyslot(name)
    nodes = {s.port: redis.Redis(port=s.port) for s in servers}
    try:
        ids = {port: node.execute_command("CLUSTER", "MYID").decode() for port, node in nodes.items()}
        source = cluster.get_node_from_key(name).port
        nodes[to_port].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to_port])
        for key in nodes[source].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
            nodes[source].execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", key)
        for node in nodes.values():
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to_port])
    finally:
        for node in nodes.values():
            node.close()


def test_a_resharded_slot_is_followed_and_never_serves_wrong_bytes():
    """A slot moves to another master after the pool learned the slot map: the promotion that meets MOVED stops at
    that chunk (the prefix before it installed, nothing wrong served), the pool rediscovers the map, and the next
    LOOKUP promotes the rest from the slot's new owner."""
    with start_redis_cluster() as servers:
        cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in servers])
        keys, tokens, datas = _chunks(6, seed=41)
        moved = 3
        name = codec.redis_key(NS, keys[moved])
        source = cluster.get_node_from_key(name).port
        target = next(s.port for s in servers if s.port != source)
        _put(cluster, keys, tokens, datas)
        with start_pool("48MiB", page_size=1 << 20, l2=url_of(servers)) as (address, _):
            with _connect(address) as pool:
                _warm(pool, lambda *chunks: _put(cluster, *chunks), servers)
                _move_slot(cluster, servers, name, target)
                cluster.close()
                first = _load(pool, keys, tokens)
                assert first == datas[:moved], "the prefix before the moved chunk, exactly"
                assert pool.stats().l2_errors >= 1  # the MOVED reply, counted
                served = first
                for _ in range(3):  # the slot map is rediscovered at the next promotion
                    if len(served) == len(datas):
                        break
                    served = _load(pool, keys, tokens)
                assert served == datas
                stats = pool.stats()
                assert stats.l2_rejected == 0
                _wait(lambda: _idle(pool), "every internal lease ended")
                assert pool.health(deep=True)
