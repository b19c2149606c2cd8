"""Where K and V live inside one layer's KV tensor: one small strategy class per supported memory layout.

Every kind answers the same three questions, so no code outside this file branches on the layout:
- `shape(layout)`: the per-layer tensor shape it expects;
- `check(layout, tensor)`: what is wrong with a tensor's strides, or None;
- `runs(layout, tensor)`: where one block's bytes are, as byte runs (offset of block 0, block stride, length).
A packed unit (one block of one layer) is always the concatenation of its runs, in order: K bytes then V bytes.

What vLLM 0.32 hands a KV connector (read from vllm 0.32.0's `vllm/v1/kv_cache_interface.py`
(`compute_layout_strides`, `create_kv_cache_views`), `vllm/v1/kv_cache_layout.py`,
`vllm/v1/attention/backends/{flash_attn,cpu_attn,utils}.py`):
- Every attention layer gets a 4-D view with logical shape `[num_blocks, num_kv_heads, block_size, 2 * head_size]`
  (`[B, H, N, C]`): K and V are concatenated on the last axis (`kv_cache.split(head_size, dim=-1)` gives K, V).
  The physical order is the resolved `KVCacheLayout` (a stride permutation of `[L, B, H, N, C]`).
- CUDA, FlashAttention backend: it declares no layout preference, so the default preference applies and the
  layout is `LBNHC` (alias "NHD"): strides (elements) `(>= N*H*2D, 2D, H*2D, 1)` — each block is one dense run of
  `block_bytes`, token-major inside: for each token, for each head, K (D values) then V (D values).
  -> kind `VllmNHD` ("vllm_lbnhc").
- CPU (`CPU_ATTN` backend): declares only `LBHNC` (alias "HND"), the identity order, so the view is contiguous
  with strides `(H*N*2D, N*2D, 2D, 1)` — each block one dense run, head-major inside. Block size 128 by default.
  -> kind `VllmHND` ("vllm_lbhnc").
- In both, layers of one KV-cache group are slices of one raw buffer (layer-compact layouts), so the block stride
  may exceed the block's bytes only with page padding; the transfer layer accepts any block stride >= the block.
  vLLM 0.26 (`gpu_model_runner._allocate_kv_cache_tensors`) allocates each layer by itself instead, unless a model
  has several groups and asks for cross-layer blocks: the same per-layer view, one storage per layer (on CUDA the
  transfer then moves a slot with kvshare.transfer.unit_kernel).
  Layouts with B outside L (`BL*`) interleave layers inside a block; they still pass `check` (each layer's block is
  one run) and are copied layer by layer.

The reference engine uses `PackedKV` (`[num_blocks, 2, block_size, num_kv_heads, head_size]`); `SplitKV` is the
classic `[2, num_blocks, block_size, num_kv_heads, head_size]` whose K and V halves of a block are two runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from kvshare.transfer.layout import KVLayout


@dataclass(frozen=True)
class Runs:
    """Byte runs of block 0 of one layer tensor, relative to the start of its storage.

    Block b's run i starts at `offsets[i] + b * block_stride` and is `length` bytes long."""

    offsets: tuple[int, ...]
    block_stride: int
    length: int


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class KVKind:
    """Base strategy: a block-major tensor (dim 0 is the block) whose block is one dense run of `block_bytes`."""

    name: ClassVar[str] = ""

    def shape(self, layout: KVLayout) -> tuple[int, ...]:
        raise NotImplementedError

    def inner_strides(self, layout: KVLayout) -> tuple[int, ...]:
        """Required strides (elements) of every dim after the block dim."""
        return _dense_strides(self.shape(layout)[1:])

    def check(self, layout: KVLayout, tensor: torch.Tensor) -> str | None:
        inner, block_elems = self.inner_strides(layout), layout.block_bytes // layout.itemsize
        if tuple(tensor.stride()[1:]) != inner:
            return f"strides {tuple(tensor.stride())} do not match ({'>=' + str(block_elems)}, *{inner}) of {self.name}"
        if tensor.stride(0) < block_elems:
            return f"block stride {tensor.stride(0)} < {block_elems} elements: blocks would overlap"
        return None

    def runs(self, layout: KVLayout, tensor: torch.Tensor) -> Runs:
        item = layout.itemsize
        return Runs((tensor.storage_offset() * item,), tensor.stride(0) * item, layout.block_bytes)


@dataclass(frozen=True)
class PackedKV(KVKind):
    """`[num_blocks, 2, block_size, num_kv_heads, head_size]`: the reference engine's layout; one block = K then V."""

    name: ClassVar[str] = "packed_kv"

    def shape(self, layout):
        return (layout.num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_size)


@dataclass(frozen=True)
class VllmNHD(KVKind):
    """vLLM 0.32 on CUDA (FlashAttention, layout LBNHC): logical `[B, H, N, 2D]`, physical `[B, N, H, 2D]`."""

    name: ClassVar[str] = "vllm_lbnhc"

    def shape(self, layout):
        return (layout.num_blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_size)

    def inner_strides(self, layout):
        two_d = 2 * layout.head_size
        return (two_d, layout.num_kv_heads * two_d, 1)


@dataclass(frozen=True)
class VllmHND(KVKind):
    """vLLM 0.32 on CPU (CPU_ATTN, layout LBHNC): `[B, H, N, 2D]`, dense inside each block."""

    name: ClassVar[str] = "vllm_lbhnc"

    def shape(self, layout):
        return (layout.num_blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_size)


@dataclass(frozen=True)
class SplitKV(KVKind):
    """`[2, num_blocks, block_size, num_kv_heads, head_size]`: all K blocks, then all V blocks (two runs a block)."""

    name: ClassVar[str] = "split_kv"

    def shape(self, layout):
        return (2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)

    def check(self, layout, tensor):
        inner = _dense_strides(self.shape(layout)[2:])
        half = layout.block_bytes // layout.itemsize // 2
        if tuple(tensor.stride()[2:]) != inner or tensor.stride(1) < half:
            return f"strides {tuple(tensor.stride())} do not match (K/V, >={half}, *{inner}) of {self.name}"
        if tensor.stride(0) < tensor.stride(1) * layout.num_blocks:
            return f"K/V stride {tensor.stride(0)} makes the K and V halves overlap"
        return None

    def runs(self, layout, tensor):
        item, base = layout.itemsize, tensor.storage_offset() * layout.itemsize
        half = layout.block_bytes // 2
        return Runs((base, base + tensor.stride(0) * item), tensor.stride(1) * item, half)


KINDS: dict[str, KVKind] = {kind.name: kind for kind in (PackedKV(), VllmNHD(), VllmHND(), SplitKV())}


def kind_named(kind: str | KVKind) -> KVKind:
    """A kind from its name (or the kind itself). Raises ValueError naming the known kinds."""
    if isinstance(kind, KVKind):
        return kind
    if kind not in KINDS:
        raise ValueError(f"unknown KV layout kind {kind!r}: use one of {', '.join(KINDS)}")
    return KINDS[kind]
