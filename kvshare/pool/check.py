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

from kvshare.keys import synthetic_keys, tool_namespace
from kvshare.pool.client import NewChunk, PoolClient
from kvshare.units import format_size, parse_size

NAMESPACE = tool_namespace("pool-check")


class CheckResult(msgspec.Struct):
    pages: int
    page_size: int
    bytes_checked: int
    write_gib_s: float
    verify_gib_s: float
    bad_pages: list[int]
    pool_pages: int = 0  # the pool's pages (the check covers `pages` of them)
    chunks_before: int = 0  # committed chunks when the check started (after the clear, if destructive)
    chunks_after: int = 0  # and when it ended: equal unless others stored or evicted meanwhile
    destructive: bool = False

    @property
    def ok(self) -> bool:
        return not self.bad_pages and self.pages > 0

    def describe(self) -> str:
        scope = (f"{self.pages} of {self.pool_pages} pages x {format_size(self.page_size)} = "
                 f"{format_size(self.bytes_checked)}")
        if self.destructive:
            return f"{scope} (destructive: cleared the pool first)"
        return (f"{scope}, free pages only (read-only: committed chunks untouched, {self.chunks_before} before, "
                f"{self.chunks_after} after; --destructive clears the pool to check every page)")


def check_pool(
    client: PoolClient, max_pages: int | None = None, corrupt: Callable[[np.ndarray], None] | None = None,
    destructive: bool = False,
) -> CheckResult:
    """Reserve free pages (at most max_pages, never evicting) in one-page chunks, write, commit, look up, verify,
    then DISCARD the check's own chunks. Committed chunks of others are never touched, so a live pool keeps
    serving; `destructive` CLEARs the pool first so that every unleased page is checked.
    `corrupt(pages)` runs between write and verify: tests use it to prove the check can fail."""
    client.hello(NAMESPACE, "kvshare pool check")
    if destructive:
        client.clear()
    stats = client.stats()
    free = stats.pages_free if max_pages is None else max_pages
    if stats.max_leased_pages_per_client:  # one connection may lease no more: a full check needs a pool without a limit
        free = min(free, stats.max_leased_pages_per_client)
    tag = os.urandom(8)  # fresh keys per run: a repeated check never skips chunks as already present
    keys = synthetic_keys(tag, free)
    parents = [NAMESPACE] + keys[:-1]  # one chain, so a single LOOKUP must return every page
    chunks = [NewChunk(k, parent, b"", client.page_size) for k, parent in zip(keys, parents)]
    reservation = client.reserve(NAMESPACE, chunks, evict=False)
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
    client.discard(NAMESPACE, keys)  # the check's own chunks only
    nbytes = len(pages) * client.page_size
    return CheckResult(len(pages), client.page_size, nbytes, nbytes / max(write_s, 1e-9) / 2**30,
                       nbytes / max(verify_s, 1e-9) / 2**30, bad, stats.num_pages, stats.chunks,
                       client.stats().chunks, destructive)


def run_check(size: str, socket: str = "", page_size: str = "2MiB", destructive: bool = False) -> int:
    """`kvshare pool check`: start a pool of `size` and check all of it, or check a running pool at `socket`
    (read-only unless `destructive`); print what was checked; 0 when clean."""
    from kvshare.pool.testing import start_pool

    started = contextlib.nullcontext((socket, None)) if socket else start_pool(
        parse_size(size), page_size=parse_size(page_size), check_integrity=False, max_leased_pages_per_client=0
    )
    with started as (address, _), PoolClient.connect(address, populate=True) as client:
        result = check_pool(client, destructive=destructive and bool(socket))
        healthy = client.health(deep=True)
    print(f"pool check: {result.describe()}; write {result.write_gib_s:.2f} GiB/s, read+verify "
          f"{result.verify_gib_s:.2f} GiB/s; bad pages: {len(result.bad_pages)}"
          f"{' ' + str(result.bad_pages[:10]) if result.bad_pages else ''}; integrity {'ok' if healthy else 'FAILED'}")
    return 0 if result.ok and healthy else 1
