"""The checksum's terms as one Triton kernel give the bits of the numpy definition (and so of torch's form and the
pool's): random words, words with their top bits set (where a sum of plain products would cancel), coefficients of
0 leaving words out, page rows strided like a staging slot's. On a GPU directly; without one under Triton's
interpreter (tests/engine/test_paged_interpreter.py runs this file there)."""

import numpy as np
import pytest
import torch

from kvshare import checksum
from kvshare.transfer import hash_kernel
from kvshare.transfer.checksum import torch_terms_sum

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not hash_kernel.available(DEVICE),
                                reason="needs CUDA + Triton, or Triton's interpreter")


def _numpy_terms(words: np.ndarray, coefficients: np.ndarray) -> int:
    """sum mix(w) * c mod 2^64 in numpy's uint64 (kvshare.checksum's definition, term by term)."""
    w = words.astype(np.uint64).reshape(-1)
    with np.errstate(over="ignore"):
        x = w ^ (w >> np.uint64(32))
        x = x * np.uint64(checksum.MIX_MULTIPLIER)
        x = x ^ (x >> np.uint64(32))
        return int((x * coefficients.astype(np.uint64).reshape(-1)).sum(dtype=np.uint64))


@pytest.mark.parametrize("rows, n, stride", [(3, 5000, 5000), (4, 4096, 6000), (1, 7, 7), (2, 12000, 12288)])
def test_kernel_terms_equal_the_definition(rows, n, stride):
    rng = np.random.default_rng(rows * n)
    raw = rng.integers(-(1 << 63), (1 << 63) - 1, size=(rows, stride), dtype=np.int64)
    raw[0, :64] |= np.int64(-(1 << 63))  # top bits set
    coefficients = rng.integers(-(1 << 63), (1 << 63) - 1, size=(rows, n), dtype=np.int64)
    coefficients[:, ::7] = 0  # words left out
    words = torch.from_numpy(raw).to(DEVICE)[:, :n]  # page rows of a wider slot: strided like staging
    coef = torch.from_numpy(coefficients).to(DEVICE)
    got = int(hash_kernel.terms_sum(words, coef)) & checksum.MASK
    assert got == _numpy_terms(raw[:, :n], coefficients)
    assert got == int(torch_terms_sum(words, coef)) & checksum.MASK


def test_a_flipped_top_bit_changes_the_terms():
    words = torch.zeros(2, 4096, dtype=torch.int64, device=DEVICE)
    coef = torch.ones(2, 4096, dtype=torch.int64, device=DEVICE)
    base = int(hash_kernel.terms_sum(words, coef))
    words[1, 100] = -(1 << 63)
    assert int(hash_kernel.terms_sum(words, coef)) != base
