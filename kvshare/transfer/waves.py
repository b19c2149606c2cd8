"""Layer waves: the order in which a layered load moves a batch's pages, and after which wave each layer is whole.

A load split into waves moves, wave after wave, the pages of every chunk that hold the wave's layers, so that the
engine can run a layer's attention as soon as that layer's K/V has landed instead of after the whole load: the tail's
compute overlaps the copy, and only the last wave's layers run after it. Waves shrink by halves towards the end
(64 layers in 4 waves: 32, 16, 8, 8) so that little compute is left after the last copy while the number of copies
(chunks x waves) stays small.

Units are layer-major inside a chunk (kvshare.transfer.layout), so a wave's units of one chunk are one run of its
pages. A page can hold units of several layers; it belongs to the wave of its last layer, and a layer is whole only
after the wave of the last page that holds any of its units (`ready`). So that a wave's first layer starts a page,
each wave start moves up to the next layer that begins a page of the batch's largest chunk (a 2 MiB page holds 8
layers of a small model's chunk: a wave starting at layer 6 would share that page with the wave before, which then
holds nothing; docs/results/cpu-load-waves). Invariants (tests/transfer/test_waves.py):
every page of every chunk is in exactly one item; items of a wave come after those of every earlier wave; every
page holding a unit of layer l is in a wave <= ready[l].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvshare.transfer.jobs import ChunkPlan


def wave_starts(num_layers: int, waves: int) -> tuple[int, ...]:
    """First layer of each wave: [0, L/2, 3L/4, ...] up to `waves` waves, each nonempty (fewer for few layers)."""
    if waves < 1:
        raise ValueError(f"a load needs at least one wave, got {waves}")
    starts = [0]
    for k in range(1, waves):
        start = num_layers - num_layers // (1 << k)
        if start <= starts[-1] or start >= num_layers:
            break
        starts.append(start)
    return tuple(starts)


def page_aligned(starts: tuple[int, ...], num_layers: int, blocks_per_chunk: int,
                 units_per_page: int) -> tuple[int, ...]:
    """Each start moved up to the first layer at or after it whose first unit begins a page (layer l's units begin
    at l * blocks_per_chunk); starts that reach the end, or meet the one before, are dropped."""
    aligned = [0]
    for start in starts[1:]:
        layer = next((l for l in range(start, num_layers) if l * blocks_per_chunk % units_per_page == 0), num_layers)
        if aligned[-1] < layer < num_layers:
            aligned.append(layer)
    return tuple(aligned)


@dataclass(frozen=True)
class WaveItem:
    """Pages [j0, j1) of chunk `chunk` (an index into the batch's plans), all in wave `wave`."""

    chunk: int
    j0: int
    j1: int
    wave: int


@dataclass(frozen=True)
class WavePlan:
    waves: tuple[tuple[WaveItem, ...], ...]  # per wave, its items by chunk; move them in this order
    ready: np.ndarray  # int64 [num_layers]: the wave after which the layer is whole (-1: the batch moves none of it)

    @property
    def items(self) -> tuple[WaveItem, ...]:
        return tuple(item for wave in self.waves for item in wave)


def plan_waves(plans: list[ChunkPlan], num_layers: int, waves: int, max_pages: int | None = None) -> WavePlan:
    """The order of a batch's pages for a load in at most `waves` waves, each item at most `max_pages` pages."""
    starts = wave_starts(num_layers, waves)
    if plans:
        largest = max(plans, key=lambda chunk: chunk.blocks_per_chunk)
        starts = page_aligned(starts, num_layers, largest.blocks_per_chunk, largest.units_per_page)
    ready = np.full(num_layers, -1, dtype=np.int64)
    per_wave: list[list[WaveItem]] = [[] for _ in starts]
    for c, chunk in enumerate(plans):
        page_waves, layer_ready = _chunk_waves(len(chunk.rows), len(chunk.pages), chunk.units_per_page,
                                               chunk.blocks_per_chunk, starts)
        np.maximum(ready, layer_ready, out=ready)
        for wave, j0, j1 in _runs(page_waves, max_pages or len(chunk.pages)):
            per_wave[wave].append(WaveItem(c, j0, j1, wave))
    return WavePlan(tuple(tuple(items) for items in per_wave), ready)


@lru_cache(maxsize=64)
def _chunk_waves(units: int, pages: int, units_per_page: int, blocks_per_chunk: int,
                 starts: tuple[int, ...]) -> tuple[tuple[int, ...], np.ndarray]:
    """(wave of each page, ready wave of each layer) for a chunk of this shape: the same for every full chunk of a
    batch, so computed once."""
    j = np.arange(pages)
    last_unit = np.minimum((j + 1) * units_per_page, units) - 1
    page_wave = np.searchsorted(starts, last_unit // blocks_per_chunk, side="right") - 1
    layers = units // blocks_per_chunk
    last_page_of_layer = ((np.arange(layers) + 1) * blocks_per_chunk - 1) // units_per_page
    layer_ready = page_wave[last_page_of_layer]
    layer_ready.setflags(write=False)  # shared by every caller through the cache
    return tuple(int(w) for w in page_wave), layer_ready


@lru_cache(maxsize=64)
def _runs(page_waves: tuple[int, ...], max_pages: int) -> list[tuple[int, int, int]]:
    """(wave, j0, j1): maximal runs of consecutive pages of one wave, cut every max_pages pages."""
    runs, j0 = [], 0
    for j in range(1, len(page_waves) + 1):
        if j == len(page_waves) or page_waves[j] != page_waves[j0] or j - j0 == max_pages:
            runs.append((page_waves[j0], j0, j))
            j0 = j
    return runs
