"""Stores that overlap compute, on one GPU (issue 32): how fast kvshare's transfer stores vLLM-shaped K/V while the
caller's stream runs prefill-like work, with the side streams at normal and at high priority.

Why: under vLLM 0.26 on the H200 (docs/results/h200/NOTES.md, "vLLM 0.26 on the H200, second attempt") replica A
stored at ~1.3 GB/s while its 128k prefill ran, against 53 GB/s for the same transfer on an idle GPU (run 12). vLLM
stores a step's chunks in wait_for_save, so they overlap the next step's forward; the transfer's gathers and hashes
are small kernels on side streams that may wait for SMs behind the forward's kernels.

What it does, per priority (TransferOptions.stream_priority) and per reps:
- the model: vLLM's FlashAttention layout of the Qwen2.5-32B shape (64 layers, 16-token blocks, 8 KV heads x 128,
  bf16; one tensor per layer, as vLLM allocates them), 256-token chunks of 64 MiB, pages of 2 MiB in host memory
  registered for DMA (as a pool arena is);
- "steps": each step queues a forward on the caller's stream (--layers bf16 GEMMs of the 32B MLP, [--tokens x 5120]
  x [5120 x 27648]), then stores --batch chunks (ordered after that forward, I4, as vLLM's are), so step i's stores
  overlap step i+1's forward;
- times: the forwards alone, the stores alone (idle GPU), and both together; the stores' lag (the last store done
  after the last forward), and how much the stores slowed the forwards.
Checks: every stored chunk's device checksum equals the host's hash of the pages it was copied to (byte-exact).

    python3 experiments/h200_store_under_load.py --out $OUT/store-under-load     # ~1-2 min on an H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvshare.transfer import KVLayout, StoreJob, TransferOptions, make_transfer  # noqa: E402

PAGE = 2 << 20
CHUNK_TOKENS = 256


def kv_layers(layout: KVLayout) -> list[torch.Tensor]:
    """One tensor per layer, physical [B, N, H, 2D] seen as the kind's logical [B, H, N, 2D] (vLLM's NHD)."""
    layers = []
    for _ in range(layout.num_layers):
        physical = torch.empty(layout.num_blocks, layout.block_size, layout.num_kv_heads, 2 * layout.head_size,
                               dtype=layout.dtype, device="cuda")
        physical.view(torch.uint8).random_(0, 256)
        layers.append(physical.transpose(1, 2))
    return layers


def forward(weights: tuple[torch.Tensor, torch.Tensor], layers: int) -> None:
    x, w = weights
    for _ in range(layers):
        torch.mm(x, w)


def one_run(transfer, jobs: list[StoreJob], weights, args, with_forward: bool, with_stores: bool) -> dict:
    """Queue the steps; returns the forwards' end and the stores' end, in seconds from the start."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    handles, forward_done = [], torch.cuda.Event(enable_timing=False)
    for step in range(0, len(jobs), args.batch):
        if with_forward:
            forward(weights, args.layers)
        if with_stores:
            handles.append(transfer.store(jobs[step: step + args.batch]))
    forward_done.record()
    forward_done.synchronize()
    forwards_s = time.perf_counter() - start
    for handle in handles:
        handle.wait()
    stores_s = time.perf_counter() - start
    return {"forwards_s": forwards_s, "stores_s": stores_s, "handles": handles}


def measure(priority: str, layout: KVLayout, layers, pages, weights, args) -> dict:
    options = TransferOptions(stream_priority=priority)
    transfer = make_transfer(layout, layers, pages, options=options)
    transfer.registration.wait_all()
    per_chunk = layout.blocks_per_chunk(CHUNK_TOKENS)
    pages_per_chunk = layout.pages_needed(CHUNK_TOKENS, PAGE)
    jobs = [StoreJob(list(range(c * per_chunk, (c + 1) * per_chunk)),
                     list(range(c * pages_per_chunk, (c + 1) * pages_per_chunk))) for c in range(args.chunks)]
    one_run(transfer, jobs, weights, args, True, True)  # warm-up: kernels, index tensors, allocator
    rows = []
    for rep in range(args.reps):
        alone = one_run(transfer, jobs, weights, args, False, True)
        compute = one_run(transfer, jobs, weights, args, True, False)
        both = one_run(transfer, jobs, weights, args, True, True)
        nbytes = args.chunks * layout.chunk_nbytes(CHUNK_TOKENS, PAGE)
        rows.append({"priority": priority, "rep": rep, "stores_alone_s": alone["stores_s"],
                     "stores_alone_gbps": nbytes / alone["stores_s"] / 1e9,
                     "forwards_alone_s": compute["forwards_s"], "forwards_with_stores_s": both["forwards_s"],
                     "all_done_s": both["stores_s"], "store_lag_s": both["stores_s"] - both["forwards_s"],
                     "overlapped_gbps": nbytes / both["stores_s"] / 1e9})
    exact = check(transfer, jobs, layout, both["handles"], args)
    return {"rows": rows, "exact": exact}


def check(transfer, jobs: list[StoreJob], layout: KVLayout, handles, args) -> bool:
    """Device checksums of the last run's first stores equal the host's hash of their pages (what the pool would
    verify on a load); a few chunks, as hashing 64 MiB on the host takes a while."""
    sums = [s for handle in handles for s in handle.checksums()]
    nbytes = layout.chunk_nbytes(CHUNK_TOKENS, PAGE)
    return all(sums[c] == transfer.checksum(list(jobs[c].pages), nbytes) for c in range(min(args.check, len(jobs))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=128, help="256-token chunks stored per run (64 MiB each)")
    p.add_argument("--batch", type=int, default=32, help="chunks stored per step (vLLM: 8192-token steps)")
    p.add_argument("--layers", type=int, default=64, help="GEMMs per step's forward")
    p.add_argument("--tokens", type=int, default=8192, help="rows of each forward GEMM")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check", type=int, default=4, help="chunks whose bytes are checked against the host's hash")
    p.add_argument("--priorities", default="normal,high")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("h200_store_under_load.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    blocks = args.chunks * CHUNK_TOKENS // 16
    layout = KVLayout(64, blocks, 16, 8, 128, torch.bfloat16, kind="vllm_lbnhc")
    layers = kv_layers(layout)
    pages_per_chunk = layout.pages_needed(CHUNK_TOKENS, PAGE)
    pages = torch.from_numpy(np.zeros((args.chunks * pages_per_chunk, PAGE), dtype=np.uint8))  # registered below
    weights = (torch.randn(args.tokens, 5120, dtype=torch.bfloat16, device="cuda"),
               torch.randn(5120, 27648, dtype=torch.bfloat16, device="cuda"))
    results = {p: measure(p, layout, layers, pages, weights, args) for p in args.priorities.split(",")}
    report(results, layout, args)


def report(results: dict, layout: KVLayout, args) -> None:
    print(f"{args.chunks} chunks of {layout.chunk_nbytes(CHUNK_TOKENS, PAGE) >> 20} MiB, {args.batch} a step; "
          f"forward = {args.layers} GEMMs [{args.tokens}x5120]x[5120x27648]; median of {args.reps}")
    print("| priority | stores alone GB/s | forwards alone s | forwards with stores s | store lag s | "
          "overlapped GB/s | bytes exact |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for priority, result in results.items():
        rows = result["rows"]
        m = {k: statistics.median([r[k] for r in rows]) for k in rows[0] if k.endswith(("_s", "gbps"))}
        print(f"| {priority} | {m['stores_alone_gbps']:.1f} | {m['forwards_alone_s']:.3f} | "
              f"{m['forwards_with_stores_s']:.3f} | {m['store_lag_s']:.3f} | {m['overlapped_gbps']:.1f} | "
              f"{result['exact']} |")
    machine = torch.cuda.get_device_name(0)
    (args.out / "store_under_load.json").write_text(json.dumps(
        {"machine": machine, "torch": torch.__version__, "command": " ".join(sys.argv), "args": vars(args) | {
            "out": str(args.out.name)}, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
