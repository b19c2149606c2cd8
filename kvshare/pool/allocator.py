"""Fixed-size page allocator for the arena: a free list of page indices that grows as pages are prepared.

Invariants: every page is exactly one of unprepared, free, or held by one chunk (reserved or committed); a page is
handed out only after it was prepared (so a write can never fault for lack of memory); allocation is all or nothing.
Pages need not be adjacent, so no pattern of churn can fragment the arena.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int, prepared: int = 0) -> None:
        self.num_pages = num_pages
        self.prepared = 0
        self._free: list[int] = []  # a stack: recently freed pages are reused first (warm in caches and TLBs)
        self.add_prepared(prepared)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def unprepared(self) -> int:
        return self.num_pages - self.prepared

    def add_prepared(self, upto: int) -> None:
        """Pages [self.prepared, upto) are now backed by memory: make them allocatable."""
        upto = min(upto, self.num_pages)
        if upto > self.prepared:
            # Lower page numbers on top of the stack, so a fresh pool fills from the start of the arena.
            self._free.extend(range(upto - 1, self.prepared - 1, -1))
            self.prepared = upto

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages, or None (and nothing taken) if fewer than `n` are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def free_pages(self) -> list[int]:
        return list(self._free)
