"""Which committed chunks to drop when the arena fills up.

/* Eviction policy
 * ---------------
 * The pool keeps committed chunks in one LRU list (ChunkIndex.committed, least recently used first). COMMIT
 * publishes and LOOKUP hits touch chunks in *reverse* prefix order (last chunk first), so a prefix's parent is more
 * recent than its
 * children: the tail of a long prompt is evicted before its head, and a shortened prefix stays usable. A chunk whose
 * parent was evicted is unreachable (LOOKUP stops at the first miss) and ages out of the LRU like any other.
 *
 * Eviction runs only inside RESERVE, before pages are allocated, never on a timer: a pool that is not being
 * written to keeps everything. When the request would leave the used fraction above the high watermark, chunks
 * are dropped from the LRU end until, after the allocation, usage is at or below the low watermark — the gap
 * between the two makes eviction run in batches instead of on every RESERVE. The watermarks are fractions of all
 * pages, including pages still being prepared at start-up.
 *
 * Chunks held by a read lease (readers > 0) are skipped, never evicted (I3); reserved chunks are not in the LRU at
 * all. If every candidate is leased the loop ends early; RESERVE then answers "no space" at once if the request
 * still does not fit, rather than waiting for leases to end. Eviction is O(chunks scanned), bounded by the number of
 * committed chunks.
 */
"""

from __future__ import annotations

from kvshare.pool.allocator import PageAllocator
from kvshare.pool.index import ChunkIndex, Entry


def pages_to_free(allocator: PageAllocator, needed: int, high: float, low: float) -> int:
    """How many pages eviction should free so that `needed` more pages respect the watermarks (0: none)."""
    total = allocator.num_pages
    used_after = total - allocator.unprepared - allocator.free_count + needed
    shortage = needed - allocator.free_count
    if used_after <= high * total and shortage <= 0:
        return 0
    target_used = int(low * total)
    return max(shortage, used_after - target_used)


def evict(index: ChunkIndex, allocator: PageAllocator, goal_pages: int) -> list[Entry]:
    """Drop unleased committed chunks, least recently used first, until `goal_pages` pages were freed or none is
    left to drop. Returns the evicted entries."""
    evicted: list[Entry] = []
    freed = 0
    for key, entry in list(index.committed.items()):
        if freed >= goal_pages:
            break
        if entry.readers:
            continue  # I3: leased chunks are never evicted
        index.remove(key)
        allocator.free(entry.pages)
        freed += len(entry.pages)
        evicted.append(entry)
    return evicted
