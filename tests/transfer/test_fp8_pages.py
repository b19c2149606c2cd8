"""fp8 KV pages through a real pool: an fp8 (e4m3) paged cache packs into the pool's arena and back byte for byte
(the transfer layer moves bytes; every byte pattern, NaN encodings included, survives), its checksums agree, and its
layout id differs from the model-dtype layout of the same shape, so the two can never be read as each other."""

from __future__ import annotations

import numpy as np
import torch

from kvshare.keys import synthetic_keys, tool_namespace
from kvshare.pool.client import NewChunk, PoolClient
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout, LoadJob, StoreJob, arena_pages, make_transfer
from tests.transfer.conftest import make_kv, reference_chunk

PAGE = 64 << 10
FP8 = torch.float8_e4m3fn


def test_fp8_layout_is_half_the_bytes_and_another_layout():
    fp8 = KVLayout(4, 64, 16, 2, 64, FP8)
    bf16 = KVLayout(4, 64, 16, 2, 64, torch.bfloat16)
    assert fp8.block_bytes * 2 == bf16.block_bytes
    assert fp8.layout_id() != bf16.layout_id()


def test_fp8_chunks_round_trip_through_a_real_pool_byte_exact():
    layout = KVLayout(4, 96, 16, 2, 64, FP8)  # 4 KiB blocks: 16 units a 64 KiB page
    layers = make_kv(layout, seed=3)  # random bytes: every fp8 bit pattern, NaN encodings too
    nbytes = layout.chunk_nbytes(128, PAGE)  # chunks of 8 blocks x 4 layers = 32 units = 2 pages
    with start_pool("4MiB", page_size="64KiB") as (address, _), PoolClient.connect(address) as client:
        transfer = make_transfer(layout, layers, arena_pages(client))
        namespace = tool_namespace("test-fp8-pages")
        keys = synthetic_keys("fp8", 3)
        client.hello(namespace)
        reservation = client.reserve(namespace, [NewChunk(key, parent, b"t" * 512, nbytes)
                                                 for key, parent in zip(keys, [namespace] + keys[:2])])
        page_ids = [list(chunk.pages) for chunk in reservation.chunks]
        blocks = [[5, 1, 9, 33, 2, 60, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43, 44, 45, 46, 47]]
        stored = transfer.store([StoreJob(b, p) for b, p in zip(blocks, page_ids)])
        stored.wait()
        client.commit(reservation.lease, stored.checksums())
        packed = [reference_chunk(layout, layers, b) for b in blocks]
        for p, want in zip(page_ids, packed):  # the arena holds exactly the packed fp8 bytes
            assert np.array_equal(np.concatenate([client.pages[page] for page in p])[:nbytes], want)
        targets = [list(range(64 + 8 * c, 72 + 8 * c)) for c in range(3)]
        for layer in layers:
            layer.view(torch.uint8)[64:88] = 0xA5  # poison where the loads go
        loaded = transfer.load([LoadJob(p, t) for p, t in zip(page_ids, targets)], checksums=True)
        loaded.wait()
        assert loaded.checksums() == stored.checksums()
        for t, want in zip(targets, packed):
            assert np.array_equal(reference_chunk(layout, layers, t), want)
