"""Issue 19, items 2 and 3: can attention read the engine's paged cache in place instead of gathering the context?
torch's `aten::_flash_attention_forward` (FlashAttention 2's varlen path) takes a `block_table`. This probe, on one
H200, for the qwen2.5-32b attention shape (40 query heads, 8 KV heads, head 128, bf16):

1. which page block sizes the op accepts (16 = the engine's block, 64, 256), with K and V as the strided [:, 0] and
   [:, 1] views of the engine's packed blocks [num_blocks, 2, block_size, kv_heads, D] and as contiguous copies;
2. that where it runs, its output equals the engine's gather + SDPA (kvshare.engine.attention.prefill_attention)
   within bf16 rounding (the same math; different kernels, so not bit for bit);
3. the time of one layer's attention both ways, 64 layers' worth, for a decode step at 32k context and a 192-token
   tail at 32k and 128k.

    PYTHONPATH=. python3 experiments/h200_paged_probe.py --out $OUT/paged.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvshare.engine.attention import prefill_attention

HEADS, KV_HEADS, D = 40, 8, 128


def paged(q, k, v, table, start):
    """Attention of q's rows (positions [start, start + T)) over [0, start + T) through the block table; k, v:
    [num_blocks, block_size, kv_heads, D]."""
    t = q.shape[0]
    cu_q = torch.tensor([0, t], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, start + t], dtype=torch.int32, device=q.device)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, t, start + t, 0.0, True, False, scale=D ** -0.5,
        block_table=table[None].to(torch.int32), seqused_k=torch.tensor([start + t], dtype=torch.int32,
                                                                         device=q.device))
    return out[0]


def timed(fn, repeats=5) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def probe_case(block_size: int, context: int, tail: int) -> dict:
    total = context + tail
    blocks = -(-total // block_size)
    cache = torch.randn(blocks + 7, 2, block_size, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(blocks + 7, device="cuda")[:blocks]  # blocks anywhere, in any order
    q = torch.randn(tail, HEADS, D, device="cuda", dtype=torch.bfloat16)
    reference = q.clone()
    prefill_attention(reference, cache, table, context, D ** -0.5)
    row = {"block_size": block_size, "context": context, "tail": tail,
           "gather_sdpa_ms_64_layers": 64e3 * timed(lambda: prefill_attention(q.clone(), cache, table, context,
                                                                                D ** -0.5))}
    for name in ("strided", "contiguous"):  # the packed cache's views, or copies (timed without the copy)
        k, v = cache[:, 0], cache[:, 1]
        if name == "contiguous":
            k, v = k.contiguous(), v.contiguous()
        try:
            out = paged(q, k, v, table, context)
            row[f"{name}_max_abs_diff"] = float((out.float() - reference.float()).abs().max())
            row[f"{name}_ms_64_layers"] = 64e3 * timed(lambda k=k, v=v: paged(q, k, v, table, context))
        except Exception as error:  # noqa: BLE001 - the probe records what the op refuses
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": []}
    for block_size in (16, 64, 256):
        for context, tail in ((32768, 1), (32768, 192), (131072, 192)):
            row = probe_case(block_size, context, tail)
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
