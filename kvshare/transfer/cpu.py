"""The CPU path: gathers and scatters straight between the KV tensors and arena page views, with no staging copy.

Every copy runs synchronously on the calling thread, so a returned TransferHandle is already done and stream races do
not apply (torch CPU ops complete before they return). Checksums: with the compiled kernel (kvshare.transfer.fused_hash)
on its own thread once the copies are done, a store's over what it wrote and a load's over what it read (a read
lease keeps those pages unchanged); until that kernel is ready, or without it, on the numpy hashing threads: a
store's after its copies, a load's while its copies run.
"""

from __future__ import annotations

import numpy as np
import torch

from kvshare.transfer import fused_hash
from kvshare.transfer.jobs import ChunkPlan, TransferHandle
from kvshare.transfer.transfer import Transfer, TransferOptions


class CpuTransfer(Transfer):
    def __init__(self, space, pages: torch.Tensor, options: TransferOptions):
        super().__init__(space, pages, options)
        fused_hash.prepare()  # "auto": compiles in the background; loads use numpy until it is ready

    def _store(self, plans: list[ChunkPlan]) -> TransferHandle:
        for chunk in plans:
            rows = torch.from_numpy(chunk.rows)
            for j, page in enumerate(chunk.pages.tolist()):
                u0, u1 = chunk.page_units(j)
                units = self._page_units(page)  # [upp, block_bytes] view of the arena
                for group, a, b in self.space.group_spans(chunk.blocks_per_chunk, u0, u1):
                    for view, offset in zip(group.views, self.space.run_offsets):
                        out = units[a - u0 : b - u0, offset : offset + self.space.run_bytes]
                        torch.index_select(view, 0, rows[a:b], out=out)  # writes the page in place
        return self._checksummed(self._extents(plans), None)

    def _load(self, plans: list[ChunkPlan], checksums: bool) -> TransferHandle:
        extents = self._extents(plans) if checksums else []
        fused = self._fused(extents)
        hashing = self.start_checksums(extents) if checksums and not fused else None
        for chunk in plans:
            rows = torch.from_numpy(chunk.rows)
            for j, page in enumerate(chunk.pages.tolist()):
                u0, u1 = chunk.page_units(j)
                units = self._page_units(page)
                for group, a, b in self.space.group_spans(chunk.blocks_per_chunk, u0, u1):
                    for s, e in kept_segments(chunk.rows, a, b):
                        for view, offset in zip(group.views, self.space.run_offsets):
                            source = units[s - u0 : e - u0, offset : offset + self.space.run_bytes]
                            _scatter_rows(view, chunk.rows[s:e], rows[s:e], source)
        return self._checksummed(extents, hashing) if checksums else TransferHandle()

    def _fused(self, extents: list[tuple[list[int], int]]) -> bool:
        """Whether these chunks hash with the compiled kernel (ready, and every chunk's shape supported)."""
        return fused_hash.available() and all(fused_hash.supports(self.page_size, n) for _, n in extents)

    def _checksummed(self, extents: list[tuple[list[int], int]], hashing: list | None) -> TransferHandle:
        """A done handle whose checksums() are the extents' checksums: already hashing on the numpy threads
        (`hashing`), else with the compiled kernel (started now: after the copies), else on the numpy threads."""
        if hashing is None and self._fused(extents):
            fused = fused_hash.start(self.pages, extents)
            return TransferHandle(checksums=fused.result)
        hashing = hashing if hashing is not None else self.start_checksums(extents)
        return TransferHandle(checksums=lambda: [f.result() for f in hashing])

    def _page_units(self, page: int) -> torch.Tensor:
        used = self.units_per_page * self.layout.block_bytes
        return self.pages[page, :used].view(self.units_per_page, self.layout.block_bytes)


def kept_segments(rows: np.ndarray, a: int, b: int) -> list[tuple[int, int]]:
    """Maximal runs [s, e) within [a, b) whose rows are not skip markers (< 0)."""
    keep = rows[a:b] >= 0
    if keep.all():
        return [(a, b)]
    edges = np.flatnonzero(np.diff(np.concatenate(([False], keep, [False])).astype(np.int8)))
    return [(a + int(s), a + int(e)) for s, e in zip(edges[::2], edges[1::2])]


# torch 2.13 CPU: index_copy_ of 64 KiB uint8 rows runs at ~2.5 GB/s, a Python loop of row copies at ~6 GB/s
# (and index_select, used for stores, at ~9.5 GB/s); below ~16 KiB a row the loop's overhead wins instead.
_ROW_LOOP_BYTES = 16 << 10


def _scatter_rows(view: torch.Tensor, rows: np.ndarray, index: torch.Tensor, source: torch.Tensor) -> None:
    if source.shape[1] < _ROW_LOOP_BYTES:
        view.index_copy_(0, index, source)
        return
    for k, row in enumerate(rows.tolist()):
        view[row].copy_(source[k])
