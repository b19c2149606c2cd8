"""The paged-attention kernel (kvshare.engine.paged_attention) against attention computed in float64 from the same
cache, on CUDA, or on a CPU under Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported:
tests/engine/test_paged_interpreter.py runs this file that way). Skipped where neither can run.

What must hold: every row attends exactly to its keys [0, position] (prefill tails at several lengths, block-table
order scrambled, head sizes that are not a power of two, fp8 caches dequantized with their scales); the partitioned
and the single-partition forms agree; a sequence's decode result is bit-for-bit the same alone or in a batch, and
whatever bound the grid was sized for (what CUDA graphs and batch invariance rely on)."""

import pytest
import torch

from kvshare.engine import paged_attention as pa
from kvshare.engine.attention import slot_indices, write_kv
from kvshare.engine.kv_quant import KVScales, from_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not pa.available(DEVICE), reason="needs CUDA + Triton, or Triton's interpreter")
# The interpreter computes in numpy, which has no bfloat16: CPU runs check fp32 compute (fp32 and fp8 caches).
COMPUTE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOLERANCE = 2e-2 if COMPUTE == torch.bfloat16 else 1e-5  # relative Frobenius error vs float64


def filled_cache(kv_dtype, length, kv_heads, head_dim, block_size=16, scales=KVScales(), seed=0):
    """A cache holding `length` positions of random K/V through a scrambled block table; (cache, table, k, v) with
    k, v the values the cache returns (dequantized: what attention must see)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-length // block_size) + 3
    cache = torch.zeros(2 * blocks, 2, block_size, kv_heads, head_dim, dtype=kv_dtype, device=DEVICE)
    table = torch.randperm(2 * blocks, generator=g)[:blocks].to(DEVICE)
    k = torch.randn(length, kv_heads, head_dim, generator=g).to(DEVICE, COMPUTE)
    v = torch.randn(length, kv_heads, head_dim, generator=g).to(DEVICE, COMPUTE)
    where = slot_indices(table, 0, length, block_size)
    write_kv(cache, *where, k, v, scales)
    store = cache.view(torch.uint8) if kv_dtype == torch.float8_e4m3fn else cache
    read_k = store[where[0], 0, where[1]].view(kv_dtype)
    read_v = store[where[0], 1, where[1]].view(kv_dtype)
    return cache, table, from_cache(read_k, COMPUTE, scales.k), from_cache(read_v, COMPUTE, scales.v)


def reference(q, k, v, positions, scale):
    """float64 causal attention: row i (position positions[i]) over keys [0, positions[i]]; GQA by head groups."""
    q64, k64, v64 = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    out = torch.empty_like(q64)
    for i, p in enumerate(positions):
        scores = torch.einsum("hd,shd->hs", q64[i], k64[: p + 1]) * scale
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v64[: p + 1])
    return out


def relative_error(out, ref):
    out = out.double().cpu()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("config", [None, pa.TAIL_CONFIG], ids=["default", "128-rows"])
@pytest.mark.parametrize("kv_dtype", ["model", "fp8"])
@pytest.mark.parametrize(("start", "tail", "heads", "kv_heads", "head_dim"), [
    (700, 1, 8, 2, 64),  # a one-token tail
    (1000, 37, 8, 2, 64),  # a tail crossing blocks
    (1500, 5, 6, 3, 48),  # head size padded to 64 inside the kernel
    (100, 20, 4, 4, 32),  # one partition: the kernel writes the output itself
])
def test_tail_matches_float64(kv_dtype, start, tail, heads, kv_heads, head_dim, config):
    dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else COMPUTE
    scales = KVScales(0.5, 2.0) if kv_dtype == "fp8" else KVScales()
    cache, table, k, v = filled_cache(dtype, start + tail, kv_heads, head_dim, scales=scales, seed=start)
    q = torch.randn(tail, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, COMPUTE)
    ref = reference(q, k, v, range(start, start + tail), head_dim**-0.5)
    pa.tail_attention(q, cache, table, start, head_dim**-0.5, scales, config)  # q is overwritten with the output
    assert relative_error(q, ref) < TOLERANCE


def test_partitioned_equals_single_partition():
    """The same rows through many partitions and through one: the combine step loses nothing."""
    cache, table, k, v = filled_cache(COMPUTE, 1300, 2, 64)
    q = torch.randn(9, 8, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, COMPUTE)
    start = 1300 - 9
    batch = pa.PagedBatch(tables=table.to(torch.int32)[None], q_start=_ints([0]), q_len=_ints([9]),
                          kv_len=_ints([1300]), q_pos=_ints(range(start, 1300)), max_q_len=9, max_kv_len=1300)
    many = pa.attend(q, cache, batch, 512, 0.125, out=torch.empty_like(q))
    one = pa.attend(q, cache, batch, 1344, 0.125, out=torch.empty_like(q))
    ref = reference(q, k, v, range(start, 1300), 0.125)
    assert relative_error(many, ref) < TOLERANCE and relative_error(one, ref) < TOLERANCE
    assert relative_error(many, one.double().cpu()) < TOLERANCE


def test_decode_row_independent_of_batch_and_grid_bound():
    """Three sequences of different lengths decoded together equal each decoded alone, bit for bit, and equal the
    same batch with a grid sized for a much longer bound (what a CUDA graph of max_model_len launches)."""
    caches = [filled_cache(COMPUTE, n, 2, 64, seed=n) for n in (1200, 90, 700)]
    # One shared cache: each sequence's blocks copied into its own range of a common cache.
    block_size, tables, parts, offset = 16, [], [], 0
    for cache, table, _, _ in caches:
        parts.append(cache)
        tables.append(table + offset)
        offset += cache.shape[0]
    cache = torch.cat(parts)
    lengths = [1200, 90, 700]
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, COMPUTE)
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables]).to(torch.int32)

    def run(rows, bound):
        batch = pa.PagedBatch(tables=padded[rows], q_start=_ints(range(len(rows))), q_len=_ints([1] * len(rows)),
                              kv_len=_ints([lengths[r] for r in rows]), q_pos=_ints([lengths[r] - 1 for r in rows]),
                              max_q_len=1, max_kv_len=bound)
        return pa.attend(q[rows].clone(), cache, batch, 512, 0.125)

    together = run([0, 1, 2], 1200)
    wide = run([0, 1, 2], 8192)
    with pytest.MonkeyPatch.context() as patch:  # a grid too large for one launch goes in parts, same result
        patch.setattr(pa, "MAX_GRID_Z", 3)
        in_parts = run([0, 1, 2], 1200)
    for i in range(3):
        alone = run([i], lengths[i])
        assert torch.equal(together[i], alone[0])
        _, _, k, v = caches[i]
        assert relative_error(alone, reference(q[i : i + 1], k, v, [lengths[i] - 1], 0.125)) < TOLERANCE
    assert torch.equal(together, wide) and torch.equal(together, in_parts)
    assert block_size == cache.shape[2]


def test_decode_partition_is_bounded_and_fixed():
    assert pa.decode_partition(2048) == pa.MIN_PARTITION
    for max_len in (4096, 135168, 262144, 1 << 20):
        partition = pa.decode_partition(max_len)
        assert partition % pa.BLOCK_N == 0 and -(-max_len // partition) <= pa.DECODE_MAX_PARTITIONS


def _ints(values):
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)
