"""Transfer requests (StoreJob, LoadJob), their checked plans, and the completion TransferHandle.

Every job is checked whole before anything is copied: block ids in range, the right number of pages for the
chunk, pages in range, no page written twice and no block loaded twice in one batch. A bad batch raises
ValueError naming the job and what to fix, and copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvshare.transfer.blocks import BlockSpace

SKIP = -1  # a LoadJob block id meaning "already present in the engine: do not write this block"


@dataclass(frozen=True)
class StoreJob:
    """Pack the blocks `block_ids` (one chunk, in token order, for every layer) into `pages` of the arena."""

    block_ids: Sequence[int]
    pages: Sequence[int]


@dataclass(frozen=True)
class LoadJob:
    """Unpack a chunk from `pages` into `block_ids`; a block id of SKIP (-1) leaves that block untouched."""

    pages: Sequence[int]
    block_ids: Sequence[int]


@dataclass(frozen=True)
class ChunkPlan:
    """One checked job: the row of every unit (layer-major; -1 = skip) and the chunk's pages."""

    rows: np.ndarray  # int64 [num_layers * blocks_per_chunk]
    pages: np.ndarray  # int64 [pages_needed]
    blocks_per_chunk: int
    units_per_page: int

    def page_units(self, j: int) -> tuple[int, int]:
        """Units [u0, u1) held by the chunk's page j."""
        u0 = j * self.units_per_page
        return u0, min(u0 + self.units_per_page, len(self.rows))

    def nbytes(self, page_size: int, block_bytes: int) -> int:
        """The chunk's extent in the arena (see KVLayout.chunk_nbytes): full pages, then the last page's units."""
        full = len(self.pages) - 1
        return full * page_size + (len(self.rows) - full * self.units_per_page) * block_bytes


class TransferHandle:
    """Completion of a batch of transfers. For a store, the source blocks must stay untouched until done() (I4).
    A load in waves (Transfer.load's `waves`) is still moving pages when it returns: wait_layer(l) orders what reads
    layer l's blocks after they landed, wait() everything."""

    def __init__(self, is_done: Callable[[], bool] = lambda: True, wait: Callable[[], None] = lambda: None,
                 checksums: Callable[[], list[int]] | None = None,
                 layer_ready: Callable[[int], None] = lambda layer: None):
        self._is_done, self._wait, self._checksums = is_done, wait, checksums
        self._layer_ready = layer_ready

    def wait_layer(self, layer: int) -> None:
        """Order later reads of `layer`'s loaded blocks (kernels on the current stream, or host reads on a CPU) after
        its copies. Nothing to do for a load in one wave: it was ordered before load() returned."""
        self._layer_ready(layer)

    def done(self) -> bool:
        return self._is_done()

    def wait(self) -> None:
        self._wait()

    def checksums(self) -> list[int]:
        """Each chunk's checksum (`kvshare.checksum`), in job order, computed from the bytes this batch wrote to the
        arena (a store) or read from it (a load that asked for them). Blocks until they are known; they may be known
        before done() (the hash of a load's last slot can finish before its scatter) or after it."""
        if self._checksums is None:
            raise ValueError("this transfer computed no checksums: pass checksums=True to load()")
        return self._checksums()


def plan(
    space: BlockSpace, jobs: Sequence[StoreJob | LoadJob], page_size: int, num_pages: int, *, loading: bool
) -> list[ChunkPlan]:
    """Check every job of a batch against the layout and the arena; return their plans or raise ValueError."""
    plans = _plan_uniform(space, jobs, page_size, num_pages, loading)
    return plans if plans is not None else _plan_each(space, jobs, page_size, num_pages, loading)


def _plan_uniform(space: BlockSpace, jobs: Sequence[StoreJob | LoadJob], page_size: int, num_pages: int,
                  loading: bool) -> list[ChunkPlan] | None:
    """_plan_each's plans in a few numpy passes, for a batch of valid jobs of one size (a 128k load is 512 such
    jobs: ~10 ms job by job on the build machine, before its first copy); None for any other batch, which
    _plan_each then checks job by job and, if it is bad, names the first bad job exactly as before."""
    if not jobs:
        return None
    try:
        ids = np.array([list(job.block_ids) for job in jobs], dtype=np.int64)
        pages = np.array([list(job.pages) for job in jobs], dtype=np.int64)
    except (ValueError, TypeError):  # ragged or not integers
        return None
    layout = space.layout
    if ids.ndim != 2 or pages.ndim != 2 or ids.shape[1] == 0:
        return None
    if pages.shape[1] != layout.pages_needed(ids.shape[1] * layout.block_size, page_size):
        return None
    if ids.min() < (SKIP if loading else 0) or ids.max() >= layout.num_blocks:
        return None
    if pages.min() < 0 or pages.max() >= num_pages:
        return None
    written = ids[ids >= 0] if loading else pages.reshape(-1)
    if len(np.unique(written)) != len(written):
        return None
    rows = space.rows(ids)  # every job's at once: [jobs, layers * blocks]
    upp = layout.units_per_page(page_size)
    return [ChunkPlan(rows[c], pages[c], ids.shape[1], upp) for c in range(len(jobs))]


def _plan_each(space: BlockSpace, jobs: Sequence[StoreJob | LoadJob], page_size: int, num_pages: int,
               loading: bool) -> list[ChunkPlan]:
    """plan(), job by job: the first bad job raises a ValueError naming it and what to fix."""
    layout = space.layout
    upp = layout.units_per_page(page_size)
    plans, pages_seen, blocks_seen = [], set(), set()
    for index, job in enumerate(jobs):
        what = f"{'load' if loading else 'store'} job {index}"
        ids = np.asarray(list(job.block_ids), dtype=np.int64).reshape(-1)
        pages = np.asarray(list(job.pages), dtype=np.int64).reshape(-1)
        _check_blocks(ids, layout.num_blocks, loading, what)
        need = layout.pages_needed(len(ids) * layout.block_size, page_size)
        if len(pages) != need:
            raise ValueError(f"{what}: {len(ids)} blocks need {need} pages of {page_size} bytes, got {len(pages)}")
        if len(pages) and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"{what}: page ids must be in [0, {num_pages}), got {pages.tolist()}")
        # Two chunks of one batch writing one page (store) or one block (load) would race on the side stream.
        written = pages.tolist() if not loading else ids[ids >= 0].tolist()
        seen = blocks_seen if loading else pages_seen
        if len(set(written)) != len(written) or seen.intersection(written):
            raise ValueError(f"{what}: a {'block' if loading else 'page'} is written twice in this batch: {written}")
        seen.update(written)
        plans.append(ChunkPlan(space.rows(ids), pages, len(ids), upp))
    return plans


def _check_blocks(ids: np.ndarray, num_blocks: int, loading: bool, what: str) -> None:
    if len(ids) == 0:
        raise ValueError(f"{what}: no block ids")
    low = SKIP if loading else 0
    bad = ids[(ids < low) | (ids >= num_blocks)]
    if len(bad):
        allowed = f"[0, {num_blocks})" + (" or -1 (skip)" if loading else "")
        raise ValueError(f"{what}: block ids {bad[:8].tolist()} out of range; ids must be in {allowed}")
