"""What verifying a load costs on a CPU replica: load time of the demo model's KV (the `small` preset in float32: 12
layers, 4 KV heads, head 64, 24 KiB a token) without verification, with the chunk checksum, and with the checksum
before issue 17 (xxh3-64 on host threads, rebuilt here for the comparison only). Same process, same pages, arms
interleaved, medians of 15 loads each.

    python experiments/verify_cost_cpu.py --tokens 1024,8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import xxhash

import kvshare.transfer.checksum as where
from kvshare.transfer import KVLayout, LoadJob, StoreJob, make_transfer
from kvshare.transfer.shm import shm_pages

PAGE = 2 << 20
CHUNK = 256


def xxh3_checksum(pages, page_ids, nbytes):
    digest = xxhash.xxh3_64()
    for k, page in enumerate(page_ids):
        digest.update(memoryview(pages[page, : min(pages.shape[1], nbytes - k * pages.shape[1])]))
    return digest.intdigest()


ARMS = {"off": None, "checksum": where.arena_checksum, "xxh3 (before)": xxh3_checksum}


def measure(tokens: int, rounds: int = 2, loads: int = 15) -> dict[str, list[float]]:
    chunks, per_chunk = tokens // CHUNK, CHUNK // 16
    layout = KVLayout(12, 2 * chunks * per_chunk, 16, 4, 64, torch.float32)
    kv = torch.empty((12, *layout.tensor_shape), dtype=torch.float32)
    kv.view(torch.uint8).random_(0, 256)
    need = layout.pages_needed(CHUNK, PAGE)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with shm_pages(need * chunks, PAGE) as pages:
        transfer = make_transfer(layout, list(kv.unbind(0)), pages)
        page_ids = [list(range(c * need, (c + 1) * need)) for c in range(chunks)]
        transfer.store([StoreJob(list(range(c * per_chunk, (c + 1) * per_chunk)), page_ids[c])
                        for c in range(chunks)]).checksums()
        jobs = [LoadJob(page_ids[c], list(range((chunks + c) * per_chunk, (chunks + c + 1) * per_chunk)))
                for c in range(chunks)]
        for _ in range(rounds):
            for arm, function in ARMS.items():
                where.arena_checksum = function or ARMS["checksum"]
                samples = []
                for _ in range(loads):
                    start = time.perf_counter()
                    handle = transfer.load(jobs, checksums=function is not None)
                    handle.wait()
                    if function is not None:
                        handle.checksums()
                    samples.append(time.perf_counter() - start)
                times[arm].append(statistics.median(samples))
        where.arena_checksum = ARMS["checksum"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,8192")
    args = parser.parse_args()
    print("| tokens | MiB | " + " | ".join(f"{arm} ms (rounds)" for arm in ARMS) + " |")
    print("| --- | --- |" + " --- |" * len(ARMS))
    for tokens in (int(t) for t in args.tokens.split(",")):
        times = measure(tokens)
        mib = tokens * 12 * 4 * 64 * 2 * 4 / 2**20
        cells = " | ".join(f"{statistics.median(v) * 1e3:.1f} ({', '.join(f'{x * 1e3:.1f}' for x in v)})"
                           for v in times.values())
        print(f"| {tokens} | {mib:.0f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
