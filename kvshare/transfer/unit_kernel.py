"""Moves a staging slot's units to or from the blocks of many separately allocated layers in one kernel launch.

Why: a BlockSpace whose layers share one storage is one group, and a slot's units move with one index op a run. vLLM
0.26 allocates each layer's KV cache by itself (one tensor per layer), so its space has a group per layer and the
torch form costs a slice, a skip check and an index op per layer and chunk: 64 launches a chunk for a 32B model,
~20 us of host time each. A 128k load queues 512 chunks; its host then queues more slowly than the DMA moves them
(H200, 2026-12-05: 0.93 s for 34.4 GB inside vLLM, 37 GB/s against 55 GB/s, where the reference engine, one
storage, reached ~53). Here one launch moves every unit of a slot: each program reads its unit's row (a -1 skip
marker leaves it alone), finds its layer's base address and block stride in a small table, and copies one tile of
one run, in 8-byte words.

Invariants: `LayerTable.of` returns a table only where the kernel serves (Triton on CUDA, or its interpreter on a
CPU; more than one group; every address, stride and run a whole number of words), else None and callers keep the
torch form. The table holds raw addresses of the space's views: it is valid exactly as long as the space (whose
views keep the KV storages alive). A unit's bytes are the same as the torch form moves: run k of unit u is staging
bytes [u * block_bytes + k * run_bytes, + run_bytes), and the block's run k at views[k] row `rows[u]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.transfer.blocks import BlockSpace
from kvshare.transfer.hash_kernel import available  # the same condition: Triton on CUDA, or its interpreter

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton: the torch form serves there
    triton = None

__all__ = ["LayerTable", "available"]

TILE_WORDS = 1024  # 8-byte words one program copies (8 KiB): a 64 KiB run is 8 programs
WORD = 8


@dataclass(frozen=True)
class LayerTable:
    """Per layer and run, the byte address of block row 0 (`bases`, int64 [layers * runs]); per layer the block
    stride in bytes (`strides`, int64 [layers]); both on the space's device."""

    bases: torch.Tensor
    strides: torch.Tensor
    runs: int
    run_words: int
    unit_words: int

    @classmethod
    def of(cls, space: BlockSpace) -> LayerTable | None:
        if len(space.groups) < 2 or not available(space.device) or space.run_bytes % WORD:
            return None
        bases, strides = [], []
        for group in space.groups:
            stride = group.views[0].stride(0)
            for _ in range(group.first_layer, group.end_layer):
                bases.extend(view.data_ptr() for view in group.views)
                strides.append(stride)
        if any(value % WORD for value in bases + strides):
            return None
        return cls(torch.tensor(bases, dtype=torch.int64, device=space.device),
                   torch.tensor(strides, dtype=torch.int64, device=space.device), len(space.groups[0].views),
                   space.run_bytes // WORD, space.layout.block_bytes // WORD)

    def move(self, units: torch.Tensor, rows: torch.Tensor, row_offset: int, u_start: int, u_end: int,
             blocks_per_chunk: int, to_blocks: bool) -> None:
        """Units [u_start, u_end) of one chunk (layer = unit // blocks_per_chunk) between staging `units` (uint8
        [>= u_end - u_start, block_bytes], unit u at row u - u_start) and their blocks (rows[row_offset + u]; < 0:
        skipped), on the current stream. to_blocks: a load's scatter; else a store's gather."""
        if u_end <= u_start:
            return
        grid = (u_end - u_start, self.runs, triton.cdiv(self.run_words, TILE_WORDS))
        _move_units[grid](units.view(torch.int64), rows, self.bases, self.strides, row_offset, u_start,
                          blocks_per_chunk, self.runs, self.run_words, self.unit_words, TO_BLOCKS=to_blocks,
                          TILE=TILE_WORDS)

    def warm(self, units: torch.Tensor) -> None:
        """Compile both directions now, with a unit whose row is a skip marker (nothing moves): at first use they
        would compile inside a request's load or store. The arguments that vary between items are not specialized
        on (`do_not_specialize`), so these two are the only variants a transfer ever runs."""
        # Allocated and launched on the current stream: the allocator reuses its memory only after that stream's
        # queued work, these launches included.
        skip = torch.full((1,), -1, dtype=torch.int64, device=units.device)
        for to_blocks in (True, False):
            self.move(units, skip, 0, 0, 1, 1, to_blocks)


if triton is not None:

    @triton.jit(do_not_specialize=["row_offset", "u_start", "blocks_per_chunk"])
    def _move_units(units, rows, bases, strides, row_offset, u_start, blocks_per_chunk, runs, run_words, unit_words,
                    TO_BLOCKS: tl.constexpr, TILE: tl.constexpr):
        i, k, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        u = u_start + i
        row = tl.load(rows + row_offset + u)
        if row >= 0:
            layer = u // blocks_per_chunk
            address = tl.load(bases + layer * runs + k) + row * tl.load(strides + layer)  # bytes, int64
            block = address.to(tl.pointer_type(tl.int64))
            staged = units + i.to(tl.int64) * unit_words + k * run_words
            cols = tile * TILE + tl.arange(0, TILE)
            inside = cols < run_words
            if TO_BLOCKS:
                tl.store(block + cols, tl.load(staged + cols, mask=inside), mask=inside)
            else:
                tl.store(staged + cols, tl.load(block + cols, mask=inside), mask=inside)
