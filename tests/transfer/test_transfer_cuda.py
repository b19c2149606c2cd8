"""CUDA ordering (I4, I5): stores under a delayed producer and loads under a delayed side stream are exact with
ordering="stream" and wrong with ordering="none" (so these tests can fail); checksums computed on the GPU from the
staging slots equal the host's over the arena. Skipped without CUDA."""

import numpy as np
import pytest
import torch

from kvshare.transfer import KINDS, SKIP, KVLayout, LoadJob, StoreJob, TransferOptions, make_transfer
from tests.transfer.conftest import make_kv, reference_chunk

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SLEEP = 50_000_000  # ~25 ms of GPU time: far longer than the copies below
PAGE = 64 << 10


def _setup(arena, ordering, kind="packed_kv", delay=0, fused=True, priority="normal"):
    layout = KVLayout(4, 64, 16, 2, 64, torch.bfloat16, kind=kind)  # 8 KiB blocks, 8 units a page
    layers = make_kv(layout, device="cuda", fused=fused)
    pages = arena(64, PAGE)
    options = TransferOptions(ordering=ordering, side_delay_cycles=delay, staging_bytes=2 * PAGE,
                              stream_priority=priority)
    return layout, layers, pages, make_transfer(layout, layers, pages, options=options)


def _stored(layout, pages, page_ids, bpc):
    nbytes = layout.chunk_nbytes(bpc * layout.block_size, PAGE)
    used = layout.units_per_page(PAGE) * layout.block_bytes
    return np.concatenate([pages[p, : min(used, nbytes - k * PAGE)].numpy() for k, p in enumerate(page_ids)])


def _store_under_delay(arena, ordering, priority="normal"):
    layout, layers, pages, transfer = _setup(arena, ordering, priority=priority)
    blocks, page_ids = list(range(8)), list(range(4))  # 8 blocks x 4 layers = 32 units = 4 pages
    fresh = [torch.randint(0, 256, (8, layout.block_bytes), dtype=torch.uint8, device="cuda") for _ in layers]
    torch.cuda._sleep(SLEEP)  # the producer is late ...
    for layer, data in zip(layers, fresh):
        layer.view(torch.uint8).view(layout.num_blocks, -1)[:8] = data  # ... writing the KV the store reads
    handle = transfer.store([StoreJob(blocks, page_ids)])
    handle.wait()
    torch.cuda.synchronize()
    exact = np.array_equal(_stored(layout, pages, page_ids, 8), reference_chunk(layout, layers, blocks))
    nbytes = layout.chunk_nbytes(8 * layout.block_size, PAGE)
    return exact and handle.checksums() == [transfer.checksum(page_ids, nbytes)]  # hashed what was copied


def _load_under_delay(arena, ordering, priority="normal"):
    layout, layers, pages, transfer = _setup(arena, ordering, delay=SLEEP, priority=priority)
    torch.cuda.synchronize()  # the KV is written before this store even with ordering="none"
    stored = transfer.store([StoreJob(list(range(8)), list(range(4)))]).checksums()
    targets = list(range(32, 40))
    for layer in layers:
        layer.view(torch.uint8).view(layout.num_blocks, -1)[32:40] = 0xA5  # poison
    handle = transfer.load([LoadJob(list(range(4)), [SKIP] + targets[1:])], checksums=True)
    seen = [layer.view(torch.uint8).view(layout.num_blocks, -1)[32:40].clone() for layer in layers]  # consumer
    torch.cuda.synchronize()
    want = [layer.view(torch.uint8).view(layout.num_blocks, -1)[:8] for layer in layers]
    loaded = all(torch.equal(s[1:], w[1:]) for s, w in zip(seen, want))
    skipped_kept = all(bool((s[0] == 0xA5).all()) for s in seen)
    assert handle.checksums() == stored  # the hash waited for the delayed copy, in either ordering mode
    return loaded, skipped_kept


@pytest.mark.parametrize("priority", ["normal", "high"])
def test_store_waits_for_the_producer(arena, priority):
    assert all(_store_under_delay(arena, "stream", priority) for _ in range(5))


def test_store_without_ordering_reads_stale_kv(arena):
    assert not any(_store_under_delay(arena, "none") for _ in range(3))


@pytest.mark.parametrize("priority", ["normal", "high"])
def test_load_is_ordered_before_the_consumer(arena, priority):
    for _ in range(5):
        assert _load_under_delay(arena, "stream", priority) == (True, True)


def test_high_priority_side_streams_outrank_the_callers(arena):
    *_, transfer = _setup(arena, "stream", priority="high")
    default = torch.cuda.current_stream().priority
    side = [transfer.gather_stream, transfer.copy_stream] + ([transfer.hasher.stream] if transfer.hasher else [])
    assert all(stream.priority < default for stream in side)  # lower is higher in CUDA
    *_, normal = _setup(arena, "stream")
    assert normal.gather_stream.priority == default


def test_load_without_ordering_is_seen_unfinished(arena):
    assert not any(_load_under_delay(arena, "none")[0] for _ in range(3))


def _layered_load_under_delay(arena, ordering):
    """A load in 2 waves (layers 0-1, then 2-3: one 64 KiB page each), each wave's copies late by SLEEP: what a
    consumer of layer 0 sees after wait_layer(0), what one of layer 3 sees after only that wait, and after
    wait_layer(3); and whether the checksums of the bytes read are the stored ones."""
    layout, layers, pages, transfer = _setup(arena, ordering, delay=SLEEP)
    torch.cuda.synchronize()
    stored = transfer.store([StoreJob(list(range(8)), list(range(4)))]).checksums()
    rows = [layer.view(torch.uint8).view(layout.num_blocks, -1) for layer in layers]
    for row in rows:
        row[32:40] = 0xA5  # poison
    handle = transfer.load([LoadJob(list(range(4)), list(range(32, 40)))], checksums=True, waves=2)
    handle.wait_layer(0)
    first = rows[0][32:40].clone()  # consumer of layer 0
    early_last = rows[3][32:40].clone()  # a reader of layer 3 that waited for layer 0 only
    handle.wait_layer(3)
    last = rows[3][32:40].clone()
    torch.cuda.synchronize()
    return (torch.equal(first, rows[0][:8]), bool((early_last == 0xA5).all()), torch.equal(last, rows[3][:8]),
            handle.checksums() == stored)


def test_layered_load_orders_each_layer_before_its_consumer(arena):
    for _ in range(3):
        assert _layered_load_under_delay(arena, "stream") == (True, True, True, True)


def test_layered_load_without_ordering_is_seen_unfinished(arena):
    assert not any(_layered_load_under_delay(arena, "none")[0] for _ in range(3))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fused", [True, False])
def test_cuda_round_trip_every_kind(arena, kind, fused):
    layout, layers, pages, transfer = _setup(arena, "stream", kind=kind, fused=fused)
    rng = np.random.default_rng(1)
    ids = rng.permutation(layout.num_blocks)[:48].tolist()  # 3 chunks of 8 blocks, stored then loaded elsewhere
    page_ids = rng.permutation(64)[:12].reshape(3, 4).tolist()
    transfer.store([StoreJob(ids[c * 8 : (c + 1) * 8], page_ids[c]) for c in range(3)]).wait()
    for c in range(3):
        assert np.array_equal(_stored(layout, pages, page_ids[c], 8),
                              reference_chunk(layout, layers, ids[c * 8 : (c + 1) * 8]))
    transfer.load([LoadJob(page_ids[c], ids[24 + c * 8 : 24 + (c + 1) * 8]) for c in range(3)])
    for c in range(3):  # no synchronize: the current stream is ordered after the load (I5)
        assert np.array_equal(reference_chunk(layout, layers, ids[24 + c * 8 : 24 + (c + 1) * 8]),
                              reference_chunk(layout, layers, ids[c * 8 : (c + 1) * 8]))
    want = reference_chunk(layout, layers, ids[:24])
    for layer in layers:
        layer.zero_()  # then again in 3 waves, each layer read after its wait only
    handle = transfer.load([LoadJob(page_ids[c], ids[24 + c * 8 : 24 + (c + 1) * 8]) for c in range(3)], waves=3)
    for layer in range(layout.num_layers):
        handle.wait_layer(layer)
    assert np.array_equal(reference_chunk(layout, layers, ids[24:48]), want)


# 3 heads: 12 KiB blocks, 5 a page, so pages have tails and the last is partial
@pytest.mark.parametrize("heads", [2, 3])
def test_device_checksums_equal_the_host_ones(arena, heads):
    layout = KVLayout(4, 64, 16, heads, 64, torch.bfloat16)
    layers = make_kv(layout, device="cuda")
    pages = arena(64, PAGE)
    pages.fill_(0xEE)  # old bytes in the tails: the store must zero them
    device = make_transfer(layout, layers, pages, options=TransferOptions(staging_bytes=2 * PAGE))
    host = make_transfer(layout, layers, pages, options=TransferOptions(staging_bytes=2 * PAGE, checksums="host"))
    assert device.hasher is not None and host.hasher is None
    need, nbytes = layout.pages_needed(128, PAGE), layout.chunk_nbytes(128, PAGE)
    rng = np.random.default_rng(2)
    page_ids = rng.permutation(64)[: 3 * need].reshape(3, need).tolist()
    blocks = rng.permutation(layout.num_blocks)[:48].tolist()
    stores = [StoreJob(blocks[c * 8 : (c + 1) * 8], page_ids[c]) for c in range(3)]
    stored = device.store(stores).checksums()
    assert stored == [device.checksum(p, nbytes) for p in page_ids]  # the pool's view of the arena, tails included
    assert host.store(stores).checksums() == stored
    loads = [LoadJob(page_ids[c], blocks[24 + c * 8 : 24 + (c + 1) * 8]) for c in range(3)]
    assert device.load(loads, checksums=True).checksums() == stored
    assert host.load(loads, checksums=True).checksums() == stored
    pages[page_ids[1][-1], 5] ^= 0x40  # a corrupted byte in chunk 1's last page
    loaded = device.load(loads, checksums=True).checksums()
    assert loaded[1] != stored[1] and loaded[0] == stored[0] and loaded[2] == stored[2]


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("slot_pages", [2, 4])
def test_chunks_whose_pages_straddle_registration_pieces_are_exact(arena, ahead, slot_pages):
    """The arena registered in pieces of 2 pages: chunks on adjacent pages that cross piece boundaries (inside one
    staging slot and between slots) store and load byte for byte, whether the pieces were registered in the
    background from the start or only when the transfer first needed them (then only those)."""
    layout = KVLayout(4, 64, 16, 2, 64, torch.bfloat16)  # 8 KiB blocks, 8 units a 64 KiB page, no tail
    layers = make_kv(layout, device="cuda")
    pages = arena(20, PAGE)
    options = TransferOptions(staging_bytes=slot_pages * PAGE, register_piece_bytes=2 * PAGE, register_ahead=ahead)
    transfer = make_transfer(layout, layers, pages, options=options)
    assert transfer.pieces.pages_per_piece == 2 and transfer.pieces.count == 10
    page_ids = [[1, 2, 3, 4], [7, 8, 9, 10], [15, 16, 17, 14]]  # pieces 0-5, 7, 8; never 6 (pages 12-13) or 9
    blocks = [list(range(c * 8, (c + 1) * 8)) for c in range(3)]
    stored = transfer.store([StoreJob(b, p) for b, p in zip(blocks, page_ids)]).checksums()
    for b, p in zip(blocks, page_ids):
        assert np.array_equal(_stored(layout, pages, p, 8), reference_chunk(layout, layers, b))
    targets = [list(range(32 + c * 8, 32 + (c + 1) * 8)) for c in range(3)]
    loaded = transfer.load([LoadJob(p, t) for p, t in zip(page_ids, targets)], checksums=True)
    for b, t in zip(blocks, targets):  # no synchronize: the current stream is ordered after the load (I5)
        assert np.array_equal(reference_chunk(layout, layers, t), reference_chunk(layout, layers, b))
    assert loaded.checksums() == stored
    if ahead:
        transfer.registration.wait_all()
    assert transfer.registration.registered() == (10 if ahead else 8)
