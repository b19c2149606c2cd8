"""Reuse down to the engine's block (issue 24): a prompt is stored as its full chunks plus one tail of whole blocks,
and a replica given the same prompt loads every whole block before its last token, also from inside a stored chunk.

Real engines (in process, fp32 on CPU) and a real pool process. With 16-token blocks and 64-token chunks the rule
predicts B's pool hit for a prompt of n tokens that A stored: (n - 1) // 16 * 16 tokens; whole chunks alone gave
(n - 1) // 64 * 64. Every answer must equal the cache-OFF engine's (I6), with checksum verification on or off.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, generate
from kvshare.engine.pool_connector import PoolConnector
from kvshare.keys import chunk_keys, prompt_chunks, tail_key, token_bytes
from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

BLOCK, CHUNK = 16, 64
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# k*block-1, k*block, k*block+1 (k = 5) and k*chunk-1, k*chunk, k*chunk+1 (k = 2)
LENGTHS = (79, 80, 81, 127, 128, 129)


@pytest.fixture
def engines(tiny_model):
    """A cache-OFF reference and two engines whose connectors are attached per test."""
    made = [Engine(EngineConfig(model=str(tiny_model), max_model_len=512, num_blocks=128, block_size=BLOCK))
            for _ in range(3)]
    yield made
    for engine in made:
        if engine.connector is not None:
            engine.connector.close()
        engine.shutdown()


def attach(engine: Engine, address: str, **overrides) -> PoolConnector:
    connector = PoolConnector.for_engine(engine, ConnectorConfig(address=address, chunk_tokens=CHUNK, **overrides))
    engine.set_connector(connector)
    return connector


def run(engine: Engine, prompt: list[int], rid: str):
    (result,) = generate(engine, [GenerationRequest(rid, tuple(prompt), GREEDY)], timeout=120)
    assert result.finished is not None and result.finished.finish_reason != "error", result.finished
    return result.token_ids, result.finished.usage


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(length)]


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_a_replica_recomputes_at_most_one_block_of_a_stored_prompt(engines, verify):
    off, a, b = engines
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        connector_b = attach(b, address, verify_checksums=verify)
        for length in LENGTHS:
            prompt = prompt_of(length, seed=length + verify)
            chunks_before = read_stats(address).chunks
            tokens_a, usage_a = run(a, prompt, f"a-{length}")
            a.connector.core.flush()
            # A stored the prompt's full chunks and its one tail, then at the end the full chunks its answer
            # completed (the last answer token has no KV): never a chunk per block.
            stored = read_stats(address).chunks - chunks_before
            assert stored == (length + GREEDY.max_tokens - 1) // CHUNK + (length % CHUNK >= BLOCK), length
            tokens_b, usage_b = run(b, prompt, f"b-{length}")
            assert usage_a.pool_hit_tokens == 0
            assert usage_b.pool_hit_tokens == (length - 1) // BLOCK * BLOCK, length
            assert tokens_a == tokens_b == run(off, prompt, f"off-{length}")[0], length  # fp32 CPU: exact (I6)
        assert connector_b.stats.load_failures == 0 and connector_b.stats.corrupt_chunks == 0


def test_a_longer_prompt_uses_full_chunks_and_the_tail_still_serves_its_prompt(engines):
    """A stores 100 tokens: chunk 0 and a 32-token tail. A 140-token prompt that extends it asks for chunk 1 whole
    (the tail does not stand in for it), stores it, and a third replica then loads both full chunks; the 100-token
    prompt still finds its tail."""
    off, a, b = engines
    short = prompt_of(100, seed=1)
    longer = short + prompt_of(40, seed=2)
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        attach(b, address)
        run(a, short, "a-short")
        a.connector.core.flush()
        tokens, usage = run(b, longer, "b-longer")
        assert usage.pool_hit_tokens == CHUNK and tokens == run(off, longer, "off-longer")[0]
        b.connector.core.flush()
        c = Engine(EngineConfig(model=a.config.model, max_model_len=512, num_blocks=128, block_size=BLOCK))
        try:
            attach(c, address)
            tokens, usage = run(c, short, "c-short")  # chunk 0 and the tail
            assert usage.pool_hit_tokens == 96 and tokens == run(off, short, "off-short")[0]
            # Its own cache now holds 96 tokens: the pool adds the last two blocks of chunk 1, skipping the first two.
            tokens, usage = run(c, longer, "c-longer")
            assert (usage.local_hit_tokens, usage.pool_hit_tokens) == (96, 32)
            assert tokens == run(off, longer, "off-longer-2")[0]
        finally:
            c.connector.close()
            c.shutdown()


def test_tail_keys_are_apart_from_chunk_keys_and_bounded():
    namespace = b"n" * 16
    tokens = list(range(3, 3 + CHUNK))
    (full,) = chunk_keys(namespace, tokens, CHUNK)
    assert tail_key(namespace, token_bytes(tokens)) != full  # the same bytes never give a full chunk's key
    shorter = tail_key(namespace, token_bytes(tokens[:BLOCK]))
    assert shorter != tail_key(namespace, token_bytes(tokens[: 2 * BLOCK]))
    plan = prompt_chunks(namespace, tokens + tokens[:40], CHUNK, BLOCK)
    assert plan.counts == [CHUNK, 32] and plan.keys[0] == full and plan.parents[1] == full
    assert plan.keys[1] == tail_key(full, token_bytes(tokens[:32]))
    long_prompt = list(range(256 * 1024 + 100))  # 256k tokens: 1,024 chunks of 256 and one tail, never 16k blocks
    assert len(prompt_chunks(namespace, long_prompt, 256, 16)) == 1025


def test_prompt_keys_are_the_ones_pools_already_hold():
    """Keys are what a pool's chunks are found by, across replicas and kvshare versions: pinned values (computed
    with the keys code of 1cba196, before prompt_chunks converted the ids once instead of twice)."""
    plan = prompt_chunks(b"n" * 16, list(range(3, 603)), 256, 16)
    assert plan.counts == [256, 256, 80]
    assert [key.hex() for key in plan.keys] == ["b038899ab4022928effb06d3caf37c9e", "f3fa4739128b91be636a0573d3ae3d43",
                                                "59416edbd2106941413952b31d537485"]


class GatedTransfer:
    """A transfer whose stores wait for a gate: the window between RESERVE and the copies' end, held open."""

    def __init__(self, inner, gate: threading.Event):
        self.inner, self.gate = inner, gate

    def store(self, jobs):
        self.gate.wait(30)
        return self.inner.store(jobs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_tail_is_found_only_after_its_commit(engines):
    """I2 with the storer thread: a store that is still copying (tail included) is invisible to another replica, and
    the engine keeps the blocks it reads until the copies are over (its handle is not done)."""
    _, a, b = engines
    prompt = prompt_of(100, seed=3)  # chunk 0 and a 32-token tail
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        core_a, core_b = attach(a, address).core, attach(b, address).core
        gate = threading.Event()
        core_a._attached.transfer = GatedTransfer(core_a._attached.transfer, gate)
        handle = core_a.store(prompt, list(range(7)), 0, tail=True)
        time.sleep(0.2)  # the storer has reserved and waits at the gate
        assert not handle.done() and core_b.find(prompt, 0) is None
        gate.set()
        core_a.flush()
        assert handle.done()
        hit = core_b.find(prompt, 0)
        assert hit is not None and hit.end == 96 and hit.counts == [CHUNK, 32]
        core_b.release_hit(hit)
