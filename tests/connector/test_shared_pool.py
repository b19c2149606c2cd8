"""The connector core between real engines and a real pool process: cross-replica hits equal cache OFF (I6), chunks
completed by generated tokens are shared, and a pool that dies or restarts changes no output (I7)."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, generate
from kvshare.engine.pool_connector import PoolConnector
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout, arena_pages

CHUNK = 32
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def attach(engine: Engine, address: str, **overrides) -> PoolConnector:
    connector = PoolConnector.for_engine(engine, ConnectorConfig(address=address, chunk_tokens=CHUNK, **overrides))
    engine.set_connector(connector)
    return connector


def run(engine: Engine, prompt: list[int], sampling: SamplingParams = GREEDY, rid: str = "r"):
    request = GenerationRequest(f"{rid}-{len(prompt)}-{prompt[0]}", tuple(prompt), sampling)
    (result,) = generate(engine, [request], timeout=120)
    assert result.finished is not None and result.finished.finish_reason != "error", result.finished
    return result.token_ids, result.finished.usage


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(length)]


@pytest.mark.parametrize("host_hash, verify, waves",
                         [("numpy", True, 4), ("compiled", True, 1), ("compiled", False, 4)])
def test_cross_replica_hits_give_the_cache_off_tokens(engines, host_hash, verify, waves, monkeypatch):
    """Also with the host checksum's C loop (KVSHARE_HOST_HASH=compiled, built before the engines hash anything), with
    B not verifying (`--no-verify-checksums`), and with B loading in layer waves (the forward reading each layer as
    it lands) or whole (`--load-waves 1`): the answers are the cache-OFF ones every way."""
    from kvshare.transfer import fused_hash

    monkeypatch.setenv("KVSHARE_HOST_HASH", host_hash)
    fused_hash.prepare()
    off, a, b = engines
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        connector_b = attach(b, address, verify_checksums=verify, load_waves=waves)
        # Lengths: partial tails (70, 129), an exact multiple (96: the last chunk must stay uncached for logits).
        for length in (70, 96, 129):
            prompt = prompt_of(length, seed=length)
            reference, _ = run(off, prompt)
            tokens_a, usage_a = run(a, prompt)
            a.connector.core.flush()
            tokens_b, usage_b = run(b, prompt)
            assert usage_a.pool_hit_tokens == 0
            # Every whole engine block (16 tokens) before the last token: full chunks, a tail, a chunk's prefix.
            assert usage_b.pool_hit_tokens == (length - 1) // 16 * 16
            assert tokens_a == reference and tokens_b == reference  # fp32 on CPU: exact (I6)
        assert connector_b.stats.loads == 3 and connector_b.stats.load_failures == 0


def test_a_prompt_over_the_lease_limit_stores_the_chunks_that_fit(engines):
    """RESERVE is all or nothing: a prompt whose KV exceeds the pool's per-client lease limit must still store its
    first chunks (what a reader's shortened LOOKUP can load), not nothing."""
    off, a, b = engines
    pages_per_chunk = -(-KVLayout.from_tensors(a.kv_caches, kind="packed_kv", block_size=a.block_size)
                        .chunk_nbytes(CHUNK, 64 * 1024) // (64 * 1024))
    prompt = prompt_of(4 * CHUNK + 1, seed=5)  # four full chunks
    with start_pool("64MiB", page_size="64KiB", max_leased_pages_per_client=2 * pages_per_chunk) as (address, _):
        connector_a = attach(a, address)
        attach(b, address)
        reference, _ = run(off, prompt)
        tokens_a, _ = run(a, prompt)
        a.connector.core.flush()
        tokens_b, usage_b = run(b, prompt)
    assert connector_a.stats.store_limited_chunks == 2 and connector_a.stats.stores == 2
    assert usage_b.pool_hit_tokens == 2 * CHUNK
    assert tokens_a == reference and tokens_b == reference


def test_next_turn_hits_chunks_stored_from_generated_tokens(engines):
    off, a, b = engines
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        attach(b, address)
        first = prompt_of(40, seed=1)
        answer, _ = run(a, first, SamplingParams(max_tokens=60, ignore_eos=True))
        a.connector.core.flush()
        second = first + answer + prompt_of(10, seed=2)  # the session's next turn, on the other replica
        tokens_b, usage_b = run(b, second)
        # A holds KV for first + answer[:-1] = 99 tokens -> 3 full chunks, 2 of them made of generated tokens.
        assert usage_b.pool_hit_tokens == 96
        assert tokens_b == run(off, second)[0]


def test_a_pool_that_dies_or_restarts_changes_no_output(engines):
    off, a, b = engines
    socket_path = os.path.join(tempfile.mkdtemp(prefix="kvshare-restart-"), "pool.sock")
    before, during, after = (prompt_of(100, seed=s) for s in (11, 12, 13))
    with start_pool("64MiB", page_size="64KiB", socket=socket_path) as (address, process):
        attach(a, address, retry_interval=0.2)
        attach(b, address, retry_interval=0.2)
        run(a, before)
        a.connector.core.flush()
        assert run(b, before)[1].pool_hit_tokens == 96
        process.send_signal(signal.SIGKILL)
        process.wait()
        for engine in (a, b):  # no pool at all: every request succeeds with the cache-OFF tokens
            tokens, usage = run(engine, during, rid=f"down-{id(engine)}")
            assert tokens == run(off, during)[0] and usage.pool_hit_tokens == 0
    with start_pool("64MiB", page_size="64KiB", socket=socket_path) as (address, _):
        # A new pool life: nothing from the old arena may be served; the replicas reconnect on their own.
        import time

        time.sleep(0.3)  # past retry_interval
        tokens, usage = run(b, before, rid="after-restart")
        assert usage.pool_hit_tokens == 0 and tokens == run(off, before)[0]
        run(a, after)
        a.connector.core.flush()
        tokens, usage = run(b, after)
        assert usage.pool_hit_tokens == 96 and tokens == run(off, after)[0]


@pytest.mark.parametrize("verify, host_hash, page", [(True, "numpy", "64KiB"), (False, "numpy", "64KiB"),
                                                      (True, "compiled", "256KiB")])
def test_corrupted_pool_bytes_are_recomputed_only_when_checksums_are_verified(engines, verify, host_hash, page,
                                                                              monkeypatch):
    """Flip bytes in every page after A stored: a verifying B recomputes (the cache-OFF tokens, no pool hit); with
    verify_checksums=False (`kvshare serve --no-verify-checksums`) B trusts and loads them. The compiled host
    checksum (KVSHARE_HOST_HASH, pages of whole coefficient blocks) catches them as numpy does."""
    from kvshare.pool.client import PoolClient, read_stats
    from kvshare.transfer import fused_hash

    monkeypatch.setenv("KVSHARE_HOST_HASH", host_hash)
    hashed = []
    real = fused_hash.chunk_checksum
    monkeypatch.setattr(fused_hash, "chunk_checksum", lambda *args: hashed.append(args[2]) or real(*args))
    fused_hash.prepare()  # "compiled": compiled (once a process) before the engines' transfers hash anything
    off, a, b = engines
    prompt = prompt_of(100, seed=5)
    with start_pool("64MiB", page_size=page) as (address, _):
        attach(a, address)
        attach(b, address, verify_checksums=verify)
        reference, _ = run(off, prompt)
        run(a, prompt)
        a.connector.core.flush()
        with PoolClient.connect(address) as client:
            arena_pages(client).view(-1)[::512] += 1
        tokens_b, usage_b = run(b, prompt, rid="b")
        b.connector.core.flush()
        pool = read_stats(address)
    if verify:
        assert usage_b.pool_hit_tokens == 0 and tokens_b == reference
        assert b.connector.stats.errors >= 1
        # I11: the corrupt chunks left the pool after that one failed load, so B's own store of the recomputed
        # prompt replaced them (without DISCARD its RESERVE would skip them as already stored).
        assert b.connector.stats.corrupt_chunks == b.connector.stats.discarded_chunks == 3
        assert pool.discarded_chunks == 3 and pool.chunks == 3
        assert b.connector.stats.stores == 3 and b.connector.stats.store_skipped_chunks == 0
    else:
        assert usage_b.pool_hit_tokens == 96
        assert pool.discarded_chunks == 0
    assert len(hashed) == (9 if host_hash == "compiled" else 0)  # A stores 3, B loads 3, B stores 3 recomputed
