"""Shared helpers for the transfer tests: KV tensors of every kind, an independent reference packing."""

import numpy as np
import pytest
import torch

from kvshare.transfer import KVLayout
from kvshare.transfer.shm import shm_pages


def make_kv(layout: KVLayout, device="cpu", fused=True, seed=0):
    """num_layers tensors of the layout's kind filled with random bytes: one allocation (fused) or one per layer."""
    generator = torch.Generator(device=device).manual_seed(seed)
    if fused:
        whole = torch.empty((layout.num_layers, *layout.tensor_shape), dtype=layout.dtype, device=device)
        whole.view(torch.uint8).random_(0, 256, generator=generator)
        layers = list(whole.unbind(0))
    else:
        layers = [torch.empty(layout.tensor_shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        for t in layers:
            t.view(torch.uint8).random_(0, 256, generator=generator)
    if layout.kind.name == "vllm_lbnhc":  # physical [B, N, H, 2D] seen as logical [B, H, N, 2D]
        layers = [_as_nhd(t, layout) for t in layers]
    return layers


def _as_nhd(t, layout):
    physical = t.view(layout.num_blocks, layout.block_size, layout.num_kv_heads, 2 * layout.head_size)
    return physical.transpose(1, 2)


def block_bytes_of(layout: KVLayout, tensor: torch.Tensor, block: int) -> np.ndarray:
    """One block of one layer as packed bytes (K then V), read with plain indexing: the reference packing."""
    if layout.kind.name == "split_kv":
        k = tensor[0, block].contiguous().view(torch.uint8).reshape(-1)
        v = tensor[1, block].contiguous().view(torch.uint8).reshape(-1)
        return torch.cat([k, v]).cpu().numpy()
    if layout.kind.name == "vllm_lbnhc":
        return tensor[block].transpose(0, 1).contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
    return tensor[block].contiguous().view(torch.uint8).reshape(-1).cpu().numpy()


def reference_chunk(layout, layers, block_ids) -> np.ndarray:
    return np.concatenate([block_bytes_of(layout, layers[l], b) for l in range(layout.num_layers) for b in block_ids])


@pytest.fixture
def arena():
    """A factory for /dev/shm arenas, all removed at the end of the test even on failure."""
    stack = []

    def make(num_pages, page_size):
        context = shm_pages(num_pages, page_size)
        stack.append(context)
        return context.__enter__()

    yield make
    for context in reversed(stack):
        context.__exit__(None, None, None)
