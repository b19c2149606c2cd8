"""Attention over the paged KV cache: writing new K/V into blocks, gathering a sequence's K/V, and SDPA calls.

Cache layout, per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`, K then V inside each block (the
transfer layer's packed K|V block). Token at position p of a sequence lives in block `block_table[p // block_size]`
at offset `p % block_size`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Bound on the expanded K+V temporaries of one KV-head group during prefill attention (bytes). Groups are processed
# one after the other, so the whole sequence's attention never materialises K/V for every query head at once.
GROUP_KV_BUDGET = 1 << 30


def slot_indices(block_table: torch.Tensor, start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of positions [start, end): where each token's K/V is written."""
    positions = torch.arange(start, end, device=block_table.device)
    return block_table[positions // block_size], positions % block_size


def write_kv(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Scatter k, v ([T, kv_heads, D]) into their slots."""
    cache[blocks, 0, offsets] = k
    cache[blocks, 1, offsets] = v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, heads: slice) -> tuple[torch.Tensor, ...]:
    """K and V of positions [0, length) for the KV heads `heads`, each [length, h, D] (a contiguous copy)."""
    block_size = cache.shape[2]
    blocks = block_table[: (length + block_size - 1) // block_size]
    k = cache[blocks, 0, :, heads].flatten(0, 1)[:length]  # (nb * bs, h, D) -> (length, h, D)
    v = cache[blocks, 1, :, heads].flatten(0, 1)[:length]
    return k, v


def _expand(kv: torch.Tensor, queries_per_kv: int) -> torch.Tensor:
    """(S, h, D) -> (1, h * q, S, D): each KV head repeated for the query heads that share it (GQA)."""
    s, h, d = kv.shape
    return kv[:, :, None, :].expand(s, h, queries_per_kv, d).reshape(s, h * queries_per_kv, d).transpose(0, 1)[None]


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, start: int, scale: float):
    """Causal attention of queries at positions [start, start + T) over K/V [0, start + T) read from the cache.

    q: (T, num_heads, D), roped; overwritten in place with the attention output, one KV-head group at a time, so the
    only full-sequence buffer is q itself. With no cached context the mask is the plain causal one and each KV head
    is expanded to its query heads (the layout cuDNN takes on H200). With context (a pool or prefix-cache hit, a
    decode step) the mask is aligned to the lower right - query i sees keys [0, start + i] - and K/V go in
    unexpanded with `enable_gqa`: the few queries of a tail read each cached KV head once, instead of writing and
    reading it once per query head (5x the bytes for a 40/8-head model, most of a 256k tail's time).
    """
    t, num_heads, d = q.shape
    total = start + t
    num_kv_heads = cache.shape[3]
    per_kv = num_heads // num_kv_heads
    gqa = start > 0
    kv_bytes = 2 * total * d * q.element_size() * (1 if gqa else per_kv)  # K+V temporaries of one KV head
    group = max(1, min(num_kv_heads, GROUP_KV_BUDGET // max(1, kv_bytes)))
    mask = None if start == 0 else causal_lower_right(t, total)
    for g0 in range(0, num_kv_heads, group):
        g1 = min(num_kv_heads, g0 + group)
        k, v = gather_kv(cache, block_table, total, slice(g0, g1))
        qg = q[:, g0 * per_kv : g1 * per_kv].transpose(0, 1)[None]  # (1, hq, T, D)
        if gqa:
            out = F.scaled_dot_product_attention(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                                 scale=scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qg, _expand(k, per_kv), _expand(v, per_kv), is_causal=True,
                                                 scale=scale)
        q[:, g0 * per_kv : g1 * per_kv] = out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: list[torch.Tensor], lengths: list[int],
                     scale: float) -> torch.Tensor:
    """One query per sequence (its newest token, at position length - 1) over that sequence's whole K/V, per KV-head
    group as in prefill; q: (B, num_heads, D), overwritten with the output and returned."""
    for i, (table, length) in enumerate(zip(block_tables, lengths)):
        prefill_attention(q[i : i + 1], cache, table, length - 1, scale)
    return q
