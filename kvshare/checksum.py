"""The chunk checksum (I1): one definition, computed here by numpy (the pool, CPU replicas) and by torch on a GPU
replica's staging buffer (kvshare.transfer.checksum.torch_terms_sum, with the same bits). This module imports numpy
only, so the pool process, which never imports torch, shares it with the replicas.

Definition. A chunk's *extent* is the `nbytes` bytes its pages hold, page after page (page j's bytes are extent bytes
[j * page_size, (j + 1) * page_size)): in the arena, in an L2 value, anywhere. Read it as little-endian uint64 words
w_i (the last word zero-padded). Then

    checksum = finish(sum_i mix(w_i) * c_i  mod 2^64,  nbytes)
    mix(x)   = fold(fold(x) * MIX_MULTIPLIER mod 2^64),   fold(x) = x xor (x >> 32)
    c_i      = a_(i mod 2^15) * b_(i div 2^15) mod 2^64,  a_r = splitmix64(2r) | 1,  b_j = splitmix64(2j + 1) | 1
               (fixed, odd, pseudo-random: one per word position)
    finish   = the splitmix64 finalizer of (sum + nbytes * GOLDEN)

Why this shape:
- The sum is a sum: any grouping gives the same value, so a GPU adds words in any order, a slot of pages at a time,
  and the parts add up on the host.
- mix is a bijection (xor-shifts and a multiply by an odd number are), and so is multiplying by the odd c_i: a change
  of any single word always changes the checksum.
- mix is not additive: flipping a word's top bit changes its term by a data-dependent, pseudo-random amount. A plain
  sum of w_i * c_i changes by 2^63 for every top-bit flip, so two such flips cancel; here they do not (the tests
  check it, and swapped words too, which c_i's position dependence catches).
- mix(0) = 0, so zero words add nothing: page tails (the bytes of a page past its last unit) are kept zero by the
  store (`kvshare.transfer`), and a GPU that hashes only the units, at their extent positions, gets the value the
  pool gets over the whole extent.
It detects accidents (a stale or half-written page, a wrong copy), not a forger: the coefficients are public.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import numpy as np

MASK = (1 << 64) - 1
MIX_MULTIPLIER = 0xBF58476D1CE4E5B9  # splitmix64's first multiplier: odd, well mixed
GOLDEN = 0x9E3779B97F4A7C15
WORD = 8
BLOCK_WORDS = 1 << 15  # c_i = a_(i mod BLOCK_WORDS) * b_(i // BLOCK_WORDS): numpy multiplies by a 256 KiB table of
# a's that stays in the core's cache (a full table of c's streamed from memory halved its speed)

_U64 = np.dtype("<u8")
_SHIFT = np.uint64(32)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function of uint64 values (wrapping)."""
    z = z + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_INNER = np.arange(0, 2 * BLOCK_WORDS, 2, dtype=np.uint64)  # seeds of the inner coefficients: even numbers


def _inner_coefficients() -> np.ndarray:
    with np.errstate(over="ignore"):
        return _splitmix64(_INNER) | np.uint64(1)


_A = _inner_coefficients()  # uint64 [BLOCK_WORDS]: a_r, 256 KiB, stays in cache


def _outer(blocks: np.ndarray) -> np.ndarray:
    """b_j = splitmix64(2j + 1) | 1 for the given block numbers (odd seeds: never equal to an inner seed)."""
    with np.errstate(over="ignore"):
        return _splitmix64(blocks.astype(np.uint64) * np.uint64(2) + np.uint64(1)) | np.uint64(1)


def coefficients(first: int, count: int) -> np.ndarray:
    """uint64 [count]: c_first .. c_{first+count-1}, c_i = a_(i mod BLOCK_WORDS) * b_(i // BLOCK_WORDS) mod 2^64."""
    index = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _A[index % np.uint64(BLOCK_WORDS)] * _outer(index // np.uint64(BLOCK_WORDS))


def finish(total: int, nbytes: int) -> int:
    """The checksum of an extent of `nbytes` bytes whose terms sum to `total` (mod 2^64)."""
    z = (total + nbytes * GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


# ---- numpy path ---------------------------------------------------------------------------------------------------
# Whole coefficient blocks per numpy pass: 4 (1 MiB of words). Each pass releases and retakes the GIL, so threads that
# hash together hand it over once a pass: with one block (256 KiB) a pass 16 threads hashed slower together (1.2-1.8
# GB/s) than one thread alone on the H200 host. Measured there (run 10), GB/s by blocks a pass at 1 / 4 / 16 threads:
# 1: 1.6 / 2.2 / 1.2; 4: 1.7 / 5.0 / 3.7; 8: 1.5 / 4.4 / 6.4 (on the 2-core build machine, one thread: 3.6 / 3.3 / 2.4).
_BATCH_BLOCKS = 4


class _Scratch(threading.local):
    """Per thread: two uint64 buffers of at least a batch, reused (fresh megabyte arrays fault their pages in)."""

    def __init__(self):
        self.x = self.t = np.empty(0, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.x) < n:
            size = max(n, _BATCH_BLOCKS * BLOCK_WORDS)
            self.x, self.t = np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.uint64)
        return self.x[:n], self.t[:n]


_scratch = _Scratch()


def _mixed_times(words: np.ndarray, a: np.ndarray) -> np.ndarray:
    """mix(words) * a (broadcast over rows), in this thread's scratch buffer shaped like `words`."""
    x, t = (buffer.reshape(words.shape) for buffer in _scratch.get(words.size))
    np.right_shift(words, _SHIFT, out=x)  # fold
    np.bitwise_xor(x, words, out=x)
    np.multiply(x, np.uint64(MIX_MULTIPLIER), out=x)
    np.right_shift(x, _SHIFT, out=t)  # fold
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, a, out=x)
    return x


def terms_sum(words: np.ndarray, first_word: int) -> int:
    """sum_k mix(words[k]) * c_{first_word + k} mod 2^64, for a 1-D uint64 array of the words at extent positions
    first_word, first_word + 1, ...  Whole coefficient blocks go a batch at a time (numpy releases the GIL in each
    pass); a partial block at either end goes alone."""
    n, total = len(words), 0
    head = min(n, -first_word % BLOCK_WORDS)
    whole = (n - head) // BLOCK_WORDS
    with np.errstate(over="ignore"):
        if head:
            total += _partial_block(words[:head], first_word)
        for b0 in range(0, whole, _BATCH_BLOCKS):
            k = min(_BATCH_BLOCKS, whole - b0)
            rows = words[head + b0 * BLOCK_WORDS : head + (b0 + k) * BLOCK_WORDS].reshape(k, BLOCK_WORDS)
            inner = _mixed_times(rows, _A).sum(axis=1, dtype=np.uint64)  # [k]: sum_r mix(w) * a_r, per block
            first_block = (first_word + head) // BLOCK_WORDS + b0
            total += int((inner * _outer(np.arange(first_block, first_block + k))).sum(dtype=np.uint64))
        if head + whole * BLOCK_WORDS < n:
            start = head + whole * BLOCK_WORDS
            total += _partial_block(words[start:], first_word + start)
    return total & MASK


def _partial_block(words: np.ndarray, first_word: int) -> int:
    """terms_sum of words that lie inside one coefficient block."""
    block, r0 = divmod(first_word, BLOCK_WORDS)
    inner = int(_mixed_times(words, _A[r0 : r0 + len(words)]).sum(dtype=np.uint64))
    return inner * int(_outer(np.array([block]))[0])


def parts_checksum(parts: Iterable, nbytes: int | None = None) -> int:
    """The checksum of the extent made of `parts` (buffers: bytes, memoryview, uint8 arrays) laid end to end.

    Parts may have any length (a page size need not be a multiple of 8: a word may span two parts). `nbytes`, when
    given, must equal the parts' total length (a check that the caller cut the extent right)."""
    total, offset, carry = 0, 0, b""  # offset: extent bytes consumed so far, the carried bytes included
    for part in parts:
        array = part if isinstance(part, np.ndarray) else np.frombuffer(part, dtype=np.uint8)
        data = array.reshape(-1).view(np.uint8)
        if carry:  # complete the word begun by the previous part
            take = min(WORD - len(carry), len(data))
            carry, data, offset = carry + data[:take].tobytes(), data[take:], offset + take
            if len(carry) < WORD:
                continue
            total += terms_sum(np.frombuffer(carry, dtype=_U64), offset // WORD - 1)
            carry = b""
        whole = len(data) // WORD * WORD  # offset is a multiple of WORD here
        if whole:
            total += terms_sum(data[:whole].view(_U64), offset // WORD)
            offset += whole
        if whole < len(data):
            carry = data[whole:].tobytes()
            offset += len(carry)
    if carry:
        total += terms_sum(np.frombuffer(carry.ljust(WORD, b"\0"), dtype=_U64), offset // WORD)
    if nbytes is not None and nbytes != offset:
        raise ValueError(f"the parts hold {offset} bytes, expected {nbytes}")
    return finish(total, offset)


def checksum(data) -> int:
    """The checksum of one contiguous extent (an L2 value's payload, a test's chunk bytes)."""
    return parts_checksum([data])


def pages_checksum(pages: np.ndarray, page_ids: Sequence[int], nbytes: int) -> int:
    """The checksum of a chunk of `nbytes` bytes held by `page_ids` of an arena (uint8 [num_pages, page_size]).

    Every byte of the extent counts, page tails included: the store keeps them zero (see the module docstring)."""
    page_size = pages.shape[1]
    need = -(-nbytes // page_size)
    if len(page_ids) != need:
        raise ValueError(f"{nbytes} bytes span {need} pages of {page_size}, got {len(page_ids)}")
    return parts_checksum(pages[page, : min(page_size, nbytes - k * page_size)] for k, page in enumerate(page_ids))


def chunk_coefficients(nbytes: int, page_size: int, used_per_page: int) -> np.ndarray:
    """int64 [pages, used_per_page // 8]: row j holds the c_i of the words of page j's units (its first
    `used_per_page` bytes), 0 past the chunk's last byte. The device path multiplies a staging slot's page rows by
    these rows, so tails (zero in the arena, absent from staging) and stale staging bytes past the chunk add nothing.
    Needs page_size and used_per_page to be multiples of 8."""
    pages = -(-nbytes // page_size)
    last_bytes = nbytes - (pages - 1) * page_size
    if page_size % WORD or used_per_page % WORD or last_bytes % WORD:
        raise ValueError(f"page size {page_size}, used bytes per page {used_per_page} and the last page's "
                         f"{last_bytes} bytes must be multiples of {WORD}")
    every_word = coefficients(0, pages * page_size // WORD).reshape(pages, page_size // WORD)
    rows = every_word[:, : used_per_page // WORD].copy()
    rows[-1, last_bytes // WORD :] = 0
    return rows.view(np.int64)
