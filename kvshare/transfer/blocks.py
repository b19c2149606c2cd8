"""`BlockSpace`: uint8 row views over an engine's KV tensors, so any layer's block is one row index away.

A *group* is a set of consecutive layers that one view can address: row `row_base[layer] + block_id` of the
group's run view r is run r of that block. When every layer lives in one storage at offsets that are whole block
strides apart (one big KV allocation sliced per layer: the reference engine, vLLM's layer-compact layouts), all
layers form one group and a whole chunk moves with one gather per run; otherwise each layer is its own group.
Views alias the KV tensors (no copies); they are valid as long as those tensors are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvshare.transfer.kinds import Runs
from kvshare.transfer.layout import KVLayout, LayoutMismatch


@dataclass(frozen=True)
class Group:
    first_layer: int
    end_layer: int  # exclusive
    views: tuple[torch.Tensor, ...]  # one per run: uint8 [rows, run_bytes], rows strided by the block stride


@dataclass(frozen=True)
class BlockSpace:
    layout: KVLayout
    groups: tuple[Group, ...]
    row_base: np.ndarray  # int64 [num_layers]: row of block 0 of each layer within its group's views
    run_offsets: tuple[int, ...]  # byte offset of each run inside a packed unit (K run at 0)
    run_bytes: int

    @property
    def device(self) -> torch.device:
        return self.groups[0].views[0].device

    def rows(self, block_ids: np.ndarray) -> np.ndarray:
        """int64 [..., num_layers * blocks] for block_ids [..., blocks] (one chunk, or a batch of equal chunks): the
        row of every unit of a chunk, in packed (layer-major) order. A block id of -1 gives -1 (a skip marker)."""
        ids = block_ids[..., None, :]  # [..., 1, blocks] against row_base [layers, 1]
        return np.where(ids < 0, -1, self.row_base[:, None] + ids).reshape(*block_ids.shape[:-1], -1)

    def group_spans(self, blocks_per_chunk: int, u0: int, u1: int) -> list[tuple[Group, int, int]]:
        """Units [u0, u1) of a chunk split by group: (group, a, b) with u0 <= a < b <= u1."""
        spans = []
        for group in self.groups:
            a = max(u0, group.first_layer * blocks_per_chunk)
            b = min(u1, group.end_layer * blocks_per_chunk)
            if a < b:
                spans.append((group, a, b))
        return spans


def build_block_space(layout: KVLayout, kv_caches: Sequence[torch.Tensor]) -> BlockSpace:
    """Check `kv_caches` against `layout` and build the row views (fused into one group when possible)."""
    layout.check_tensors(kv_caches)
    runs = [layout.kind.runs(layout, tensor) for tensor in kv_caches]
    run_bytes = runs[0].length
    run_offsets = tuple(i * run_bytes for i in range(len(runs[0].offsets)))
    fused = _fused_rows(kv_caches, runs)
    if fused is not None:
        base, row_base = fused
        rows = int(row_base.max()) + layout.num_blocks
        group = Group(0, layout.num_layers, _views(kv_caches[0], runs[0], base, rows))
        return BlockSpace(layout, (group,), row_base, run_offsets, run_bytes)
    groups = tuple(
        Group(layer, layer + 1, _views(tensor, run, 0, layout.num_blocks))
        for layer, (tensor, run) in enumerate(zip(kv_caches, runs))
    )
    return BlockSpace(layout, groups, np.zeros(layout.num_layers, dtype=np.int64), run_offsets, run_bytes)


def _fused_rows(kv_caches: Sequence[torch.Tensor], runs: list[Runs]) -> tuple[int, np.ndarray] | None:
    """(byte shift of the lowest layer, row of block 0 per layer) when one view can address every layer."""
    storage = kv_caches[0].untyped_storage().data_ptr()
    stride = runs[0].block_stride
    if any(t.untyped_storage().data_ptr() != storage for t in kv_caches) or any(
        r.block_stride != stride or _gaps(r) != _gaps(runs[0]) for r in runs
    ):
        return None
    starts = np.array([r.offsets[0] for r in runs], dtype=np.int64)
    shifts = starts - starts.min()
    if np.any(shifts % stride):
        return None
    return int(starts.min() - runs[0].offsets[0]), shifts // stride


def _gaps(runs: Runs) -> tuple[int, ...]:
    return tuple(offset - runs.offsets[0] for offset in runs.offsets)


def _views(tensor: torch.Tensor, runs: Runs, shift: int, rows: int) -> tuple[torch.Tensor, ...]:
    """uint8 [rows, run_bytes] views of the tensor's storage, one per run, starting `shift` bytes after run 0."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    try:
        return tuple(
            torch.as_strided(flat, (rows, runs.length), (runs.block_stride, 1), offset + shift)
            for offset in runs.offsets
        )
    except RuntimeError as error:  # as_strided checks the extent against the storage
        raise LayoutMismatch(f"KV tensor storage too small for the layout's blocks: {error}") from error
