"""The compiled host checksum (kvshare.transfer.fused_hash): the numpy path's bits for every chunk shape it takes,
only the extent's bytes counted, pages outside the arena refused, hashing threads that run it without the GIL, and
a CPU transfer that uses it once it is built."""

import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvshare import checksum
from kvshare.transfer import KVLayout, LoadJob, StoreJob, fused_hash, make_transfer
from tests.transfer.conftest import make_kv

BLOCK_BYTES = checksum.BLOCK_WORDS * checksum.WORD  # 256 KiB: one coefficient block


@pytest.fixture(scope="module")
def compiled():
    """The kernel, built once for this module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSHARE_HOST_HASH", "compiled")
        fused_hash.prepare()
        assert fused_hash.available()
        yield


def _arena(num_pages: int, page_size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(num_pages, page_size), dtype=np.uint8)


@pytest.mark.parametrize("page_size", [4096, 64 << 10, BLOCK_BYTES, 3 * BLOCK_BYTES + 4096, 8 * BLOCK_BYTES])
@pytest.mark.parametrize("shape", ["whole pages", "last page mid-block", "last page one word", "one page, part"])
def test_equal_to_the_numpy_path(compiled, page_size, shape):
    arena = _arena(7, page_size, seed=page_size)
    page_ids = {"whole pages": [5, 1, 3], "last page mid-block": [2, 6, 0], "last page one word": [4, 2],
                "one page, part": [6]}[shape]
    last = {"whole pages": page_size, "last page mid-block": page_size // 2 + 8 * 13, "last page one word": 8,
            "one page, part": page_size - 8 * 77}[shape]
    nbytes = (len(page_ids) - 1) * page_size + last
    assert fused_hash.supports(page_size, nbytes)
    got = fused_hash.chunk_checksum(arena, page_ids, nbytes)
    assert got == checksum.pages_checksum(arena, page_ids, nbytes)


def test_counts_the_extent_only_and_every_word_of_it(compiled):
    page_size = 2 * BLOCK_BYTES
    arena = _arena(3, page_size, seed=1)
    pages, nbytes = arena, 2 * page_size - 4096
    before = fused_hash.chunk_checksum(pages, [2, 0], nbytes)
    arena[0, page_size - 4096 :] ^= 0xFF  # past the extent: not the chunk's bytes
    assert fused_hash.chunk_checksum(pages, [2, 0], nbytes) == before
    for page, offset in ((2, 0), (2, page_size - 1), (0, BLOCK_BYTES + 3), (0, page_size - 4097)):
        arena[page, offset] ^= 0x01
        assert fused_hash.chunk_checksum(pages, [2, 0], nbytes) != before, (page, offset)
        arena[page, offset] ^= 0x01
    assert fused_hash.chunk_checksum(pages, [0, 2], nbytes) != before  # the pages' order counts
    with pytest.raises(ValueError, match="span 2 pages"):
        fused_hash.chunk_checksum(pages, [2], nbytes)
    with pytest.raises(ValueError, match="outside an arena of 3 pages"):  # never handed to the C loop
        fused_hash.chunk_checksum(pages, [2, 3], nbytes)


def test_supports_whole_words():
    assert not fused_hash.supports(BLOCK_BYTES, BLOCK_BYTES - 4)
    assert not fused_hash.supports(4100, 4096)
    assert fused_hash.supports(2 << 20, 6 << 20) and fused_hash.supports(4096, 4096 * 3 - 8)


def test_hashing_threads_run_it_without_the_gil(compiled):
    """With the interpreter's switch interval raised to 10 s, a thread that holds the GIL keeps it until it blocks. This
    thread still runs while another hashes 256 MiB in the C loop: the call let the GIL go (a kernel that kept it, as
    torch's compiled one did, would leave no turn of this loop inside the call)."""
    arena = np.full((64, 4 << 20), 7, dtype=np.uint8)
    call: list[tuple[float, float]] = []
    turns, done = [], threading.Event()

    def hash_once():
        for _ in range(3):  # three calls: one is enough, unless the OS kept this thread off the CPU throughout
            started = time.perf_counter()
            fused_hash.chunk_checksum(arena, list(range(64)), 256 << 20)
            call.append((started, time.perf_counter()))
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        worker = threading.Thread(target=hash_once)
        worker.start()
        while not done.is_set():  # bounded by the three calls
            turns.append(time.perf_counter())
            time.sleep(0)  # lets the worker take the GIL
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert any(start < turn < end for start, end in call for turn in turns), (call, len(turns))


def test_mode_numpy_never_compiles_and_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("KVSHARE_HOST_HASH", "numpy")
    fused_hash.prepare()
    assert not fused_hash.available()
    monkeypatch.setenv("KVSHARE_HOST_HASH", "fast")
    with pytest.raises(ValueError, match="KVSHARE_HOST_HASH must be one of auto, compiled, numpy"):
        fused_hash.prepare()


def test_cpu_transfer_hashes_with_the_kernel_and_catches_a_changed_page(compiled, arena, monkeypatch):
    calls = []
    real = fused_hash.chunk_checksum
    monkeypatch.setattr(fused_hash, "chunk_checksum", lambda *a: calls.append(a[1]) or real(*a))
    layout = KVLayout(2, 64, 16, 2, 64, torch.float32)
    page = BLOCK_BYTES
    chunk_blocks = 12  # 24 units of 16 KiB (12 blocks of 2 layers): one whole page and half of the next
    tensor = arena(8, page)  # a torch view of a /dev/shm arena
    pages = tensor.numpy()
    writer = make_transfer(layout, make_kv(layout, seed=1), tensor)
    spans = [[0, 1], [5, 3]]
    stored = writer.store([StoreJob(list(range(c * chunk_blocks, (c + 1) * chunk_blocks)), spans[c])
                           for c in range(2)])
    sums = stored.checksums()
    nbytes = layout.chunk_nbytes(chunk_blocks * layout.block_size, page)
    assert sums == [checksum.pages_checksum(pages, s, nbytes) for s in spans]
    assert sorted(calls) == sorted(spans)  # by the loop, on the hashing threads (in any order)
    reader = make_transfer(layout, make_kv(layout, seed=2), tensor)
    jobs = [LoadJob(spans[c], list(range(c * chunk_blocks, (c + 1) * chunk_blocks))) for c in range(2)]
    assert reader.load(jobs, checksums=True).checksums() == sums and sorted(calls[2:]) == sorted(spans)
    pages[3, 100] ^= 0x40  # a byte of chunk 1 changes after its commit
    changed = reader.load(jobs, checksums=True).checksums()
    assert changed[0] == sums[0] and changed[1] != sums[1]
