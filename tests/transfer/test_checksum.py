"""The chunk checksum (kvshare.checksum): the numpy path equals the definition written out in plain Python, the
torch path (CPU here, CUDA when there is one) equals the numpy path on staging-shaped rows, and corruptions that a
plain weighted sum misses are caught."""

import numpy as np
import pytest
import torch

from kvshare import checksum as ck
from kvshare.transfer.checksum import torch_terms_sum

M = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = (z + ck.GOLDEN) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def _reference(data: bytes) -> int:
    """The module docstring's definition, one word at a time in Python integers."""
    padded = data + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        x = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        x ^= x >> 32
        x = (x * ck.MIX_MULTIPLIER) & M
        x ^= x >> 32
        c = ((_splitmix(2 * (i % ck.BLOCK_WORDS)) | 1) * (_splitmix(2 * (i // ck.BLOCK_WORDS) + 1) | 1)) & M
        total = (total + x * c) & M
    z = (total + len(data) * ck.GOLDEN) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100, 4096, 8 * ck.BLOCK_WORDS + 24])  # the last crosses a block
def test_numpy_path_equals_the_definition(n):
    data = _random(n, n).tobytes()
    assert ck.checksum(data) == _reference(data)


def test_the_extent_may_be_cut_anywhere():
    data = _random(3 * 8 * ck.BLOCK_WORDS + 13, 1)
    rng = np.random.default_rng(2)
    for _ in range(5):  # page sizes that are not multiples of 8 cut words in two
        cuts = np.sort(rng.integers(0, len(data), 6))
        parts = np.split(data, cuts)
        assert ck.parts_checksum(parts, len(data)) == ck.checksum(data)
    with pytest.raises(ValueError, match="expected"):
        ck.parts_checksum([data], len(data) + 1)


def _arena_and_staging(nbytes: int, page_size: int, used: int, seed: int):
    """A chunk as the arena holds it (zero page tails; the last page's bytes past the extent are garbage) and as a
    staging slot holds it (rows of `used` bytes; the last row's bytes past the extent are stale garbage)."""
    pages = -(-nbytes // page_size)
    arena = _random(pages * page_size, seed).reshape(pages, page_size)
    arena[:-1, used:] = 0
    staging = np.ascontiguousarray(arena[:, :used])
    last = nbytes - (pages - 1) * page_size
    staging[-1, last:] = _random(used - last, seed + 1)  # never part of the extent
    return arena, staging


LAYOUTS = [  # (nbytes, page_size, used bytes per page): full pages, tails, a partial last page, one page
    (4 * 4096, 4096, 4096),
    (2 * 4096 + 2400, 4096, 4000),
    (3 * 65536 + 8, 65536, 65536 - 24),
    (800, 4096, 4000),
    (2 * (2 << 20) + (1 << 20), 2 << 20, 2 << 20),  # spans several coefficient blocks
]


def _torch_checksum(staging: np.ndarray, nbytes: int, page_size: int, used: int, device: str) -> int:
    words = torch.from_numpy(staging).to(device).view(torch.int64)
    before = words.clone()
    coefficients = torch.from_numpy(ck.chunk_coefficients(nbytes, page_size, used)).to(device)
    half = max(1, words.shape[0] // 2)  # two slots, summed on the host as the transfer does
    parts = [torch_terms_sum(words[:half], coefficients[:half]),
             torch_terms_sum(words[half:], coefficients[half:])]
    assert torch.equal(words, before)  # staging is only read: a store's DMA reads it at the same time
    return ck.finish(sum(int(p) for p in parts) & M, nbytes)


@pytest.mark.parametrize("nbytes, page_size, used", LAYOUTS)
def test_torch_path_equals_numpy_path_cpu(nbytes, page_size, used):
    arena, staging = _arena_and_staging(nbytes, page_size, used, seed=nbytes)
    want = ck.pages_checksum(arena, list(range(len(arena))), nbytes)
    assert _torch_checksum(staging, nbytes, page_size, used, "cpu") == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("nbytes, page_size, used", LAYOUTS)
def test_torch_path_equals_numpy_path_cuda(nbytes, page_size, used):
    arena, staging = _arena_and_staging(nbytes, page_size, used, seed=nbytes + 7)
    want = ck.pages_checksum(arena, list(range(len(arena))), nbytes)
    assert _torch_checksum(staging, nbytes, page_size, used, "cuda") == want


def test_nonzero_tails_change_the_pool_view():
    """The extent covers page tails: a tail the store did not zero is seen (the pool hashes whole pages)."""
    arena, _ = _arena_and_staging(2 * 4096 + 2400, 4096, 4000, seed=3)
    before = ck.pages_checksum(arena, [0, 1, 2], 2 * 4096 + 2400)
    arena[0, 4090] = 1
    assert ck.pages_checksum(arena, [0, 1, 2], 2 * 4096 + 2400) != before


def _words(seed: int, n: int = 4096) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, n, dtype=np.uint64)


def _linear_sum(words: np.ndarray) -> int:
    """The strawman: sum of w_i * c_i without the mix."""
    with np.errstate(over="ignore"):
        return int((words * ck.coefficients(0, len(words))).sum(dtype=np.uint64))


def test_any_single_word_change_is_detected():
    words = _words(4)
    base = ck.checksum(words)
    rng = np.random.default_rng(5)
    for i in rng.choice(len(words), 16, replace=False):
        for bit in range(64):  # every single-bit flip of the word
            changed = words.copy()
            changed[i] ^= np.uint64(1 << bit)
            assert ck.checksum(changed) != base, (i, bit)
        changed = words.copy()
        changed[i] = rng.integers(0, 2**64, dtype=np.uint64)  # any other value
        assert changed[i] == words[i] or ck.checksum(changed) != base
        changed[i] = 0
        assert ck.checksum(changed) != base


def test_two_word_corruptions_that_cancel_in_a_linear_sum_are_detected():
    words = _words(6)
    base, linear = ck.checksum(words), _linear_sum(words)
    rng = np.random.default_rng(7)
    top = np.uint64(1 << 63)
    for _ in range(200):
        i, j = rng.choice(len(words), 2, replace=False)
        flipped = words.copy()
        flipped[[i, j]] ^= top
        assert _linear_sum(flipped) == linear  # the strawman misses it: this test can fail
        assert ck.checksum(flipped) != base, (i, j)
        swapped = words.copy()
        swapped[[i, j]] = words[[j, i]]
        assert ck.checksum(swapped) != base, (i, j)
    zeros = np.zeros(len(words), dtype=np.uint64)  # zero tails: flips there must count too
    for _ in range(50):
        i, j = rng.choice(len(words), 2, replace=False)
        flipped = zeros.copy()
        flipped[[i, j]] = top
        assert ck.checksum(flipped) != ck.checksum(zeros)


def test_device_rows_refuse_layouts_that_are_not_whole_words():
    with pytest.raises(ValueError, match="multiples of 8"):
        ck.chunk_coefficients(4096 + 12, 4096, 4092)


def test_threads_hashing_at_once_get_the_sequential_values():
    """Each thread hashes in scratch buffers of its own: concurrent chunks must not see each other's words."""
    from concurrent.futures import ThreadPoolExecutor

    chunks = [_random(3 * 8 * ck.BLOCK_WORDS + 8 * i + 40, 100 + i) for i in range(8)]
    want = [ck.checksum(c) for c in chunks]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(ck.checksum, chunks)) == want
