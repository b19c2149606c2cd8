"""Attention over the paged KV cache: writing new K/V into blocks, gathering a sequence's K/V, and SDPA calls.

Cache layout, per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`, K then V inside each block (the
transfer layer's packed K|V block). Token at position p of a sequence lives in block `block_table[p // block_size]`
at offset `p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvshare.engine import paged_attention as paged
from kvshare.engine.kv_quant import UNIT, KVScales, from_cache, is_quantized, to_cache

# Bound on the expanded K+V temporaries of one KV-head group during prefill attention (bytes). Groups are processed
# one after the other, so the whole sequence's attention never materialises K/V for every query head at once.
GROUP_KV_BUDGET = 1 << 30
# Longest prefill tail (tokens after a prefix hit) given to the paged kernel, by cache dtype. A short tail over a long
# context is bound by reading the context, which the kernel does once, in place; a longer one is bound by its FLOPs,
# where flash attention after the gather was the faster kernel for a bf16 cache (192 tokens at 128k on an H200: 132 ms
# for 64 layers vs the kernel's 139; run 18). An fp8 cache has to be dequantized into the gathered copy, which the
# kernel does as it reads (192 tokens at 32k: 42 ms vs 64).
PAGED_TAIL_MAX_TOKENS = {"model": 128, "fp8": 1024}


@dataclass(frozen=True)
class DecodeStep:
    """Where one decode step's sequences read and write, the same for every layer. `slots`: (block ids, offsets) of
    each new token's K/V. Attention reads either through `paged` (the kernel: device tensors only, so the step can be
    a CUDA graph) or, with `paged` None, per sequence through `tables` and `lengths` (host ints)."""

    slots: tuple[torch.Tensor, torch.Tensor]
    paged: paged.PagedBatch | None = None
    partition: int = 0
    tables: list[torch.Tensor] | None = None
    lengths: list[int] | None = None


def decode_step(tables: list[torch.Tensor], positions: list[int], block_size: int,
                partition: int | None = None) -> DecodeStep:
    """An eager step's DecodeStep: sequence i's newest token at positions[i], its blocks tables[i] (device tensors).
    With a `partition` attention reads through the paged kernel, else gathered per sequence."""
    device = tables[0].device
    slots = (torch.stack([table[p // block_size] for table, p in zip(tables, positions)]),
             torch.tensor([p % block_size for p in positions], device=device))
    if partition is None:
        return DecodeStep(slots, tables=tables, lengths=[p + 1 for p in positions])
    i32 = dict(dtype=torch.int32, device=device)
    batch = paged.PagedBatch(
        tables=torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(torch.int32),
        q_start=torch.arange(len(tables), **i32), q_len=torch.ones(len(tables), **i32),
        kv_len=torch.tensor([p + 1 for p in positions], **i32), q_pos=torch.tensor(positions, **i32), max_q_len=1,
        max_kv_len=max(positions) + 1)
    return DecodeStep(slots, paged=batch, partition=partition)


def slot_indices(block_table: torch.Tensor, start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of positions [start, end): where each token's K/V is written."""
    positions = torch.arange(start, end, device=block_table.device)
    return block_table[positions // block_size], positions % block_size


def write_kv(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             scales: KVScales = UNIT):
    """Scatter k, v ([T, kv_heads, D], compute dtype) into their slots, quantized if the cache is fp8."""
    if is_quantized(cache):
        raw = cache.view(torch.uint8)
        raw[blocks, 0, offsets] = to_cache(k, cache.dtype, scales.k).view(torch.uint8)
        raw[blocks, 1, offsets] = to_cache(v, cache.dtype, scales.v).view(torch.uint8)
        return
    cache[blocks, 0, offsets] = k
    cache[blocks, 1, offsets] = v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, heads: slice,
              dtype: torch.dtype | None = None, scales: KVScales = UNIT) -> tuple[torch.Tensor, ...]:
    """K and V of positions [0, length) for the KV heads `heads`, each [length, h, D] (a contiguous copy), in `dtype`
    (default: the cache's; an fp8 cache is dequantized with `scales`)."""
    block_size = cache.shape[2]
    blocks = block_table[: (length + block_size - 1) // block_size]
    store = cache.view(torch.uint8) if is_quantized(cache) else cache
    k = store[blocks, 0, :, heads].flatten(0, 1)[:length]  # (nb * bs, h, D) -> (length, h, D)
    v = store[blocks, 1, :, heads].flatten(0, 1)[:length]
    if store is not cache:
        k = from_cache(k.view(cache.dtype), dtype or cache.dtype, scales.k)
        v = from_cache(v.view(cache.dtype), dtype or cache.dtype, scales.v)
    return k, v


def _expand(kv: torch.Tensor, queries_per_kv: int) -> torch.Tensor:
    """(S, h, D) -> (1, h * q, S, D): each KV head repeated for the query heads that share it (GQA)."""
    s, h, d = kv.shape
    return kv[:, :, None, :].expand(s, h, queries_per_kv, d).reshape(s, h * queries_per_kv, d).transpose(0, 1)[None]


def tail_plan(block_table: torch.Tensor, start: int, t: int, num_heads: int, cache: torch.Tensor,
              dtype: torch.dtype, in_place: bool) -> paged.TailPlan | None:
    """The paged kernel's plan for a prefill of t tokens after `start` cached ones, where it serves (in place allowed,
    the lower-right case, at most PAGED_TAIL_MAX_TOKENS for the cache's dtype); None: prefill_attention gathers."""
    if not in_place or start <= t or t > PAGED_TAIL_MAX_TOKENS["fp8" if is_quantized(cache) else "model"]:
        return None
    return paged.plan_tail(block_table, start, t, num_heads, cache.shape[3], cache.shape[4], dtype.itemsize)


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, start: int, scale: float,
                      scales: KVScales = UNIT, plan: paged.TailPlan | None = None):
    """Causal attention of queries at positions [start, start + T) over K/V [0, start + T) read from the cache (an fp8
    cache dequantized to q's dtype with `scales`, one KV-head group at a time).

    q: (T, num_heads, D), roped; overwritten in place with the attention output, one KV-head group at a time, so the
    only full-sequence buffer is q itself. Three forms, chosen by which is cheaper on an H200:
    - square (the tail is at least as long as the cached context: no context, or a short prefix-cache hit before a
      long prompt): q is preceded by `start` zero rows whose outputs are dropped, so queries and keys both span
      [0, start + T) and the mask is the plain causal one, with each KV head expanded to its query heads - the form
      cuDNN takes (~560 TFLOP/s at 128k). Query start + i then sees keys [0, start + i], as it must.
    - lower right (a pool hit's short tail, a decode step): query i sees keys [0, start + i] through a lower-right
      causal mask, K/V unexpanded with `enable_gqa`: the few queries of a tail read each cached KV head once, instead
      of once per query head (5x the bytes for a 40/8-head model). That mask goes to flash attention (~330 TFLOP/s),
      which cost a 131k-token prompt after a 16-token prefix-cache hit 13 s more than the same prompt without it
      (two-GPU sessions, docs/results/h200x2); the square form's `start` extra rows cost less than that whenever
      start <= T.
    - in place (a `plan` from tail_plan: the lower-right case on CUDA with Triton, short tails, see
      PAGED_TAIL_MAX_TOKENS): the paged kernel (kvshare.engine.paged_attention) reads K/V through the block table, no
      gathered context.
    """
    if plan is not None:
        paged.tail_attention(q, cache, block_table, start, scale, scales, plan=plan)
        return
    t, num_heads, d = q.shape
    total = start + t
    num_kv_heads = cache.shape[3]
    per_kv = num_heads // num_kv_heads
    square = start <= t
    kv_bytes = 2 * total * d * q.element_size() * (per_kv if square else 1)  # K+V temporaries of one KV head
    group = max(1, min(num_kv_heads, GROUP_KV_BUDGET // max(1, kv_bytes)))
    mask = None if square else causal_lower_right(t, total)
    for g0 in range(0, num_kv_heads, group):
        g1 = min(num_kv_heads, g0 + group)
        k, v = gather_kv(cache, block_table, total, slice(g0, g1), q.dtype, scales)
        qg = q[:, g0 * per_kv : g1 * per_kv].transpose(0, 1)[None]  # (1, hq, T, D)
        if square:
            if start:  # rows for the cached positions: their outputs are dropped below
                qg = torch.cat([qg.new_zeros(*qg.shape[:2], start, d), qg], dim=2)
            out = F.scaled_dot_product_attention(qg, _expand(k, per_kv), _expand(v, per_kv), is_causal=True,
                                                 scale=scale)[:, :, start:]
        else:
            out = F.scaled_dot_product_attention(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                                 scale=scale, enable_gqa=True)
        q[:, g0 * per_kv : g1 * per_kv] = out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, step: DecodeStep, scale: float,
                     scales: KVScales = UNIT) -> torch.Tensor:
    """One query per sequence (its newest token, at position length - 1) over that sequence's whole K/V: through the
    paged kernel where the step carries its batch, else gathered per sequence as in prefill. q: (B, num_heads, D),
    overwritten with the output and returned."""
    if step.paged is not None:
        return paged.attend(q, cache, step.paged, step.partition, scale, scales)
    for i, (table, length) in enumerate(zip(step.tables, step.lengths)):
        prefill_attention(q[i : i + 1], cache, table, length - 1, scale, scales)
    return q
