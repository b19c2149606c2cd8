"""A restarted pool starts empty (it never serves a previous life's pages) and replicas reconnect on their own."""

from __future__ import annotations

import time

import pytest

from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

from .conftest import complete, kvshare_serve, pool_hits, prompt_ids, running

pytestmark = pytest.mark.slow


def first_cross_replica_hit(a: str, b: str, seeds: range) -> int:
    """A stores a fresh prompt, then B asks for it; the first seed for which B's answer came from the pool (a fresh
    prompt each time: B's own local cache must not answer instead), or -1."""
    for seed in seeds:
        complete(a, prompt_ids(seed))
        if pool_hits(complete(b, prompt_ids(seed))) > 0:
            return seed
        time.sleep(0.25)  # the connector retries a lost pool after its retry interval (2 s)
    return -1


def test_restarted_pool_starts_empty_and_replicas_reconnect(tiny_model, tmp_path):
    socket_path = str(tmp_path / "pool.sock")
    with start_pool("8MiB", page_size="64KiB", socket=socket_path) as (address, process):
        with running(kvshare_serve(tiny_model, address), kvshare_serve(tiny_model, address)) as (a, b):
            before = complete(a.url, prompt_ids(1))
            assert first_cross_replica_hit(a.url, b.url, range(2, 3)) == 2  # sharing works in the first life
            assert read_stats(address).chunks > 0
            process.kill()  # a crash: no cleanup runs
            process.wait()
            with start_pool("8MiB", page_size="64KiB", socket=socket_path) as (address, _):
                restarted = read_stats(address)
                assert restarted.chunks == 0 and restarted.bytes_committed_total == 0  # nothing of its last life
                assert complete(a.url, prompt_ids(1))["choices"] == before["choices"]
                assert first_cross_replica_hit(a.url, b.url, range(10, 50)) >= 0, "replicas did not reconnect"
                assert read_stats(address).hit_tokens > 0
