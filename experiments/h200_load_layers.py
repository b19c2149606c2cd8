"""Pool loads into vLLM's tensor-per-layer KV against one storage, on one GPU (issue 32): does the per-layer index op
loop hold a load back, and does the unit kernel (kvshare.transfer.unit_kernel) take it back to the storage's rate?

Why: inside vLLM 0.26 on the H200 (docs/results/h200-vllm/gpu/session13) replica B loaded 34.4 GB in 0.93 s (37
GB/s; median of 4) where the reference engine, whose layers share one storage, reached ~53 GB/s. vLLM allocates
each layer by itself, so the torch form queues a slice, a skip check and an index_copy_ per layer and chunk.

Arms, each on the same pinned pages (a pool arena's: 2 MiB pages registered for DMA) and the Qwen2.5-32B shape
(64 layers, 16-token blocks, 8 KV heads x 128, bf16, 256-token chunks of 64 MiB), vLLM's NHD layout:
- `layers-torch`: one tensor per layer (as vLLM 0.26), the torch form (TransferOptions(unit_kernel=False));
- `layers-kernel`: one tensor per layer, the unit kernel (the default);
- `storage`: one storage sliced per layer (the reference engine's case), one index op a slot.
Each arm stores --chunks chunks from the first half of its blocks once, then loads them --reps times into a random
permutation of the second half, checksums verified (as the connector loads). Timed: load() called -> its handle
waited (and the device synchronized); of that, the host's queueing (load() returned). Checked: every load verified
its checksums, and the second half's blocks equal the first half's, byte for byte, in every arm.

    python3 experiments/h200_load_layers.py --out $OUT/load-layers          # ~1 min on an H200
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

from kvshare.transfer import KVLayout, LoadJob, StoreJob, TransferOptions, make_transfer  # noqa: E402

PAGE = 2 << 20
CHUNK_TOKENS = 256
FLOOR_GBPS = 55.2  # pinned host -> device on this H200 (docs/results/h200, runs 19-20)
ARMS = {"layers-torch": (False, False), "layers-kernel": (False, True), "storage": (True, False)}


def kv_tensors(layout: KVLayout, one_storage: bool) -> list[torch.Tensor]:
    """Physical [B, N, H, 2D] per layer seen as the kind's logical [B, H, N, 2D] (vLLM's NHD), random bytes."""
    shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, 2 * layout.head_size)
    if one_storage:
        whole = torch.empty((layout.num_layers, *shape), dtype=layout.dtype, device="cuda")
        layers = list(whole.unbind(0))
    else:
        layers = [torch.empty(shape, dtype=layout.dtype, device="cuda") for _ in range(layout.num_layers)]
    for layer in layers:
        layer.view(torch.uint8).random_(0, 256)
    return [layer.transpose(1, 2) for layer in layers]


def run_arm(name: str, layout: KVLayout, pages: torch.Tensor, args) -> dict:
    one_storage, kernel = ARMS[name]
    layers = kv_tensors(layout, one_storage)
    transfer = make_transfer(layout, layers, pages, options=TransferOptions(unit_kernel=kernel))
    transfer.registration.wait_all()
    per_chunk, pages_per_chunk = layout.blocks_per_chunk(CHUNK_TOKENS), layout.pages_needed(CHUNK_TOKENS, PAGE)
    half = args.chunks * per_chunk
    targets = (half + np.random.default_rng(0).permutation(half)).tolist()
    page_ids = [list(range(c * pages_per_chunk, (c + 1) * pages_per_chunk)) for c in range(args.chunks)]
    stored = transfer.store([StoreJob(list(range(c * per_chunk, (c + 1) * per_chunk)), page_ids[c])
                             for c in range(args.chunks)]).checksums()
    jobs = [LoadJob(page_ids[c], targets[c * per_chunk: (c + 1) * per_chunk]) for c in range(args.chunks)]
    transfer.load(jobs[:2], checksums=True).wait()  # warm-up: kernels, index tensors, allocator
    rows, verified = [], True
    for rep in range(args.reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = transfer.load(jobs, checksums=True)
        queued = time.perf_counter() - start
        handle.wait()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        verified &= handle.checksums() == stored
        rows.append({"arm": name, "rep": rep, "load_s": seconds, "queued_s": queued,
                     "gbps": args.chunks * layout.chunk_nbytes(CHUNK_TOKENS, PAGE) / seconds / 1e9})
    index = torch.tensor(targets, device="cuda")
    bytes_ = [layer.view(torch.uint8) for layer in layers]  # bytes: random bf16 holds NaNs, which equal nothing
    exact = all(torch.equal(b[:half], b[index]) for b in bytes_)  # block b's copy landed in targets[b]
    del layers, bytes_, transfer
    torch.cuda.empty_cache()
    return {"rows": rows, "verified": verified, "exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=128, help="256-token chunks a load (64 MiB each; 128 = 32k tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("h200_load_layers.py needs a CUDA device")
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"unknown arm(s) {unknown}: use {', '.join(ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    layout = KVLayout(64, 2 * args.chunks * CHUNK_TOKENS // 16, 16, 8, 128, torch.bfloat16, kind="vllm_lbnhc")
    pages_per_chunk = layout.pages_needed(CHUNK_TOKENS, PAGE)
    pages = torch.from_numpy(np.zeros((args.chunks * pages_per_chunk, PAGE), dtype=np.uint8))  # registered by arms
    results = {arm: run_arm(arm, layout, pages, args) for arm in arms}
    nbytes = args.chunks * layout.chunk_nbytes(CHUNK_TOKENS, PAGE)
    print(f"{args.chunks} chunks of {layout.chunk_nbytes(CHUNK_TOKENS, PAGE) >> 20} MiB ({nbytes / 1e9:.1f} GB) a "
          f"load, checksums verified; median (min-max) of {args.reps}; floor {nbytes / FLOOR_GBPS / 1e9:.3f} s")
    print("| arm | load s | GB/s | host queueing s | verified | bytes exact |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for arm, result in results.items():
        rows = result["rows"]
        load = [r["load_s"] for r in rows]
        print(f"| {arm} | {statistics.median(load):.3f} ({min(load):.3f}-{max(load):.3f}) | "
              f"{statistics.median(r['gbps'] for r in rows):.1f} | "
              f"{statistics.median(r['queued_s'] for r in rows):.3f} | {result['verified']} | {result['exact']} |")
    (args.out / "load_layers.json").write_text(json.dumps(
        {"machine": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
         "args": vars(args) | {"out": args.out.name}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
