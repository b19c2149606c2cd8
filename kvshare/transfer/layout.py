"""`KVLayout`: the shape, dtype and memory kind of an engine's paged KV cache, and the packing of chunks into pages.

Packing (the pool's byte format for a chunk; see docs/architecture.md):
- A chunk of N tokens (N a multiple of block_size) is `N / block_size` blocks x `num_layers` *units*; a unit is one
  block of one layer, K bytes then V bytes, `block_bytes` long.
- Units are layer-major: unit u = layer * blocks_per_chunk + block_in_chunk.
- `units_per_page = page_size // block_bytes`; page j of a chunk holds units [j*upp, (j+1)*upp) back to back from
  its first byte. Units never straddle pages; the tail of a page past its last unit is unused and never read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import torch
import xxhash

from kvshare.transfer.kinds import KVKind, PackedKV, kind_named
from kvshare.units import format_size

_LAYOUT_TAG = b"kvshare/kvlayout/v1\0"


class LayoutMismatch(ValueError):
    """The KV tensors do not match the layout that was said to describe them."""


@dataclass(frozen=True)
class KVLayout:
    """An engine's per-layer paged KV cache. Invariant: `kind.shape(self)` is every layer tensor's shape."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kind: KVKind = field(default_factory=PackedKV)

    def __post_init__(self):
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "kind", kind_named(self.kind))

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # no tensor made: plan() asks for it per chunk (2,049 times for a 128k load)

    @property
    def block_bytes(self) -> int:
        """One block of one layer, K and V: the packing unit."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return self.kind.shape(self)

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        if chunk_tokens <= 0 or chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk of {chunk_tokens} tokens is not a positive multiple of the block size {self.block_size}: "
                f"use a chunk size such as {self.block_size * max(1, chunk_tokens // self.block_size)}"
            )
        return chunk_tokens // self.block_size

    def units_per_chunk(self, chunk_tokens: int) -> int:
        return self.blocks_per_chunk(chunk_tokens) * self.num_layers

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Payload bytes of a chunk: units x block_bytes (what the checksum covers)."""
        return self.units_per_chunk(chunk_tokens) * self.block_bytes

    def units_per_page(self, page_size: int) -> int:
        upp = page_size // self.block_bytes
        if upp == 0:
            raise ValueError(
                f"pool page of {format_size(page_size)} is smaller than one KV block of one layer "
                f"({format_size(self.block_bytes)}): start the pool with a page size of at least "
                f"{format_size(self.block_bytes)} (a multiple of it wastes nothing)"
            )
        return upp

    def pages_needed(self, chunk_tokens: int, page_size: int) -> int:
        upp = self.units_per_page(page_size)
        return -(-self.units_per_chunk(chunk_tokens) // upp)

    def chunk_nbytes(self, chunk_tokens: int, page_size: int) -> int:
        """The byte extent of a stored chunk, for the pool's RESERVE: byte i of it lives in page i // page_size, so
        the pool allocates exactly `pages_needed` pages (page tails past the last unit included, never read)."""
        pages = self.pages_needed(chunk_tokens, page_size)
        last_units = self.units_per_chunk(chunk_tokens) - (pages - 1) * self.units_per_page(page_size)
        return (pages - 1) * page_size + last_units * self.block_bytes

    # ---- identity ----------------------------------------------------------------------------------------------
    def layout_id(self) -> str:
        """Stable hex id of everything that changes a chunk's bytes: kind, per-block shape, dtype, block size.

        num_blocks is left out on purpose: replicas with different amounts of KV memory store identical chunks."""
        fields = {
            "kind": self.kind.name,
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return xxhash.xxh3_128_hexdigest(_LAYOUT_TAG + canonical)

    def describe(self) -> str:
        return (
            f"{self.kind.name} L{self.num_layers} x {self.num_blocks} blocks x {self.block_size} tok x "
            f"{self.num_kv_heads}h x {self.head_size}d {str(self.dtype).removeprefix('torch.')}"
        )

    # ---- tensors -----------------------------------------------------------------------------------------------
    def check_tensors(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Raise LayoutMismatch unless `kv_caches` are num_layers tensors of this shape, kind, dtype, one device."""
        if len(kv_caches) != self.num_layers:
            raise LayoutMismatch(f"layout has {self.num_layers} layers but {len(kv_caches)} KV tensors were given")
        device = kv_caches[0].device
        for index, tensor in enumerate(kv_caches):
            problem = self._tensor_problem(tensor, device)
            if problem:
                raise LayoutMismatch(f"KV tensor of layer {index}: {problem} (layout: {self.describe()})")

    def _tensor_problem(self, tensor: torch.Tensor, device: torch.device) -> str | None:
        if tensor.dtype != self.dtype:
            return f"dtype {tensor.dtype}, expected {self.dtype}"
        if tuple(tensor.shape) != self.tensor_shape:
            return f"shape {tuple(tensor.shape)}, expected {self.tensor_shape} for kind {self.kind.name}"
        if tensor.device != device:
            return f"on {tensor.device} while layer 0 is on {device}: keep all layers on one device"
        return self.kind.check(self, tensor)

    @classmethod
    def from_tensors(
        cls, kv_caches: Sequence[torch.Tensor], kind: str | KVKind = "packed_kv", block_size: int | None = None
    ) -> KVLayout:
        """The layout of `kv_caches` read as `kind`; raises LayoutMismatch if any tensor does not fit it.

        `block_size`, when given, must match the tensors (a check that the engine's block size was understood)."""
        if not kv_caches:
            raise LayoutMismatch("no KV tensors given")
        kind = kind_named(kind)
        first = kv_caches[0]
        probe = cls(1, 1, 1, 1, 1, first.dtype, kind)
        if first.dim() != len(probe.tensor_shape):
            raise LayoutMismatch(
                f"KV tensor of layer 0 has {first.dim()} dims {tuple(first.shape)}; kind {kind.name} expects "
                f"{len(probe.tensor_shape)}: {kind.__doc__.splitlines()[0]}"
            )
        layout = cls(num_layers=len(kv_caches), dtype=first.dtype, kind=kind, **_dims_of(kind, first))
        if block_size is not None and block_size != layout.block_size:
            raise LayoutMismatch(f"tensors have block size {layout.block_size}, expected {block_size}")
        layout.check_tensors(kv_caches)
        return layout


def _dims_of(kind: KVKind, tensor: torch.Tensor) -> dict[str, int]:
    """Read num_blocks, block_size, heads and head size off a tensor, by matching the kind's shape formula."""
    unit = KVLayout(1, 1, 1, 1, 1, tensor.dtype, kind)
    names = ("num_blocks", "block_size", "num_kv_heads", "head_size")
    dims = {}
    for name in names:  # which axis carries each dimension: perturb one at a time and see which axis moves
        bumped = KVLayout(1, **{n: (3 if n == name else 1) for n in names}, dtype=tensor.dtype, kind=kind)
        axis = next(i for i, (a, b) in enumerate(zip(unit.tensor_shape, bumped.tensor_shape)) if a != b)
        scale = bumped.tensor_shape[axis] // 3  # 2 for the "2 * head_size" axis of vLLM kinds, else 1
        size = tensor.shape[axis]
        if size % scale:
            raise LayoutMismatch(f"axis {axis} of shape {tuple(tensor.shape)} must be a multiple of {scale}")
        dims[name] = size // scale
    return dims
