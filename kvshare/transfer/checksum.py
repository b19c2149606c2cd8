"""xxh3-64 of a packed chunk as stored in the arena: the checksum a writer COMMITs and a reader verifies (I1)."""

from __future__ import annotations

from typing import Sequence

import torch
import xxhash


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
