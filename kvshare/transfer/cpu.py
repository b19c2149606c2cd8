"""The CPU path: gathers and scatters straight between the KV tensors and arena page views, with no staging copy.

Every copy runs synchronously on the calling thread, so a returned TransferHandle is already done and stream races do
not apply (torch CPU ops complete before they return); a load in waves runs on the transfer's loader thread instead,
and its handle's wait_layer/wait block until the pages they name are in the blocks. Checksums hash on host threads:
a store's after its copies (they hash what was written), a load's while its copies run (both only read the pages,
which a read lease keeps); with the compiled loop of kvshare.transfer.fused_hash once it is built (it runs without
the GIL), numpy until then.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvshare.transfer import fused_hash
from kvshare.transfer.checksum import results_of, run_on_every_cpu
from kvshare.transfer.jobs import ChunkPlan, TransferHandle
from kvshare.transfer.transfer import Transfer, TransferOptions
from kvshare.transfer.waves import WavePlan


class CpuTransfer(Transfer):
    def __init__(self, space, pages: torch.Tensor, options: TransferOptions):
        super().__init__(space, pages, options)
        fused_hash.prepare()  # "auto": built in the background; hashing uses numpy until it is ready
        self._loader_thread: ThreadPoolExecutor | None = None

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
        return TransferHandle(checksums=results_of(self.start_checksums(self._extents(plans))))

    def _load(self, plans: list[ChunkPlan], checksums: bool) -> TransferHandle:
        hashing = self.start_checksums(self._extents(plans)) if checksums else None
        for chunk in plans:
            self._load_pages(chunk, torch.from_numpy(chunk.rows), 0, len(chunk.pages))
        return TransferHandle(checksums=results_of(hashing))

    def _load_waves(self, plans: list[ChunkPlan], checksums: bool, waves: WavePlan) -> TransferHandle:
        """The copies on the loader thread, wave after wave, each wave's event set once its pages are in the blocks;
        the caller's wait_layer(l) waits for the event of layer l's wave. A copy that raises sets every event (no
        reader waits forever) and makes wait() raise: the loaded blocks then count as not computed."""
        hashing = self.start_checksums(self._extents(plans)) if checksums else None
        landed = [threading.Event() for _ in waves.waves]
        rows = [torch.from_numpy(chunk.rows) for chunk in plans]

        def copy_waves() -> None:
            try:
                for wave, items in enumerate(waves.waves):
                    for item in items:
                        self._load_pages(plans[item.chunk], rows[item.chunk], item.j0, item.j1)
                    landed[wave].set()  # this wave's pages (and every earlier wave's) are in the blocks
            finally:
                for event in landed:
                    event.set()

        copying = self._loader().submit(copy_waves)

        def layer_ready(layer: int) -> None:
            wave = int(waves.ready[layer])
            if wave >= 0:
                landed[wave].wait()

        return TransferHandle(is_done=copying.done, wait=copying.result, checksums=results_of(hashing),
                              layer_ready=layer_ready)

    def _load_pages(self, chunk: ChunkPlan, rows: torch.Tensor, j0: int, j1: int) -> None:
        """Pages [j0, j1) of a chunk into its blocks (units whose row is a skip marker stay untouched)."""
        for j, page in enumerate(chunk.pages[j0:j1].tolist(), start=j0):
            u0, u1 = chunk.page_units(j)
            units = self._page_units(page)
            for group, a, b in self.space.group_spans(chunk.blocks_per_chunk, u0, u1):
                for s, e in kept_segments(chunk.rows, a, b):
                    for view, offset in zip(group.views, self.space.run_offsets):
                        source = units[s - u0 : e - u0, offset : offset + self.space.run_bytes]
                        _scatter_rows(view, chunk.rows[s:e], rows[s:e], source)

    def _loader(self) -> ThreadPoolExecutor:
        """One thread per transfer runs layered loads (one at a time: the engine waits for a load before the next)."""
        if self._loader_thread is None:
            self._loader_thread = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load",
                                                     initializer=run_on_every_cpu)
        return self._loader_thread

    def close(self) -> None:
        if self._loader_thread is not None:
            self._loader_thread.shutdown(wait=True)
        super().close()

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
