"""A hybrid model (linear-attention state + full-attention K/V) shared through a real pool process: cross-replica
hits give the cache-OFF tokens (I6) only because the state travels with its chunk, and the pair is one unit: a hit
never ends on a chunk whose state is missing, and a corrupt state is recomputed and removed (I11)."""

from __future__ import annotations

import signal
import threading

import pytest

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, generate
from kvshare.engine.pool_connector import PoolConnector
from kvshare.keys import state_key
from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

CHUNK = 64  # a multiple of the linear layers' 64-token blocks and of the engine's 16-token blocks
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
LENGTHS = (2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1)  # k*chunk-1, k*chunk, k*chunk+1


@pytest.fixture
def engines(hybrid_model):
    """Three engines of the tiny hybrid model: a cache-OFF reference and two replicas attached per test."""
    made = [Engine(EngineConfig(model=str(hybrid_model), max_model_len=1024, num_blocks=128)) for _ in range(3)]
    yield made
    for engine in made:
        if engine.connector is not None:
            engine.connector.close()
        engine.shutdown()


def attach(engine: Engine, address: str, **overrides) -> PoolConnector:
    connector = PoolConnector.for_engine(engine, ConnectorConfig(address=address, chunk_tokens=CHUNK, **overrides))
    engine.set_connector(connector)
    return connector


def run(engine: Engine, prompt: list[int], rid: str = "r", sampling: SamplingParams = GREEDY):
    (result,) = generate(engine, [GenerationRequest(f"{rid}-{len(prompt)}-{prompt[0]}", tuple(prompt), sampling)],
                         timeout=120)
    assert result.finished is not None and result.finished.finish_reason != "error", result.finished
    return result.token_ids, result.finished.usage


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(length)]


def expected_hit(length: int) -> int:
    """Whole chunks that end before the prompt's last token: a state exists only at chunk ends."""
    return (length - 1) // CHUNK * CHUNK


@pytest.mark.parametrize(("skip_state", "verify"), [(False, True), (True, True), (False, False)],
                         ids=["state-loaded", "negative-control", "checksums-off"])
def test_cross_replica_hits_give_the_cache_off_tokens_only_with_the_state(engines, skip_state, verify):
    """Replica B loads what A stored: with the state, B's tokens are the cache-OFF ones for every length, with
    checksum verification on and off (the bytes, not the checks, make the answer). The negative control
    (unsafe_skip_state_load: attention K/V loaded, the state not, N tokens still reported cached) is the bug that
    garbled answers elsewhere, and this same test then sees B's tokens differ for every length."""
    off, a, b = engines
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address, verify_checksums=verify)
        connector_b = attach(b, address, unsafe_skip_state_load=skip_state, verify_checksums=verify)
        for length in LENGTHS:
            prompt = prompt_of(length, seed=length)
            reference, _ = run(off, prompt)
            tokens_a, usage_a = run(a, prompt)
            a.connector.core.flush()
            tokens_b, usage_b = run(b, prompt)
            assert usage_a.pool_hit_tokens == 0 and tokens_a == reference
            assert usage_b.pool_hit_tokens == expected_hit(length)
            assert (tokens_b != reference) if skip_state else (tokens_b == reference)  # fp32 on CPU: exact (I6)
        assert connector_b.stats.loads == 3 and connector_b.stats.load_failures == 0


def test_next_turn_hits_chunks_completed_by_generated_tokens(engines):
    """A session's next turn on the other replica: the chunks generated tokens completed carry the state the
    decode steps reached there, and the answer is the cache-OFF one."""
    off, a, b = engines
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        attach(b, address)
        first = prompt_of(100, seed=1)
        answer, _ = run(a, first, sampling=SamplingParams(max_tokens=60, ignore_eos=True))
        a.connector.core.flush()
        second = first + answer + prompt_of(10, seed=2)
        tokens_b, usage_b = run(b, second)
        # A computed first + answer[:-1] = 159 tokens: 2 full chunks, the second ending in generated tokens.
        assert usage_b.pool_hit_tokens == 2 * CHUNK
        assert tokens_b == run(off, second)[0]


def test_a_hit_ends_where_a_state_is_missing_and_never_after_a_missing_chunk(engines):
    """The chunk and its state are one unit: DISCARD the state of chunk 2 and B's hit ends after chunk 1 (chunk 2's
    K/V is there but unusable); DISCARD chunk 1's K/V as well and B's hit ends after chunk 0 (chunk 1's state is
    there but unreachable). Every answer is the cache-OFF one."""
    from kvshare.pool.client import PoolClient

    off, a, b = engines
    prompt = prompt_of(3 * CHUNK + 10, seed=3)
    reference, _ = run(off, prompt)
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        connector_a = attach(a, address)
        attach(b, address)
        run(a, prompt)
        a.connector.core.flush()
        namespace, keys, _ = connector_a.core.chunk_plan(prompt)
        chunk_keys = keys[::2]
        assert keys[1::2] == [state_key(k) for k in chunk_keys]
        with PoolClient.connect(address) as client:
            assert client.discard(namespace.key, [state_key(chunk_keys[2])]) == 1
        tokens, usage = run(b, prompt, rid="no-state-2")
        assert usage.pool_hit_tokens == 2 * CHUNK and tokens == reference
        with PoolClient.connect(address) as client:
            assert client.discard(namespace.key, [chunk_keys[1]]) == 1
        tokens, usage = run(b, prompt, rid="no-chunk-1")
        assert usage.pool_hit_tokens == CHUNK and tokens == reference


def test_a_corrupt_state_is_recomputed_and_discarded(engines):
    """Flip a byte of the state a hit ends on: B's verification fails before any K/V is copied, B recomputes (the
    cache-OFF tokens), and the state is DISCARDed, so A's next store of the prompt replaces it."""
    from kvshare.pool.client import PoolClient

    off, a, b = engines
    prompt = prompt_of(2 * CHUNK + 5, seed=4)
    reference, _ = run(off, prompt)
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        connector_a = attach(a, address)
        connector_b = attach(b, address)
        run(a, prompt)
        a.connector.core.flush()
        namespace, keys, tokens = connector_a.core.chunk_plan(prompt)
        with PoolClient.connect(address) as client:
            lookup = client.lookup(namespace.key, keys, tokens)
            state_pages = lookup.chunks[3].pages  # chunk 1's state: where the hit ends
            client.pages[state_pages[0], 100] ^= 0xFF
            client.release(lookup.lease)
        tokens_b, usage_b = run(b, prompt)
        assert tokens_b == reference and usage_b.pool_hit_tokens == 0
        assert connector_b.stats.corrupt_chunks == 1 and connector_b.stats.discarded_chunks == 1
        run(a, prompt, rid="again")  # A stores the discarded state again
        a.connector.core.flush()
        tokens_b, usage_b = run(b, prompt, rid="after")
        assert tokens_b == reference and usage_b.pool_hit_tokens == 2 * CHUNK


def test_a_pool_killed_mid_store_or_too_small_changes_no_output(engines):
    """A's store is under way when the pool is killed: B then runs with no pool at all, and later against a pool so
    small that every store evicts earlier chunks and states; every answer is the cache-OFF one."""
    off, a, b = engines
    prompts = [prompt_of(3 * CHUNK + 7, seed=s) for s in range(5, 9)]
    references = [run(off, p)[0] for p in prompts]
    with start_pool("64MiB", page_size="64KiB") as (address, process):
        attach(a, address, retry_interval=0.2)
        attach(b, address, retry_interval=0.2)
        run(a, prompts[0])  # its store runs on A's storer thread now
        process.send_signal(signal.SIGKILL)
        process.wait()
        tokens, usage = run(b, prompts[0], rid="down")
        assert tokens == references[0] and usage.pool_hit_tokens == 0
    # 16 pages of 64 KiB: a prompt here is 3 chunks of K/V (16 KiB, a page each) and 3 states (a page each), so the
    # four prompts need 24 pages and storing them evicts the least recently used chunks and states.
    with start_pool("1MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        attach(b, address)
        hits = 0
        for prompt, reference in zip(prompts, references):
            assert run(a, prompt, rid="small")[0] == reference
            a.connector.core.flush()
        for prompt, reference in reversed(list(zip(prompts, references))):  # the most recent first
            tokens, usage = run(b, prompt, rid="small-b")
            assert tokens == reference
            hits += usage.pool_hit_tokens
        evictions = read_stats(address).evictions
    assert evictions > 0 and 0 < hits < sum(expected_hit(len(p)) for p in prompts)


def test_concurrent_requests_share_states_without_mixing_them(engines):
    """Several prompts stored by A, then loaded by B all at once (decoded together, each from its own state slot):
    each gets its own cache-OFF answer."""
    off, a, b = engines
    prompts = [prompt_of(2 * CHUNK + 3 * s, seed=20 + s) for s in range(4)]
    references = [run(off, p)[0] for p in prompts]
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        attach(b, address)
        threads = [threading.Thread(target=run, args=(a, p, "a")) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        a.connector.core.flush()
        requests = [GenerationRequest(f"b{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
        results = generate(b, requests, timeout=120)
        assert [r.token_ids for r in results] == references
        assert [r.finished.usage.pool_hit_tokens for r in results] == [expected_hit(len(p)) for p in prompts]
