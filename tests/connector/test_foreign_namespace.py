"""A hit found under one namespace is never loaded by a core whose KV is another namespace (I9), even when the pool,
the pages and the checksums are all sound: vLLM's connector finds in its scheduler process and loads in its worker,
and two halves that resolved different KV layouts must cost recompute, never an answer."""

from __future__ import annotations

import dataclasses

import torch

from kvshare.connector import ConnectorConfig, ConnectorCore
from kvshare.engine.engine import Engine
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout
from tests.connector.test_shared_pool import CHUNK, attach, prompt_of, run


def core_on(engine: Engine, address: str, namespace) -> ConnectorCore:
    """A second core on `engine`'s KV tensors, keyed under `namespace` (what a worker half builds for itself)."""
    layout = KVLayout.from_tensors(engine.kv_caches, kind="packed_kv", block_size=engine.block_size)
    core = ConnectorCore(ConnectorConfig(address=address, chunk_tokens=CHUNK), namespace,
                         block_tokens=engine.block_size)
    core.attach(layout, engine.kv_caches)
    return core


def test_a_hit_of_another_namespace_is_refused_and_its_blocks_stay_untouched(engines):
    _, a, b = engines
    prompt = prompt_of(3 * CHUNK + 1, seed=3)
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        finder = attach(a, address).core
        run(a, prompt)
        finder.flush()
        # The same model, dtype and chunk size, another KV layout: what a scheduler half that resolved "NHD" and a
        # worker whose attention backend forced "HND" would each build.
        base = finder.namespace()
        foreign = core_on(b, address, dataclasses.replace(base, layout_id=base.layout_id + "|other-layout"))
        same = core_on(b, address, base)
        blocks = list(range(4 * CHUNK // b.block_size))
        try:
            before = [t.clone() for t in b.kv_caches]
            hit = finder.find(prompt, 0)
            assert hit is not None and hit.end == 3 * CHUNK
            assert foreign.start_load(hit, blocks, 0, release=False).finish() is False
            assert all(torch.equal(x, y) for x, y in zip(before, b.kv_caches))  # not one byte written
            assert foreign.stats.errors == 1 and foreign.stats.loads == 0
            # The salt is part of the namespace: an unsalted hit is not a salted request's.
            assert same.start_load(hit, blocks, 0, release=False, salt="tenant-a").finish() is False
            assert all(torch.equal(x, y) for x, y in zip(before, b.kv_caches))
            # The control: the same hit loads into a core of the finder's namespace, so the refusals above are the
            # namespace's doing, not the hit's.
            assert same.start_load(hit, blocks, 0, release=False).finish() is True
            assert not all(torch.equal(x, y) for x, y in zip(before, b.kv_caches))
            finder.release_hit(hit)
        finally:
            foreign.close()
            same.close()
