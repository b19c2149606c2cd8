"""Model identity (I9) through real processes: two models made with the same preset and different seeds have the same
config.json and different weights; a `kvshare serve` replica of the second, on a pool holding the first one's KV for
a prompt, must find none of it and answer exactly as it does with the cache OFF."""

from __future__ import annotations

import time

import pytest

from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

from .conftest import complete, kvshare_serve, local_hits, pool_hits, prompt_ids, running

pytestmark = pytest.mark.slow

CHUNKS = 4  # full 32-token chunks of the 160-token prompt that carry KV (the last prompt token is computed last)


def wait_for_chunks(address: str, at_least: int, timeout_s: float = 30.0) -> None:
    """Stores commit on a background thread after the answer: wait until the pool holds them."""
    deadline = time.monotonic() + timeout_s
    while read_stats(address).chunks < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_stats(address).chunks >= at_least, read_stats(address)


def test_same_config_different_weights_never_share(generated_model):
    first, second = generated_model(seed=0), generated_model(seed=1)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()  # the premise
    ids = prompt_ids(17)
    with start_pool("8MiB", page_size="64KiB") as (address, _):
        replicas = kvshare_serve(first, address), kvshare_serve(second, address), kvshare_serve(second, "none")
        with running(*replicas) as (a, b, b_off):
            complete(a.url, ids, max_tokens=8)
            wait_for_chunks(address, CHUNKS)  # the pool now holds the first model's KV for the prompt
            hits_before = read_stats(address).hit_tokens
            answer = complete(b.url, ids, max_tokens=8)
            assert pool_hits(answer) == 0 and local_hits(answer) == 0
            assert read_stats(address).hit_tokens == hits_before  # not even a pool-side match
            assert answer["choices"][0]["text"] == complete(b_off.url, ids, max_tokens=8)["choices"][0]["text"]
