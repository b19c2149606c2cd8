"""A bare page arena in /dev/shm (no pool process): for benchmarks and for tests that need only the data plane."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from typing import Iterator

import numpy as np
import torch

from kvshare.transfer.hostmem import unregister_pages


@contextlib.contextmanager
def shm_pages(num_pages: int, page_size: int, directory: str = "/dev/shm") -> Iterator[torch.Tensor]:
    """A uint8 [num_pages, page_size] tensor over a fresh mmap'd file, pre-faulted; the file is removed on exit."""
    fd, path = tempfile.mkstemp(prefix="kvshare-transfer-", suffix=".arena", dir=directory)
    try:
        os.ftruncate(fd, num_pages * page_size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, num_pages * page_size, flags=flags)
        try:
            array = np.frombuffer(mapping, dtype=np.uint8).reshape(num_pages, page_size)
            pages = torch.from_numpy(array)
            try:
                yield pages
            finally:
                unregister_pages(pages)
                del pages, array
        finally:
            with contextlib.suppress(BufferError):  # a tensor still alive keeps the mapping; the GC closes it
                mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)
