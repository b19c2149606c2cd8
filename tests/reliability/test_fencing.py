"""Fenced leases end to end (I10): a writer or a reader stalled (SIGSTOP) past its lease, resumed after others stored
into the pool, cannot change what anyone loads. Replicas here do not verify checksums (`--no-verify-checksums`, as in
the H200 runs), so nothing but the fence stands between a stalled process and their answers; a verifying replica
then checks that every committed chunk still holds what its committer wrote.

The stalled processes speak the pool protocol through PoolClient, as the connector does: RESERVE (or LOOKUP), then
stop, then copy and COMMIT (or RELEASE). Before fencing, an expired lease's pages went straight back to the free
stack, the next store got exactly those pages, and the resumed writer wrote over them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, generate
from kvshare.engine.pool_connector import PoolConnector
from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout

CHUNK = 32
PAGE = 64 * 1024
LEASE_TIMEOUT = 1.0
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)

# A stalled pool client: `python -c STALLER <address> <mode> <args...>`. It prints one line when its lease is
# granted, stops itself (the test sends SIGCONT), then finishes what it started and prints the outcome.
STALLER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from kvshare.pool.client import NewChunk, PoolClient, PoolError
    address, mode = sys.argv[1], sys.argv[2]
    with PoolClient.connect(address) as client:
        if mode == "writer":  # RESERVE, stall, then write noise into every reserved page and COMMIT
            namespace, chunks, nbytes = bytes(16), int(sys.argv[3]), int(sys.argv[4])
            client.hello(namespace, "stalled writer")
            keys = [os.urandom(16) for _ in range(chunks)]
            parents = [namespace] + keys[:-1]
            r = client.reserve(namespace, [NewChunk(k, p, b"", nbytes) for k, p in zip(keys, parents)])
            print("reserved", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            for ref in r.chunks:
                client.write(ref, np.random.default_rng(1).integers(0, 256, ref.nbytes, dtype=np.uint8))
            try:
                client.commit(r.lease, [0] * len(r.chunks))
                print("committed", flush=True)
            except PoolError as error:
                print(error.code, flush=True)
        else:  # "reader": LOOKUP, read, stall, read again: the bytes must not have changed under the lease
            namespace, keys, tokens = bytes.fromhex(sys.argv[3]), sys.argv[4].split(","), sys.argv[5].split(",")
            found = client.lookup(namespace, [bytes.fromhex(k) for k in keys], [bytes.fromhex(t) for t in tokens])
            before = [client.read(ref).tobytes() for ref in found.chunks]
            print(f"leased {len(found.chunks)}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            after = [client.read(ref).tobytes() for ref in found.chunks]
            print("same" if after == before else "changed", flush=True)
            client.release(found.lease)
""")


def staller(address: str, *args: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", STALLER, address, *args], stdout=subprocess.PIPE, text=True)
    first = process.stdout.readline().strip()
    assert first in ("reserved",) or first.startswith("leased"), first
    _wait_stopped(process.pid)
    return process


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def resume(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGCONT)
    out, _ = process.communicate(timeout=30)
    return out.strip()


def wait_for(condition, what: str, seconds: float = 15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def engines(tiny_model):
    """off: no pool; a, b: pool replicas that trust the pool's bytes; checker: a replica that verifies them."""
    made = {name: Engine(EngineConfig(model=str(tiny_model), max_model_len=512, num_blocks=128))
            for name in ("off", "a", "b", "checker")}
    yield made
    for engine in made.values():
        if engine.connector is not None:
            engine.connector.close()
        engine.shutdown()


def attach(engine: Engine, address: str, verify: bool) -> PoolConnector:
    config = ConnectorConfig(address=address, chunk_tokens=CHUNK, verify_checksums=verify)
    connector = PoolConnector.for_engine(engine, config)
    engine.set_connector(connector)
    return connector


def run(engine: Engine, prompt: list[int]):
    (result,) = generate(engine, [GenerationRequest(f"r{id(engine)}-{prompt[0]}-{len(prompt)}", tuple(prompt), GREEDY)],
                         timeout=120)
    assert result.finished is not None and result.finished.finish_reason != "error", result.finished
    return result.token_ids, result.finished.usage


def prompt_of(seed: int, chunks: int = 3) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(chunks * CHUNK + 1)]


def chunk_pages(engine: Engine) -> tuple[int, int]:
    """(bytes, pages) of one chunk of this model in a pool of PAGE-byte pages."""
    layout = KVLayout.from_tensors(engine.kv_caches, kind="packed_kv", block_size=engine.block_size)
    nbytes = layout.chunk_nbytes(CHUNK, PAGE)
    return nbytes, -(-nbytes // PAGE)


def assert_every_answer_is_cache_off(engines: dict, address: str, prompts: list[list[int]]) -> None:
    """b (trusting) answers each prompt exactly as the cache-OFF replica, and a verifying replica finds every chunk
    of them intact: loaded, no checksum failure."""
    for prompt in prompts:
        reference, _ = run(engines["off"], prompt)
        assert run(engines["b"], prompt)[0] == reference
        assert run(engines["checker"], prompt)[0] == reference
    stats = engines["checker"].connector.stats
    assert stats.corrupt_chunks == 0 and stats.loads >= 1, stats


def test_a_writer_stalled_past_its_lease_cannot_overwrite_pages_handed_on(engines):
    nbytes, pages = chunk_pages(engines["a"])
    with start_pool("4MiB", page_size=PAGE, lease_timeout=LEASE_TIMEOUT) as (address, _):
        for name, verify in (("a", False), ("b", False), ("checker", True)):
            attach(engines[name], address, verify)
        writer = staller(address, "writer", "3", str(nbytes))
        wait_for(lambda: read_stats(address).fenced_leases, "the stalled writer's lease to expire")
        assert read_stats(address).pages_quarantined == 3 * pages
        prompt = prompt_of(1)
        run(engines["a"], prompt)  # stores 3 chunks: before fencing, onto exactly the expired lease's pages
        engines["a"].connector.core.flush()
        assert resume(writer) == "lease_expired"  # it wrote its noise, then its COMMIT was refused
        assert read_stats(address).pages_quarantined == 0  # and that COMMIT freed its pages
        assert_every_answer_is_cache_off(engines, address, [prompt])


def test_a_reader_stalled_past_its_lease_keeps_its_chunks_from_being_reused(engines):
    nbytes, pages = chunk_pages(engines["a"])
    pool_chunks = 8  # three prompts of three chunks do not fit: storing the later ones must evict
    with start_pool(str(pool_chunks * pages * PAGE), page_size=PAGE, lease_timeout=LEASE_TIMEOUT,
                    max_leased_pages_per_client=0) as (address, _):
        for name, verify in (("a", False), ("b", False), ("checker", True)):
            attach(engines[name], address, verify)
        first = prompt_of(1)
        run(engines["a"], first)
        engines["a"].connector.core.flush()
        namespace, keys, tokens = engines["a"].connector.core.chunk_plan(first)
        reader = staller(address, "reader", namespace.key.hex(), ",".join(k.hex() for k in keys),
                         ",".join(t.hex() for t in tokens))
        wait_for(lambda: read_stats(address).fenced_leases, "the stalled reader's lease to expire")
        later = [prompt_of(seed) for seed in (2, 3)]
        for prompt in later:  # before fencing, these evicted the first prompt's chunks and reused their pages
            run(engines["a"], prompt)
            engines["a"].connector.core.flush()
        assert read_stats(address).chunks >= 3  # the first prompt's chunks are still there
        assert resume(reader) == "same"
        wait_for(lambda: not read_stats(address).fenced_leases, "the fence to end with the reader's exit")
        assert_every_answer_is_cache_off(engines, address, [first, *later])


def test_a_fenced_lease_ends_when_its_holder_is_killed(engines):
    """I8 with I10: a stalled holder that never resumes loses its pages when its process is gone."""
    nbytes, pages = chunk_pages(engines["a"])
    with start_pool("4MiB", page_size=PAGE, lease_timeout=LEASE_TIMEOUT) as (address, _):
        writer = staller(address, "writer", "2", str(nbytes))
        wait_for(lambda: read_stats(address).fenced_leases, "the stalled writer's lease to expire")
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(10)
        stats = wait_for(lambda: (s := read_stats(address)).fenced_leases == 0 and s, "the fence to end")
        assert stats.pages_quarantined == 0 and stats.pages_free == stats.num_pages
