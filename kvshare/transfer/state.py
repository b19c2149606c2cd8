"""A hybrid model's per-sequence state as the pool stores it: `StateLayout` packs every linear layer's recurrent and
convolution state into one extent, and `store_state` / `load_state` copy a packed state between the engine and arena
pages, returning the checksum (kvshare.checksum) of the extent as written or read.

Invariants:
- A packed state is `nbytes` bytes, a multiple of 8 (the checksum hashes 8-byte words); every part starts 64-byte
  aligned and the gaps are zero, so equal states pack to equal bytes.
- Its size does not depend on the chunk: it is one object per chunk boundary, stored beside the chunk's attention
  K/V under its own key (kvshare.keys.state_key), and read only for the boundary a hit ends on.
- Copies run on the caller's thread and stream and are over when these functions return; the checksum is of the
  arena bytes, taken after a store's copy and before a load's (a read lease keeps the pages unchanged meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvshare.hf.config import ModelConfig
from kvshare.transfer.checksum import arena_checksum

ALIGN = 64
# The pool object stored at a chunk boundary where the engine kept no state (vLLM keeps one only where a prefill step
# ended): it holds the chain together up to a later state, and a hit never ends on it (its size tells it apart).
NO_STATE_NBYTES = 8


@dataclass(frozen=True)
class StatePart:
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the packed state

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateLayout:
    """The packed state: for each linear layer in order, its recurrent state (value heads, key dim, value dim) and
    its conv state (conv channels, kernel - 1), each a StatePart."""

    parts: tuple[StatePart, ...]
    nbytes: int

    @classmethod
    def of_model(cls, config: ModelConfig, state_dtype: torch.dtype, conv_dtype: torch.dtype) -> StateLayout:
        lin = config.linear
        if lin is None:
            raise ValueError(f"{config.architecture} has no linear-attention layers: it has no state to store")
        shapes = [((lin.num_value_heads, lin.key_head_dim, lin.value_head_dim), state_dtype),
                  ((lin.conv_dim, lin.conv_kernel - 1), conv_dtype)] * len(lin.linear_layers)
        return cls.of_parts(shapes)

    @classmethod
    def of_parts(cls, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> StateLayout:
        """The packed state of these (shape, dtype) parts, in this order (another engine's own state tensors)."""
        parts, offset = [], 0
        for shape, dtype in shapes:
            parts.append(StatePart(tuple(shape), dtype, offset))
            offset = -(-(offset + parts[-1].nbytes) // ALIGN) * ALIGN
        return cls(tuple(parts), offset)

    def layout_id(self) -> str:
        """What a namespace must carry so that replicas with other state shapes or dtypes never share."""
        return "state:" + ";".join(f"{'x'.join(map(str, p.shape))}/{str(p.dtype).removeprefix('torch.')}"
                                   for p in self.parts)

    def new_buffer(self, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
        """A packed state (uint8 [nbytes]) on `device` whose gaps are zero and whose parts are for the caller to fill
        whole (zeroing all of it cost ~15 ms for a 147 MiB state, at every chunk boundary of a prefill)."""
        packed = torch.empty(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        ends = [p.offset + p.nbytes for p in self.parts]
        for end, start in zip(ends, [p.offset for p in self.parts[1:]] + [self.nbytes]):
            packed[end:start].zero_()
        return packed

    def views(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each part of `packed` (uint8 [nbytes]), in layer order: recurrent, conv, recurrent, ..."""
        if packed.dtype != torch.uint8 or packed.shape != (self.nbytes,):
            raise ValueError(f"a packed state is uint8 [{self.nbytes}], got {packed.dtype} {tuple(packed.shape)}")
        return [packed[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.parts]

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
        """A new packed state holding `tensors` (shapes and dtypes as the parts, in order)."""
        packed = self.new_buffer(device)
        for view, tensor in zip(self.views(packed), tensors, strict=True):
            view.copy_(tensor)
        return packed

    def pages_for(self, page_size: int) -> int:
        return -(-self.nbytes // page_size)


def _page_spans(pages: Sequence[int], nbytes: int, page_size: int):
    """(page, start, end) of each page's share of an extent of nbytes bytes."""
    for k, page in enumerate(pages):
        start = k * page_size
        yield page, start, min(nbytes, start + page_size)


def store_state(arena: torch.Tensor, pages: Sequence[int], packed: torch.Tensor) -> int:
    """Copy a packed state into `pages` of the arena (uint8 [num_pages, page_size]); the checksum of what is there."""
    page_size, nbytes = arena.shape[1], packed.shape[0]
    if len(pages) != -(-nbytes // page_size):
        raise ValueError(f"a state of {nbytes} bytes spans {-(-nbytes // page_size)} pages, got {len(pages)}")
    for page, start, end in _page_spans(pages, nbytes, page_size):
        arena[page, : end - start].copy_(packed[start:end])
    return arena_checksum(arena.numpy(), list(pages), nbytes)


def load_state(arena: torch.Tensor, pages: Sequence[int], out: torch.Tensor) -> int:
    """The checksum of the state in `pages`, then its bytes copied into `out` (a packed state)."""
    page_size, nbytes = arena.shape[1], out.shape[0]
    if len(pages) != -(-nbytes // page_size):
        raise ValueError(f"a state of {nbytes} bytes spans {-(-nbytes // page_size)} pages, got {len(pages)}")
    checksum = arena_checksum(arena.numpy(), list(pages), nbytes)
    for page, start, end in _page_spans(pages, nbytes, page_size):
        out[start:end].copy_(arena[page, : end - start])
    return checksum
