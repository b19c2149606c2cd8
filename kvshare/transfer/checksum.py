"""Where a transfer computes chunk checksums (the function itself is `kvshare.checksum`, shared with the pool):
- on host threads, over the arena pages (the CPU path; a CUDA transfer with checksums="host");
- on the GPU, over a staging slot (`DeviceHasher`: the CUDA path's default).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from kvshare import checksum
from kvshare.transfer import fused_hash, hash_kernel

# Host hashing threads. numpy passes retake the GIL, so more threads fight over it (and over the engine thread's
# turns) instead of hashing faster: 4 threads reached 5.0 GB/s on the H200 host, 16 threads 3.7 (run 10). The
# compiled loop (fused_hash) holds no GIL at all.
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def arena_checksum(pages: np.ndarray, page_ids: Sequence[int], nbytes: int) -> int:
    """The checksum of a chunk as it lies in the arena (uint8 [num_pages, page_size]): the extent, tails included;
    by the compiled loop where it is built and takes the chunk (same bits, no GIL held), else by numpy."""
    if fused_hash.available() and fused_hash.supports(pages.shape[1], nbytes):
        return fused_hash.chunk_checksum(pages, page_ids, nbytes)
    return checksum.pages_checksum(pages, page_ids, nbytes)


def run_on_every_cpu() -> None:
    """Let the calling thread run on every CPU this process's cgroup allows. A CPU replica's engine pins its process
    to the cores its model computes on (vLLM: VLLM_CPU_OMP_THREADS_BIND), and threads inherit that pin; kvshare's
    helper threads (hashing, the connector's storer) are not the model's compute and would otherwise take turns with
    it on those cores instead of running beside it. The kernel keeps the mask within the cgroup's CPUs."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # 0: this thread
    except OSError:
        pass  # a platform or sandbox that refuses: the thread keeps the CPUs it has


@lru_cache(maxsize=1)
def _hashers() -> ThreadPoolExecutor:
    # numpy releases the GIL in each pass over a batch of words, so chunks hash in parallel and beside the engine
    # thread. Created on first use, shared by a process.
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvshare-hash", initializer=run_on_every_cpu)


def results_of(futures: list[Future] | None) -> Callable[[], list[int]] | None:
    """The function that waits for each future of start_checksums and gives their checksums (None for None)."""
    return None if futures is None else (lambda: [future.result() for future in futures])


def start_checksums(pages: np.ndarray, chunks: Iterable[tuple[Sequence[int], int]],
                    before: Callable[[], None] = lambda: None) -> list[Future]:
    """arena_checksum of each (page ids, nbytes), computed on the hashing threads after `before()` returns (e.g. a
    wait for the copies that write the pages); futures in input order."""

    def one(page_ids, nbytes):
        before()
        return arena_checksum(pages, page_ids, nbytes)

    pool = _hashers()
    return [pool.submit(one, page_ids, nbytes) for page_ids, nbytes in chunks]


class DeviceHasher:
    """Chunk checksums from staging slots on the GPU, on a stream of their own.

    A slot holds pages [j0, j1) of one chunk, each page's units back to back (`used_per_page` bytes a row), exactly
    the bytes the arena's pages hold or receive minus their tails, which the store keeps zero. `add` queues one
    slot's terms (kvshare.checksum.torch_terms_sum against the c_i of those bytes' extent positions); `finish`
    sums each chunk's slots on the host once one small device-to-host copy has landed.

    Memory: one chunk's worth of int64 coefficients per chunk shape (a chunk's size: 64 MiB for 256 tokens of
    qwen2.5-32b KV), and two slot-sized temporaries while a slot is hashed, all allocated on the hash stream.
    """

    def __init__(self, device: torch.device, page_size: int, used_per_page: int, priority: int = 0):
        self.device, self.page_size, self.used_per_page = device, page_size, used_per_page
        self.stream = torch.cuda.Stream(device, priority=priority)
        self._coefficients: dict[int, torch.Tensor] = {}  # chunk nbytes -> int64 [pages, used_per_page // 8]
        # One Triton kernel where it runs (kvshare.transfer.hash_kernel: 2 launches a slot instead of 9), same bits.
        self._terms_sum = hash_kernel.terms_sum if hash_kernel.available(device) else torch_terms_sum

    @staticmethod
    def supports(page_size: int, used_per_page: int, block_bytes: int) -> bool:
        """Whether every page row and the last page's units are whole words (else hash on the host)."""
        return all(size % checksum.WORD == 0 for size in (page_size, used_per_page, block_bytes))

    def add(self, staging: torch.Tensor, nbytes: int, j0: int, j1: int, ready: torch.cuda.Event) -> torch.Tensor:
        """Queue the terms of pages [j0, j1) of a chunk of `nbytes`, held by staging rows [0, j1 - j0), once `ready`
        (recorded after the kernel or copy that fills the slot) has fired. Returns a 0-dim int64 device tensor."""
        self.stream.wait_event(ready)  # RAW on staging: hash only the bytes the gather (store) / copy (load) put there
        with torch.cuda.stream(self.stream):
            words = staging[: j1 - j0].view(torch.int64)  # [pages, used_per_page // 8]
            return self._terms_sum(words, self._rows(nbytes)[j0:j1])

    def finish(self, parts: list[torch.Tensor], owners: list[int], extents: list[int]) -> Callable[[], list[int]]:
        """Copy every part to the host (one copy, on the hash stream) and return the function that waits for it and
        gives each chunk's checksum: chunk c's extent is extents[c] bytes and its parts are those with owners == c."""
        with torch.cuda.stream(self.stream):
            host = torch.empty(len(parts), dtype=torch.int64, pin_memory=True)
            if parts:
                host.copy_(torch.stack(parts), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.stream)

        def checksums() -> list[int]:
            copied.synchronize()  # the parts are in `host` only after this
            totals = [0] * len(extents)
            for owner, value in zip(owners, host.tolist()):
                totals[owner] = (totals[owner] + value) & checksum.MASK
            return [checksum.finish(total, nbytes) for total, nbytes in zip(totals, extents)]

        return checksums

    def _rows(self, nbytes: int) -> torch.Tensor:
        rows = self._coefficients.get(nbytes)
        if rows is None:
            host = torch.from_numpy(checksum.chunk_coefficients(nbytes, self.page_size, self.used_per_page))
            # Allocated and uploaded on the hash stream, its only user; from pinned memory, non-blocking (a blocking
            # copy would wait for the slots already queued there).
            with torch.cuda.stream(self.stream):
                rows = host.pin_memory().to(self.device, non_blocking=True)
            self._coefficients[nbytes] = rows
        return rows


# ---- the torch path of kvshare.checksum (same bits as its numpy path) -------------------------------------------
def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shifted_high(x: torch.Tensor) -> torch.Tensor:
    """x >> 32 (logical) as a new int64 tensor: torch's >> on int64 is arithmetic, so mask the shifted-in bits."""
    return x.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF)


def torch_terms_sum(words: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """sum mix(words) * coefficients mod 2^64 as a 0-dim int64 tensor on the words' device (no host sync).

    `words` and `coefficients` are int64 tensors of one shape (any strides): the words and the c_i of their extent
    positions; a coefficient of 0 leaves its word out. int64 multiplies and sums wrap mod 2^64 on CPU and CUDA, so
    the bits equal the numpy path's uint64 result (tests/transfer/test_checksum.py checks it on both). Eight
    elementwise kernels and a sum; `words` is only read."""
    x = _shifted_high(words).bitwise_xor_(words)  # fold, into a new tensor
    x.mul_(_signed(checksum.MIX_MULTIPLIER))
    x.bitwise_xor_(_shifted_high(x))  # fold
    x.mul_(coefficients)
    return x.sum(dtype=torch.int64)
