"""The decoder's small per-token steps as one Triton kernel each, used where the paged kernel is (CUDA with Triton):
RMSNorm (was 7 kernels), rotary embedding of q and k together (was 10), and the K/V write with fp8 quantization
(was 2 index writes, plus ~8 conversions for fp8). A decode step of a 64-layer model ran ~2,300 such small kernels,
~3 ms of a 22 ms graph replay on an H200 (run 19), and a prefill tail enqueues each of them from Python.

Each computes what its torch form in kvshare.engine.model / attention / kv_quant computes, in fp32 with one rounding
at the end (the torch forms round after every bf16 operation, so values may differ in the last bit): a replica uses
one form for every request, so a pool hit, a local hit and cache OFF still run the same arithmetic. fp8 writes match
kv_quant.to_cache exactly: x / scale correctly rounded, clamped to +-448, rounded to nearest even e4m3.
"""

from __future__ import annotations

from functools import cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the gathered path's torch forms serve where Triton is missing
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension of x (N, H); a new tensor."""
    out = torch.empty_like(x)
    n, h = x.shape
    _kernels()["rms_norm"][(n,)](x, weight, out, x.stride(0), out.stride(0), h, eps, BLOCK=triton.next_power_of_2(h),
                                 num_warps=8)
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (T, heads, D) and k (T, kv_heads, D) in place by the half-split convention (model._rope); cos, sin:
    (T, 1, D) with equal halves (emb = cat(freqs, freqs)). Rows of q and k may be strided; each head's D contiguous."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    _kernels()["rope"][(t, heads + kv_heads)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), heads,
        HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), num_warps=1)


def write_kv(cache_: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: float, v_scale: float) -> None:
    """k, v (T, kv_heads, D) into their slots of one layer's cache [num_blocks, 2, block_size, kv_heads, D]:
    token i at (blocks[i], offsets[i]); quantized as kv_quant.to_cache if the cache is fp8."""
    t, kv_heads, d = k.shape
    fp8 = cache_.dtype == torch.float8_e4m3fn
    store = cache_.view(torch.uint8) if fp8 else cache_
    _kernels()["write_kv"][(t, kv_heads)](
        store, blocks, offsets, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache_.stride(0), cache_.stride(1), cache_.stride(2), cache_.stride(3), k_scale, v_scale,
        D=d, D_PAD=triton.next_power_of_2(d), FP8=fp8, num_warps=1)


@cache
def _kernels() -> dict:
    if triton is None:
        raise RuntimeError("fused ops need Triton (shipped with torch's CUDA builds)")
    return {"rms_norm": triton.jit(_rms_norm, do_not_specialize=["eps"]), "rope": triton.jit(_rope),
            "write_kv": triton.jit(_write_kv, do_not_specialize=["k_scale", "v_scale"])}


if triton is not None:

    def _rms_norm(X, W, Out, row_stride, out_row_stride, h, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < h
        x = tl.load(X + row * row_stride + i, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / h + eps)
        normed = (x * inv).to(Out.dtype.element_ty).to(tl.float32)  # rounded to the model's dtype, then scaled
        w = tl.load(W + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + row * out_row_stride + i, (w * normed).to(Out.dtype.element_ty), mask=ok)

    def _rope(Q, K, Cos, Sin, q_row, q_head, k_row, k_head, cs_row, heads, HALF: tl.constexpr,
              HALF_PAD: tl.constexpr):
        token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        if head < heads:
            base = Q + token * q_row + head * q_head
        else:
            base = K + token * k_row + (head - heads) * k_head
        i = tl.arange(0, HALF_PAD)
        ok = i < HALF
        x1 = tl.load(base + i, mask=ok).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=ok).to(tl.float32)
        c = tl.load(Cos + token * cs_row + i, mask=ok).to(tl.float32)
        s = tl.load(Sin + token * cs_row + i, mask=ok).to(tl.float32)
        tl.store(base + i, (x1 * c - x2 * s).to(Q.dtype.element_ty), mask=ok)
        tl.store(base + HALF + i, (x2 * c + x1 * s).to(Q.dtype.element_ty), mask=ok)

    def _write_kv(Cache, Blocks, Offsets, K, V, k_row, k_head, v_row, v_head,
                  block_stride, kv_stride, slot_stride, head_stride, k_scale, v_scale,
                  D: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr):
        token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        i = tl.arange(0, D_PAD)
        ok = i < D
        slot = (tl.load(Blocks + token).to(tl.int64) * block_stride + tl.load(Offsets + token) * slot_stride
                + head * head_stride)
        k = tl.load(K + token * k_row + head * k_head + i, mask=ok)
        v = tl.load(V + token * v_row + head * v_head + i, mask=ok)
        if FP8:  # as kv_quant.to_cache: x / scale (correctly rounded), clamped to +-448, to e4m3 (nearest even)
            k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -448.0, 448.0)
            v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -448.0, 448.0)
            k = k.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            v = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(Cache + slot + i, k, mask=ok)
        tl.store(Cache + kv_stride + slot + i, v, mask=ok)
