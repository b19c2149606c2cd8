"""Tenants: `cache_salt` enters the namespace, so two tenants with identical prompts never share pool chunks, while
one tenant's requests do hit across replicas. Through two real `kvshare serve` replicas and a real pool."""

from __future__ import annotations

import pytest

from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

from .conftest import complete, kvshare_serve, local_hits, pool_hits, prompt_ids, running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_replicas(tiny_model):
    with start_pool("8MiB", page_size="64KiB") as (address, _):
        with running(kvshare_serve(tiny_model, address), kvshare_serve(tiny_model, address)) as (a, b):
            yield address, a.url, b.url


def test_identical_prompts_of_two_tenants_never_share_pool_chunks(two_replicas):
    address, a, b = two_replicas
    ids = prompt_ids(100)
    first = complete(a, ids, salt="tenant-1")  # stored under tenant-1's namespace
    before = read_stats(address).hit_tokens
    other = complete(b, ids, salt="tenant-2")  # B has never seen these tokens: only the pool could answer
    assert pool_hits(other) == 0 and local_hits(other) == 0
    assert read_stats(address).hit_tokens == before  # not even a pool-side hit
    assert other["choices"][0]["text"] == first["choices"][0]["text"]  # isolation changes no answer
    complete(b, prompt_ids(101))  # no salt is a namespace of its own too
    assert pool_hits(complete(a, prompt_ids(101), salt="tenant-1")) == 0


def test_one_tenant_hits_across_replicas(two_replicas):
    _, a, b = two_replicas
    ids = prompt_ids(200)
    complete(a, ids, salt="tenant-1")
    again = complete(b, ids, salt="tenant-1")
    assert pool_hits(again) >= 128  # 4 of the prompt's 5 full 32-token chunks at least (the last may be the tail)


def test_local_prefix_cache_is_per_tenant(two_replicas):
    _, a, _ = two_replicas
    ids = prompt_ids(300)
    complete(a, ids, salt="tenant-1")
    assert local_hits(complete(a, ids, salt="tenant-2")) == 0
