"""The full-pool allocation check: reserve every page, write a per-page pattern, read it back, verify every byte.

The pattern of page p is uint64 words base + p, so a page handed out twice, a write landing in the wrong page, or
a short mapping shows up as a mismatch, not just a missing byte.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

import msgspec
import numpy as np
import xxhash

from kvshare.pool.client import NewChunk, PoolClient
from kvshare.units import format_size, parse_size

NAMESPACE = xxhash.xxh3_128_digest(b"kvshare/pool-check")


class CheckResult(msgspec.Struct):
    pages: int
    page_size: int
    bytes_checked: int
    write_gib_s: float
    verify_gib_s: float
    bad_pages: list[int]

    @property
    def ok(self) -> bool:
        return not self.bad_pages and self.pages > 0


def check_pool(
    client: PoolClient, max_pages: int | None = None, corrupt: Callable[[np.ndarray], None] | None = None
) -> CheckResult:
    """Reserve all free pages (at most max_pages) in one-page chunks, write, commit, look up, verify, clear.
    `corrupt(pages)` runs between write and verify: tests use it to prove the check can fail."""
    client.hello(NAMESPACE, "kvshare pool check")
    stats = client.stats()
    free = stats.pages_free if max_pages is None else max_pages
    if stats.max_leased_pages_per_client:  # one connection may lease no more: a full check needs a pool without a limit
        free = min(free, stats.max_leased_pages_per_client)
    tag = os.urandom(8)  # fresh keys per run: a repeated check never skips chunks as already present
    keys = [xxhash.xxh3_128_digest(tag + i.to_bytes(8, "little")) for i in range(free)]
    parents = [NAMESPACE] + keys[:-1]  # one chain, so a single LOOKUP must return every page
    chunks = [NewChunk(k, parent, b"", client.page_size) for k, parent in zip(keys, parents)]
    reservation = client.reserve(NAMESPACE, chunks)
    pages = [ref.pages[0] for ref in reservation.chunks]
    words = client.page_size // 8
    base = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    arena = client.pages.view(np.uint64)  # [num_pages, words]

    started = time.perf_counter()
    for page in pages:
        np.add(base, np.uint64(page), out=arena[page])
    write_s = time.perf_counter() - started
    client.commit(reservation.lease, [0] * len(pages))
    if corrupt is not None:
        corrupt(client.pages)

    found = client.lookup(NAMESPACE, keys, [b""] * len(keys))
    bad = [page for page, ref in zip(pages, found.chunks) if ref.pages != [page]]  # the index must agree
    bad += pages[len(found.chunks):]
    scratch = np.empty(words, dtype=np.uint64)
    started = time.perf_counter()
    for page in pages:
        np.subtract(arena[page], np.uint64(page), out=scratch)
        if not np.array_equal(scratch, base):
            bad.append(page)
    verify_s = time.perf_counter() - started
    client.release(found.lease)
    client.clear()
    nbytes = len(pages) * client.page_size
    return CheckResult(len(pages), client.page_size, nbytes, nbytes / write_s / 2**30, nbytes / verify_s / 2**30, bad)


def run_check(size: str, socket: str = "", page_size: str = "2MiB") -> int:
    """`kvshare pool check`: start a pool of `size` (or use `socket`), check it, print the result; 0 when clean."""
    from kvshare.pool.testing import start_pool

    started = contextlib.nullcontext((socket, None)) if socket else start_pool(
        parse_size(size), page_size=parse_size(page_size), check_integrity=False, max_leased_pages_per_client=0
    )
    with started as (address, _), PoolClient.connect(address, populate=True) as client:
        result = check_pool(client)
        healthy = client.health(deep=True)
    print(f"pool check: {result.pages} pages x {format_size(result.page_size)} = {format_size(result.bytes_checked)}"
          f"; write {result.write_gib_s:.2f} GiB/s, read+verify {result.verify_gib_s:.2f} GiB/s; "
          f"bad pages: {len(result.bad_pages)}{' ' + str(result.bad_pages[:10]) if result.bad_pages else ''}; "
          f"integrity {'ok' if healthy else 'FAILED'}")
    return 0 if result.ok and healthy else 1
