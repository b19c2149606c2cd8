"""Fixtures for pool tests: a real `kvshare pool serve` process on a temp socket, stopped and cleaned up after."""

from __future__ import annotations

import os

import pytest
import xxhash

from kvshare.keys import chunk_keys, token_bytes
from kvshare.pool.client import NewChunk, PoolClient
from kvshare.pool.testing import start_pool

NS = xxhash.xxh3_128_digest(b"tests/pool/namespace")
PAGE = 1 << 20


@pytest.fixture
def pool_server():
    """Address of a fresh 64 MiB pool (1 MiB pages, integrity checked after every request)."""
    with start_pool("64MiB", page_size=PAGE) as (address, _process):
        yield address


@pytest.fixture(scope="module")
def shared_pool():
    """One 64 MiB pool for a whole test module (starting a server costs seconds); tests keep apart by namespace."""
    with start_pool("64MiB", page_size=PAGE) as (address, _process):
        yield address


@pytest.fixture
def ns(request) -> bytes:
    """A namespace key of this test's own, so tests sharing a pool never see each other's chunks."""
    return xxhash.xxh3_128_digest(request.node.nodeid.encode())


@pytest.fixture
def client(shared_pool, ns):
    with PoolClient.connect(shared_pool) as c:
        c.hello(ns, "tests")
        yield c


class Clock:
    """A settable clock for PoolState (lease deadlines) in tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt(n_chunks: int, chunk_tokens: int = 16, seed: int = 0, ns: bytes = NS) -> tuple[list[bytes], list[bytes]]:
    """(keys, token bytes per chunk) of a deterministic prompt of n_chunks full chunks in namespace `ns`."""
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(n_chunks * chunk_tokens)]
    keys = chunk_keys(ns, tokens, chunk_tokens)
    return keys, [token_bytes(tokens[i * chunk_tokens : (i + 1) * chunk_tokens]) for i in range(n_chunks)]


def new_chunks(keys: list[bytes], tokens: list[bytes], nbytes: int, first_parent: bytes = NS) -> list[NewChunk]:
    parents = [first_parent] + keys[:-1]
    return [NewChunk(k, p, t, nbytes) for k, p, t in zip(keys, parents, tokens)]


def random_bytes(n: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("kvshare-")}
