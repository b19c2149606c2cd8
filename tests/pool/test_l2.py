"""The L2 tier against real redis-server processes: two pools with separate arenas (two hosts) sharing through
standalone Redis and a three-master cluster, Redis killed mid-run, corrupted values, write-behind overflow."""

from __future__ import annotations

import time

import pytest

from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.l2 import codec
from kvshare.pool.l2.breaker import Breaker
from kvshare.pool.l2.testing import REDIS_MISSING, free_port, redis_available, start_redis, start_redis_cluster, url_of
from kvshare.pool.testing import start_pool
from tests.pool.conftest import new_chunks, prompt, random_bytes

needs_redis = pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
CHUNK = 3 * (1 << 19)  # 1.5 MiB: two 1 MiB pages, the second one half full
NS = b"\x11" * 16


# ---- units: value format and circuit breaker -----------------------------------------------------------------


def _value(payload: bytes, tokens: bytes = b"\1\0\0\0") -> bytes:
    header = codec.Header(codec.VERSION, NS, b"k" * 16, NS, tokens, len(payload), checksum(payload))
    return codec.encode(header, payload)


def test_codec_accepts_only_the_exact_intact_chunk():
    payload = random_bytes(5000, 1)
    value = _value(payload)
    header, got = codec.decode_verified(value, NS, b"k" * 16, NS, b"\1\0\0\0")
    assert bytes(got) == payload and header.nbytes == 5000
    flipped = bytearray(value)
    flipped[-1] ^= 1
    cases = {
        "checksum": (bytes(flipped), b"k" * 16, NS, b"\1\0\0\0"),
        "truncated": (value[:-10], b"k" * 16, NS, b"\1\0\0\0"),
        "tokens": (value, b"k" * 16, NS, b"\2\0\0\0"),
        "parent": (value, b"k" * 16, b"p" * 16, b"\1\0\0\0"),
        "key": (value, b"x" * 16, NS, b"\1\0\0\0"),
        "garbage": (b"\xff" * 40, b"k" * 16, NS, b"\1\0\0\0"),
    }
    for v, key, parent, tokens in cases.values():
        with pytest.raises(codec.Rejected):
            codec.decode_verified(v, NS, key, parent, tokens)


def test_breaker_opens_after_failures_and_lets_one_trial_through():
    now = [0.0]
    breaker = Breaker(failures=3, retry_after=2.0, clock=lambda: now[0])
    for _ in range(3):
        assert breaker.allow()
        breaker.failed()
    assert not breaker.allow() and not breaker.may_try()
    now[0] = 2.5
    assert breaker.allow()  # the trial call
    assert not breaker.allow()  # only one at a time
    breaker.failed()
    assert not breaker.allow()  # open again for retry_after
    now[0] = 5.0
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.allow() and breaker.state == "closed"


def test_keys_carry_namespace_and_a_hash_tag_on_the_chunk():
    name = codec.redis_key(b"\xab" * 16, b"\xcd" * 16)
    assert name == f"kvshare:v1:{'ab' * 16}:{{{'cd' * 16}}}"


# ---- two pools sharing through Redis ---------------------------------------------------------------------------


def _store(client: PoolClient, keys, tokens, datas) -> None:
    r = client.reserve(NS, new_chunks(keys, tokens, CHUNK, first_parent=NS))
    sums = []
    for ref, data in zip(r.chunks, datas):
        if ref is not None:
            client.write(ref, data)
            sums.append(checksum(data))
    if r.lease:
        client.commit(r.lease, sums)


def _load(client: PoolClient, keys, tokens) -> list[bytes]:
    found = client.lookup(NS, keys, tokens)
    out = [client.read(ref).tobytes() for ref in found.chunks]
    if found.lease:
        client.release(found.lease)
    return out


def _wait(client: PoolClient, condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if condition(stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {client.stats()}")


def _connect(address: str) -> PoolClient:
    client = PoolClient.connect(address)
    client.hello(NS, "l2 tests")
    return client


def _data(n: int, seed: int) -> list[bytes]:
    return [random_bytes(CHUNK, seed * 100 + i) for i in range(n)]


@pytest.fixture(params=["standalone", "cluster"])
def l2_url(request):
    if not redis_available():
        pytest.skip(REDIS_MISSING)
    if request.param == "standalone":
        with start_redis() as server:
            yield url_of(server)
    else:
        with start_redis_cluster() as servers:
            yield url_of(servers)


@needs_redis
@pytest.mark.slow
def test_chunk_stored_through_one_pool_is_served_byte_exact_by_another(l2_url):
    keys, tokens = prompt(4, seed=1, ns=NS)
    datas = _data(4, 1)
    with start_pool("32MiB", page_size=1 << 20, l2=l2_url) as (a1, _), \
            start_pool("32MiB", page_size=1 << 20, l2=l2_url) as (a2, _):
        with _connect(a1) as host1, _connect(a2) as host2:
            _store(host1, keys, tokens, datas)
            _wait(host1, lambda s: s.l2_writes == 4, "4 write-behinds")
            _store(host2, keys[:1], tokens[:1], datas[:1])  # host 2 has chunk 0 itself: L1 prefix, then L2
            assert _load(host2, keys, tokens) == datas
            stats = host2.stats()
            assert (stats.l2_hits, stats.l2_promotions, stats.l2_rejected) == (3, 3, 0)
            assert _load(host2, keys, tokens) == datas  # now all in host 2's L1
            stats = host2.stats()
            assert stats.l2_hits == 3 and stats.hit_chunks == 8
            _wait(host1, lambda s: s.read_leases == 0, "write-behind pins released")


@needs_redis
@pytest.mark.slow
def test_l2_killed_mid_run_costs_hits_only_and_recovers():
    with start_redis() as redis_server:
        url = url_of(redis_server)
        opts = dict(page_size=1 << 20, l2=url, l2_timeout=0.2, l2_retry_after=0.3)
        with start_pool("48MiB", **opts) as (a1, _), start_pool("48MiB", **opts) as (a2, _):
            with _connect(a1) as host1, _connect(a2) as host2:
                keys_a, tokens_a = prompt(3, seed=2, ns=NS)
                data_a = _data(3, 2)
                _store(host1, keys_a, tokens_a, data_a)
                _wait(host1, lambda s: s.l2_writes == 3, "write-behinds")
                assert _load(host2, keys_a, tokens_a) == data_a

                redis_server.kill()
                keys_b, tokens_b = prompt(3, seed=3, ns=NS)
                data_b = _data(3, 3)
                _store(host1, keys_b, tokens_b, data_b)  # no error although L2 is gone
                assert _load(host1, keys_b, tokens_b) == data_b
                assert _load(host2, keys_b, tokens_b) == []  # a miss, not an error
                assert _load(host2, keys_a, tokens_a) == data_a  # L1 unaffected
                _wait(host1, lambda s: s.l2_write_drops >= 1 and s.l2_errors >= 1, "drops and errors counted")
                assert host2.stats().l2_errors >= 1

                redis_server.start()  # same port, empty: the breaker's retry reconnects
                deadline = time.monotonic() + 20
                seed = 10
                while host1.stats().l2_writes == 3:
                    assert time.monotonic() < deadline, "write-behind never recovered after Redis came back"
                    seed += 1
                    keys_c, tokens_c = prompt(1, seed=seed, ns=NS)
                    data_c = _data(1, seed)
                    _store(host1, keys_c, tokens_c, data_c)
                    time.sleep(0.1)
                _wait(host1, lambda s: s.read_leases == 0, "pins released")
                assert _load(host2, keys_c, tokens_c) == data_c
                assert _load(host2, keys_b, tokens_b) == []  # written while L2 was down: dropped


@needs_redis
def test_corrupted_value_in_l2_is_rejected_and_counted():
    import redis

    with start_redis() as redis_server:
        url = url_of(redis_server)
        with start_pool("32MiB", page_size=1 << 20, l2=url) as (a1, _), \
                start_pool("32MiB", page_size=1 << 20, l2=url) as (a2, _):
            with _connect(a1) as host1, _connect(a2) as host2:
                keys, tokens = prompt(3, seed=4, ns=NS)
                datas = _data(3, 4)
                _store(host1, keys, tokens, datas)
                _wait(host1, lambda s: s.l2_writes == 3, "write-behinds")
                raw = redis.Redis(port=redis_server.port)
                name = codec.redis_key(NS, keys[1])
                value = bytearray(raw.get(name))
                value[-7] ^= 0x40  # one flipped bit in the KV bytes
                raw.set(name, bytes(value))
                raw.close()
                assert _load(host2, keys, tokens) == datas[:1]  # stops before the corrupted chunk
                stats = host2.stats()
                assert (stats.l2_rejected, stats.l2_hits, stats.l2_promotions) == (1, 1, 1)


@needs_redis
def test_write_behind_overflow_drops_and_counts():
    with start_redis() as redis_server:
        with start_pool("64MiB", page_size=1 << 20, l2=url_of(redis_server), l2_queue=1,
                        max_leased_pages_per_client=0) as (address, _):
            with _connect(address) as client:
                keys, tokens = prompt(20, seed=5, ns=NS)
                datas = _data(20, 5)
                _store(client, keys, tokens, datas)  # one COMMIT of 20 chunks into a queue of 1
                stats = _wait(client, lambda s: s.l2_writes + s.l2_write_drops == 20, "every write-behind accounted")
                assert stats.l2_write_drops >= 1 and stats.l2_writes >= 1
                _wait(client, lambda s: s.read_leases == 0, "pins released")
                assert _load(client, keys, tokens) == datas


def test_pool_with_unreachable_l2_serves_from_l1():
    if not redis_available():
        pytest.skip(REDIS_MISSING)
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    with start_pool("32MiB", page_size=1 << 20, l2=url, l2_timeout=0.2) as (address, _):
        with _connect(address) as client:
            keys, tokens = prompt(2, seed=6, ns=NS)
            datas = _data(2, 6)
            _store(client, keys, tokens, datas)
            assert _load(client, keys, tokens) == datas
            other_keys, other_tokens = prompt(2, seed=7, ns=NS)
            assert _load(client, other_keys, other_tokens) == []
            stats = _wait(client, lambda s: s.l2_write_drops == 2, "dropped write-behinds")
            assert stats.l2_errors >= 1 and stats.l2_writes == 0
            assert client.health(deep=True)
