"""Where a pool load's host time goes on the GPU (issue 19, run 25): the transfer layer alone, no model. A 128k-token
load of the qwen2.5-32b KV shape (64 layers, 8 KV heads of 128, 16-token blocks, 256-token chunks, 2 MiB pages), bf16
and fp8, in 1, 2 and 4 layer waves, verification on: the host's time until load() returns (its queueing of the
copies), the time until the copies are over, and a cProfile of one queueing (the top functions by own time).

    PYTHONPATH=/tmp/site:. python3 experiments/h200_load_enqueue.py --out $OUT/enqueue.json

Run 22 showed the load host-bound with 4 waves (0.75 s to queue 2,048 slot items against a 0.62 s copy); this says
which calls the ~0.35 ms an item are.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from kvshare.transfer import KVLayout, LoadJob, StoreJob, TransferOptions, make_transfer

TOKENS, CHUNK, BLOCK, PAGE = 131072, 256, 16, 2 << 20


def measure(dtype: torch.dtype, waves_list: list[int], reps: int) -> dict:
    chunks, per_chunk = TOKENS // CHUNK, CHUNK // BLOCK
    blocks = 2 * chunks * per_chunk + 16
    layout = KVLayout(64, blocks, BLOCK, 8, 128, dtype)
    kv = torch.zeros((64, *layout.tensor_shape), dtype=dtype, device="cuda")
    kv.view(torch.uint8).random_(0, 256)
    pages_per_chunk = layout.pages_needed(CHUNK, PAGE)
    arena = torch.zeros(chunks * pages_per_chunk, PAGE, dtype=torch.uint8)  # touched: registration only pins
    transfer = make_transfer(layout, list(kv.unbind(0)), arena, options=TransferOptions())
    pages = [list(range(c * pages_per_chunk, (c + 1) * pages_per_chunk)) for c in range(chunks)]
    sources = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
    targets = [list(range((chunks + c) * per_chunk, (chunks + c + 1) * per_chunk)) for c in range(chunks)]
    stored = transfer.store([StoreJob(s, p) for s, p in zip(sources, pages)]).checksums()
    jobs = [LoadJob(p, t) for p, t in zip(pages, targets)]
    result = {"dtype": str(dtype).removeprefix("torch."), "gib": chunks * layout.chunk_bytes(CHUNK) / 2**30,
              "rows": []}
    transfer.load(jobs, checksums=True).wait()  # warm-up: kernels compiled, allocator primed
    for waves in waves_list:
        for _ in range(reps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            handle = transfer.load(jobs, checksums=True, waves=waves)
            queued = time.perf_counter() - started
            for layer in range(64):
                handle.wait_layer(layer)
            ok = handle.checksums() == stored
            handle.wait()
            torch.cuda.synchronize()
            result["rows"].append(dict(waves=waves, queued_s=queued, done_s=time.perf_counter() - started, ok=ok))
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    handle = transfer.load(jobs, checksums=True, waves=4)
    profile.disable()
    handle.wait()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    result["profile_waves4"] = text.getvalue()
    torch.cuda.synchronize()
    transfer.close()  # unregister the arena before it is freed
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=3)
    ns = parser.parse_args()
    results = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        r = measure(dtype, [1, 2, 4], ns.reps)
        results.append(r)
        for waves in (1, 2, 4):
            rows = [x for x in r["rows"] if x["waves"] == waves]
            q = statistics.median(x["queued_s"] for x in rows)
            d = statistics.median(x["done_s"] for x in rows)
            print(f"{r['dtype']:14s} {r['gib']:5.1f} GiB waves {waves}: queued {q:.3f} s, done {d:.3f} s "
                  f"({r['gib'] * 2**30 / d / 1e9:.1f} GB/s), checksums ok {all(x['ok'] for x in rows)}", flush=True)
        print(r["profile_waves4"][:2500], flush=True)
        del r
        torch.cuda.empty_cache()
    with open(ns.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
