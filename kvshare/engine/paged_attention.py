"""Attention that reads the paged KV cache in place: a Triton kernel for the queries of a prefill tail after a prefix
hit and for decode steps, so no sequence's context is gathered into a contiguous copy first.

Why: a decode step gathered every layer's whole context before SDPA (kvshare.engine.attention.gather_kv): at 32k on
an H200, 14 ms for 64 layers with a bf16 cache and 38 ms with fp8 (dequantized into the copy), against 3.0 and 3.3
ms here (docs/results/h200, run 18). Prefill tails gain where they are bound by reading the context (short ones) or
by the fp8 dequantization; long bf16 tails are bound by their FLOPs and keep the gathered path
(attention.PAGED_TAIL_MAX_TOKENS). Each program loads its K/V tiles through the block table, dequantizing an fp8
cache as it reads, and keeps only running softmax statistics.

Work split (flash-decoding): queries of one KV head are packed as rows (token, query head of the group), so a K/V
tile read serves every query head that shares it (GQA); the keys are cut into partitions of `partition` positions,
one program per (row block, KV head, sequence x partition), each writing its partial output and softmax statistics;
a second kernel combines a row's partitions in order. When one partition covers everything, the first kernel writes
the output itself.

Invariants:
- A sequence's result depends only on its own queries, K/V, positions and the partition size: never on the other
  sequences of a decode batch (the partition of decode steps is fixed per server, not per batch), and the
  partitions of a row are combined in one fixed order. A local prefix hit and a pool hit of the same prompt run
  this kernel with the same arguments, so they agree bit for bit.
- Query row at position p sees keys [0, p] (causal); K/V come only from the cache, which already holds the tail's
  own K/V (written before attention), as in the gathered path.
- fp8 values are dequantized as kvshare.engine.kv_quant.from_cache does: (fp8 -> fp32) x scale, rounded to the
  compute dtype.
- Metadata are device tensors and grid sizes depend only on their static shapes, so a decode step can be captured
  in a CUDA graph (kvshare.engine.cuda_graphs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

from kvshare.engine.kv_quant import UNIT, KVScales, is_quantized

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton: the gathered path serves there
    triton = None

LOG2E = 1.4426950408889634
BLOCK_N = 64  # partitions are multiples of this (the smallest key tile of the settings below: four 16-token blocks)
MIN_PARTITION = 512  # keys per partition at least: below this the partial outputs cost more than they spread
DECODE_MAX_PARTITIONS = 128  # a decode partition grows with --max-model-len so the partial buffers stay bounded
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (sequences x partitions): larger batches launch in parts


def available(device: torch.device) -> bool:
    """True where the kernel can run: Triton importable, and a CUDA device, or a CPU with Triton's interpreter on
    (TRITON_INTERPRET=1, read when Triton was imported: how the tests check the kernel on a machine with no GPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class PagedBatch:
    """The sequences of one call, as device tensors (int32): sequence b's queries are rows
    [q_start[b], q_start[b] + q_len[b]) of q, at positions [kv_len[b] - q_len[b], kv_len[b]); its K/V are positions
    [0, kv_len[b]) through block table row b. `q_pos` is every query row's position; `max_q_len` and `max_kv_len`
    bound q_len and kv_len (host ints: they size the grid)."""

    tables: torch.Tensor  # [B, max_blocks]
    q_start: torch.Tensor  # [B]
    q_len: torch.Tensor  # [B]
    kv_len: torch.Tensor  # [B]
    q_pos: torch.Tensor  # [rows of q]
    max_q_len: int
    max_kv_len: int


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch settings of the partial kernel (results do not depend on them beyond rounding: the
    tests and the H200 probe compare them)."""

    row_block: int  # query rows (token x query head of a group) per program: 16 at least (tl.dot)
    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


DECODE_CONFIG = KernelConfig(16)  # one token: a group's query heads
# Tails: 128 rows a program with 128-key tiles, 8 warps, 3 stages was the fastest of five settings at every tail the
# H200 probe ran (bf16 192 tokens at 32k and 128k, 2,048 at 128k: 7-17% faster than 64 rows with 64-key tiles; fp8 192
# at 32k: within 5% of the best); a tail of at most 25 tokens of a 40/8-head model is then one row block per KV head,
# which reads the context once (docs/results/h200, run 18).
TAIL_CONFIG = KernelConfig(128, 128, 8, 3)


SMALL_TAIL_CONFIG = KernelConfig(64)  # where TAIL_CONFIG's tiles would not fit in shared memory


def default_config(rows: int, head_dim: int, itemsize: int) -> KernelConfig:
    """The setting for `rows` query rows per KV head; TAIL_CONFIG's three stages of 128-key K and V tiles fit an
    H100/H200's shared memory for 2-byte values and heads of at most 128."""
    if rows <= 16:
        return DECODE_CONFIG
    return TAIL_CONFIG if head_dim <= 128 and itemsize <= 2 else SMALL_TAIL_CONFIG


def decode_partition(max_model_len: int) -> int:
    """Keys per partition for decode steps: fixed per server (batch invariance), at least MIN_PARTITION, and large
    enough that a max-length sequence has at most DECODE_MAX_PARTITIONS."""
    return max(MIN_PARTITION, _round_up(-(-max_model_len // DECODE_MAX_PARTITIONS), BLOCK_N))


def tail_partition(rows: int, kv_heads: int, kv_len: int, row_block: int, programs: int) -> int:
    """Keys per partition for one prefill tail: enough partitions that about `programs` programs run, never shorter
    than MIN_PARTITION. Depends only on the call's shape (and the device's size), as the bit-equality of a local
    hit and a pool hit requires."""
    row_blocks = -(-rows // row_block)
    wanted = max(1, min(-(-programs // (row_blocks * kv_heads)), -(-kv_len // MIN_PARTITION)))
    return max(MIN_PARTITION, _round_up(-(-kv_len // wanted), BLOCK_N))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def attend(q: torch.Tensor, cache_: torch.Tensor, batch: PagedBatch, partition: int, scale: float,
           scales: KVScales = UNIT, out: torch.Tensor | None = None,
           config: KernelConfig | None = None) -> torch.Tensor:
    """Attention of q's rows (rows, num_heads, D) over the paged cache; the result goes to `out` (default: q itself,
    overwritten) and is returned. `cache_` is one layer's [num_blocks, 2, block_size, kv_heads, D]."""
    rows, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = cache_.shape
    group = num_heads // kv_heads
    out = q if out is None else out
    config = config or default_config(batch.max_q_len * group, head_dim, q.element_size())
    row_block = config.row_block
    splits = -(-batch.max_kv_len // partition)
    sequences = batch.tables.shape[0]
    row_blocks = -(-batch.max_q_len * group // row_block)
    direct = splits == 1
    if direct:
        acc = m = l_ = out  # unused by the kernel in this mode
    else:
        acc = q.new_empty((splits, rows, num_heads, head_dim), dtype=torch.float32)
        m = q.new_empty((splits, rows, num_heads), dtype=torch.float32)
        l_ = torch.empty_like(m)
    store = cache_.view(torch.uint8) if is_quantized(cache_) else cache_
    partial, combine = _kernels()
    per_launch = max(1, MAX_GRID_Z // splits)  # programs are independent: launching in parts changes no result
    for s0 in range(0, sequences, per_launch):
        part = slice(s0, min(sequences, s0 + per_launch))
        partial[(row_blocks, kv_heads, (part.stop - s0) * splits)](
            q, store, batch.tables[part], batch.q_start[part], batch.q_len[part], batch.kv_len[part], acc, m, l_,
            out, float(scales.k), float(scales.v), scale * LOG2E,
            q.stride(0), batch.tables.stride(0), cache_.stride(0), cache_.stride(1), cache_.stride(2),
            rows * num_heads * head_dim, rows * num_heads, num_heads, splits, partition,
            GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            BLOCK_M=row_block, BLOCK_N=config.block_n, FP8=is_quantized(cache_), DIRECT=direct,
            IEEE=q.dtype == torch.float32, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if not direct:
        combine[(rows, num_heads)](
            acc, m, l_, batch.q_pos, out, rows * num_heads * head_dim, rows * num_heads, out.stride(0), num_heads,
            partition, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=4,
        )
    return out


@dataclass(frozen=True)
class TailPlan:
    """One prefill tail's call, made once per forward and used by every layer (the same positions and blocks)."""

    batch: PagedBatch
    partition: int
    config: KernelConfig


def plan_tail(block_table: torch.Tensor, start: int, t: int, num_heads: int, kv_heads: int, head_dim: int,
              itemsize: int, config: KernelConfig | None = None) -> TailPlan:
    """The plan for queries at positions [start, start + t) over K/V [0, start + t) through `block_table`."""
    device = block_table.device
    total = start + t
    batch = PagedBatch(
        tables=block_table.to(torch.int32)[None], q_start=torch.zeros(1, dtype=torch.int32, device=device),
        q_len=torch.full((1,), t, dtype=torch.int32, device=device),
        kv_len=torch.full((1,), total, dtype=torch.int32, device=device),
        q_pos=torch.arange(start, total, dtype=torch.int32, device=device), max_q_len=t, max_kv_len=total)
    rows = t * (num_heads // kv_heads)
    config = config or default_config(rows, head_dim, itemsize)
    partition = tail_partition(rows, kv_heads, total, config.row_block, 2 * _multiprocessors(device))
    return TailPlan(batch, partition, config)


def tail_attention(q: torch.Tensor, cache_: torch.Tensor, block_table: torch.Tensor, start: int, scale: float,
                   scales: KVScales = UNIT, config: KernelConfig | None = None, plan: TailPlan | None = None) -> None:
    """Causal attention of q (T, num_heads, D; positions [start, start + T)) over K/V [0, start + T) read in place
    from the cache; q is overwritten with the output (kvshare.engine.attention.prefill_attention's contract)."""
    plan = plan or plan_tail(block_table, start, q.shape[0], q.shape[1], cache_.shape[3], q.shape[2], q.element_size(),
                             config)
    attend(q, cache_, plan.batch, plan.partition, scale, scales, config=plan.config)


def warm_up(cache_: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
    """Compile every variant a replica runs (one or several partitions; 16 or 64 rows a program) before the first
    request, instead of inside it (Triton compiles a variant at its first launch: ~1 s each on an H200, run 19's
    first 128k pool hit). Reads block 0 of `cache_`; writes nothing of it."""
    table = torch.zeros(-(-1087 // cache_.shape[2]), dtype=torch.int32, device=cache_.device)
    for t, start in ((1, 99), (1, 1023), (64, 100), (64, 1023)):
        q = torch.zeros(t, num_heads, cache_.shape[4], dtype=dtype, device=cache_.device)
        tail_attention(q, cache_, table, start, 1.0)


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


@cache
def _kernels():
    """(partial, combine) as Triton kernels. With TRITON_INTERPRET=1 set before Triton is imported they run in
    Triton's interpreter, on CPU tensors (how the tests check them on a machine with no GPU)."""
    if triton is None:
        raise RuntimeError("paged attention needs Triton (shipped with torch's CUDA builds)")
    # Runtime sizes are not specialised on (Triton would compile a variant per value divisible by 16 or equal to 1).
    dynamic = ["k_scale", "v_scale", "qk_scale", "acc_split_stride", "ml_split_stride", "splits", "partition"]
    return (triton.jit(_partial, do_not_specialize=dynamic),
            triton.jit(_combine, do_not_specialize=["acc_split_stride", "ml_split_stride", "partition"]))


if triton is not None:

    def _partial(Q, Cache, Tables, QStart, QLen, KvLen, Acc, M, L, Out,
                 k_scale, v_scale, qk_scale,
                 q_row_stride, table_stride, block_stride, kv_stride, token_stride,
                 acc_split_stride, ml_split_stride, num_heads, splits, partition,
                 GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                 DIRECT: tl.constexpr, IEEE: tl.constexpr):
        """One (row block, KV head, sequence x partition): online softmax over the partition's keys up to the block's
        last query position."""
        row_block, kv_head, seq_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq, split = seq_split // splits, seq_split % splits
        q_len = tl.load(QLen + seq)
        first_pos = tl.load(KvLen + seq) - q_len
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len * GROUP
        token = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        pos = first_pos + token
        last_pos = first_pos + tl.minimum((row_block * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        key_lo = split * partition
        # Nothing to do past the sequence's rows or past the block's last position: no row's combine reads it.
        if (row_block * BLOCK_M < q_len * GROUP) & (key_lo <= last_pos):
            key_hi = tl.minimum(key_lo + partition, last_pos + 1)
            d = tl.arange(0, D_PAD)
            d_ok = d < HEAD_DIM
            q_row = (tl.load(QStart + seq) + token).to(tl.int64)
            q_ptrs = Q + q_row[:, None] * q_row_stride + head[:, None] * HEAD_DIM + d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            table = Tables + seq.to(tl.int64) * table_stride
            for key0 in range(key_lo, key_hi, BLOCK_N):
                keys = key0 + tl.arange(0, BLOCK_N)
                key_ok = keys < key_hi
                block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
                slot = block * block_stride + (keys % BLOCK_SIZE) * token_stride + kv_head * HEAD_DIM
                kv_mask = key_ok[:, None] & d_ok[None, :]
                k = tl.load(Cache + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(Cache + kv_stride + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if FP8:  # as kv_quant.from_cache: fp8 -> fp32, times the scale, rounded to the compute dtype
                    k = (k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale).to(q.dtype)
                    v = (v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_scale).to(q.dtype)
                if IEEE:
                    scores = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    scores = tl.dot(q, tl.trans(k))
                visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
                scores = tl.where(visible, scores * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet stays at 0
                alpha = tl.exp2(m_i - m_base)
                p = tl.exp2(scores - m_base[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if DIRECT:  # the only partition: this program holds every key of its rows
                o_ptrs = Out + q_row[:, None] * q_row_stride + head[:, None] * HEAD_DIM + d[None, :]
                tl.store(o_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            else:
                cell = split.to(tl.int64) * ml_split_stride + q_row * num_heads + head
                tl.store(M + cell, m_i, mask=row_ok)
                tl.store(L + cell, l_i, mask=row_ok)
                a_ptrs = Acc + split.to(tl.int64) * acc_split_stride + (q_row * num_heads + head)[:, None] * HEAD_DIM
                tl.store(a_ptrs + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])

    def _combine(Acc, M, L, QPos, Out, acc_split_stride, ml_split_stride, out_row_stride, num_heads, partition,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
        """One (query row, head): its partitions [0, pos // PARTITION] combined in order."""
        row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        parts = tl.load(QPos + row) // partition + 1
        cell = row * num_heads + head
        m = tl.load(M + cell)  # partition 0 always holds key 0, visible to every row
        for s in range(1, parts):
            m = tl.maximum(m, tl.load(M + s * ml_split_stride + cell))
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        weight = tl.exp2(tl.load(M + cell) - m)
        total = weight * tl.load(L + cell)
        acc = weight * tl.load(Acc + cell * HEAD_DIM + d, mask=d_ok, other=0.0)
        for s in range(1, parts):
            weight = tl.exp2(tl.load(M + s * ml_split_stride + cell) - m)  # 0 for a partition with no visible key
            total += weight * tl.load(L + s * ml_split_stride + cell)
            acc += weight * tl.load(Acc + s * acc_split_stride + cell * HEAD_DIM + d, mask=d_ok, other=0.0)
        tl.store(Out + row * out_row_stride + head * HEAD_DIM + d, (acc / total).to(Out.dtype.element_ty), mask=d_ok)
