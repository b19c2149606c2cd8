"""xxh3-64 of a packed chunk as stored in the arena: the checksum a writer COMMITs and a reader verifies (I1)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Iterable, Sequence

import torch
import xxhash

HASH_THREADS = max(1, min(16, os.cpu_count() or 1))


def packed_checksum(pages: torch.Tensor, page_ids: Sequence[int], nbytes: int, used_per_page: int) -> int:
    """xxh3-64 over the chunk's units in page order: the first `used_per_page` bytes of each page (units never
    straddle pages), `nbytes` (the pool's extent of the chunk) limiting the last. Page tails are not hashed.

    `pages` is the host arena (uint8 [num_pages, page_size]); call only after the store that wrote it is done."""
    page_size = pages.shape[1]
    if len(page_ids) != -(-nbytes // page_size):
        raise ValueError(f"{nbytes} bytes span {-(-nbytes // page_size)} pages of {page_size}, got {len(page_ids)}")
    digest = xxhash.xxh3_64()
    for k, page in enumerate(page_ids):
        length = min(used_per_page, nbytes - k * page_size)
        digest.update(memoryview(pages[page, :length].numpy()))
    return digest.intdigest()


@lru_cache(maxsize=1)
def _hashers() -> ThreadPoolExecutor:
    # xxhash releases the GIL on large buffers (a 2 GiB hash stalls another Python thread for one switch interval
    # only), so chunks hash in parallel and beside the engine thread. Created on first use, shared by a process.
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvshare-hash")


def start_checksums(pages: torch.Tensor, chunks: Iterable[tuple[Sequence[int], int]],
                    used_per_page: int) -> list[Future]:
    """packed_checksum of each (page ids, nbytes), computed on the hashing threads; futures in input order."""
    pool = _hashers()
    return [pool.submit(packed_checksum, pages, page_ids, nbytes, used_per_page) for page_ids, nbytes in chunks]
