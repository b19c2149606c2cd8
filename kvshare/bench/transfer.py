"""`kvshare bench transfer`: store/load GB/s of a Qwen2.5-32B-shaped KV next to the copy ceiling of the same run,
a load without and with verification (a store always computes its checksums), and the host's hash rates beside
xxh3's.

Shape: 64 layers (8 on CPU, to fit a few GiB; the JSON says so), 8 KV heads, head 128, bf16, 16-token blocks,
256-token chunks, random block ids, each chunk's pages adjacent (as a fresh pool hands them out), 2 MiB pages in a
/dev/shm arena registered for DMA. The ceiling is one pinned copy of the same bytes (CUDA: host<->device;
CPU: memcpy). Times: device synchronized before every host clock read; warm-up reported separately.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvshare.transfer.jobs import LoadJob, StoreJob
from kvshare.transfer.layout import KVLayout
from kvshare.transfer.shm import shm_pages
from kvshare.transfer.transfer import make_transfer


@dataclass(frozen=True)
class BenchConfig:
    device: str = "cpu"
    tokens: int = 32768
    reps: int = 5
    layers: int | None = None  # default: 64 on CUDA, 8 on CPU
    chunk_tokens: int = 256
    page_size: int = 2 << 20
    seed: int = 0


def run(config: BenchConfig) -> dict:
    layers = config.layers or (64 if config.device == "cuda" else 8)
    blocks_needed = config.tokens // 16
    layout = KVLayout(layers, 2 * blocks_needed, 16, 8, 128, torch.bfloat16)
    chunks = config.tokens // config.chunk_tokens
    pages_per_chunk = layout.pages_needed(config.chunk_tokens, config.page_size)
    payload = chunks * layout.chunk_bytes(config.chunk_tokens)
    kv = torch.empty((layers, *layout.tensor_shape), dtype=layout.dtype, device=config.device)
    kv.view(torch.uint8).random_(0, 256)
    rng = np.random.default_rng(config.seed)
    with shm_pages(chunks * pages_per_chunk, config.page_size) as pages:
        transfer = make_transfer(layout, list(kv.unbind(0)), pages)
        blocks = rng.permutation(layout.num_blocks)
        bpc = layout.blocks_per_chunk(config.chunk_tokens)
        order = rng.permutation(chunks)
        page_ids = [list(range(c * pages_per_chunk, (c + 1) * pages_per_chunk)) for c in order]
        stores = [StoreJob(blocks[c * bpc : (c + 1) * bpc].tolist(), page_ids[c]) for c in range(chunks)]
        loads = [LoadJob(page_ids[c], blocks[(chunks + c) * bpc : (chunks + c + 1) * bpc].tolist())
                 for c in range(chunks)]
        # A store always computes its chunks' checksums (COMMIT carries them): its time includes them.
        store_s = _time(config, lambda: _waited(transfer.store(stores)).checksums())
        load_s = _time(config, lambda: transfer.load(loads).wait())
        load_sums_s = _time(config, lambda: _waited(transfer.load(loads, checksums=True)).checksums())
        hashes = _hash_rates(pages, min(payload, 1 << 30))
        raw = kv.view(torch.uint8)  # compare bytes: random bf16 bits include NaNs, which never compare equal
        exact = torch.equal(raw[:, blocks[: chunks * bpc]], raw[:, blocks[chunks * bpc : 2 * chunks * bpc]])
        ceiling = _ceiling(config, pages, min(payload, 4 << 30))
    return {
        "machine": _machine(config.device),
        "config": asdict(config),
        "layout": layout.describe(),
        "scaled_down": layers != 64,
        "payload_bytes": payload,
        "store": _rates(payload, store_s),
        "load": _rates(payload, load_s),
        "load_with_checksums": _rates(payload, load_sums_s),
        "host_hash_one_thread_gbps": hashes,
        "ceiling": ceiling,
        "round_trip_exact": bool(exact),
    }


def _waited(handle):
    handle.wait()
    return handle


def _hash_rates(pages: torch.Tensor, nbytes: int) -> dict:
    """GB/s of one host thread: the chunk checksum (numpy) and, for reference, xxh3-64 (the checksum before)."""
    import xxhash

    from kvshare import checksum

    data = pages.view(-1)[:nbytes].numpy()
    rates = {}
    for name, fn in (("kvshare_checksum", checksum.checksum), ("xxh3_64", xxhash.xxh3_64_intdigest)):
        fn(data)
        start = time.perf_counter()
        fn(data)
        rates[name] = nbytes / (time.perf_counter() - start) / 1e9
    return rates


def _time(config: BenchConfig, action) -> dict:
    sync = torch.cuda.synchronize if config.device == "cuda" else (lambda: None)
    times = []
    for _ in range(config.reps + 1):  # the first is warm-up (allocator, first-touch), reported apart
        sync()
        start = time.perf_counter()
        action()
        sync()
        times.append(time.perf_counter() - start)
    return {"warmup_s": times[0], "seconds": times[1:]}


def _rates(nbytes: int, timing: dict) -> dict:
    rates = [nbytes / s / 1e9 for s in timing["seconds"]]
    return {"gbps_median": statistics.median(rates), "gbps_min": min(rates), "gbps_max": max(rates),
            "warmup_s": timing["warmup_s"], "seconds": timing["seconds"]}


def _ceiling(config: BenchConfig, pages: torch.Tensor, nbytes: int) -> dict:
    """Plain copies of `nbytes` between the (registered) arena and a device buffer, or memcpy on CPU."""
    host = pages.view(-1)[:nbytes]
    other = torch.empty(nbytes, dtype=torch.uint8, device=config.device)
    if config.device == "cpu":
        other.random_(0, 256)
    to_host = _time(config, lambda: host.copy_(other, non_blocking=True))
    from_host = _time(config, lambda: other.copy_(host, non_blocking=True))
    return {"to_host": _rates(nbytes, to_host), "from_host": _rates(nbytes, from_host), "bytes": nbytes}


def _machine(device: str) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def print_results(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    store, load, ceiling = results["store"], results["load"], results["ceiling"]
    load_sums = results["load_with_checksums"]
    table = Table(title=f"bench transfer: {results['layout']}, {results['payload_bytes'] / 2**30:.2f} GiB a direction")
    for column in ("direction", "GB/s median", "min..max", "ceiling GB/s", "of ceiling"):
        table.add_column(column, justify="right")
    for name, rate, roof in (("store + checksums", store, ceiling["to_host"]), ("load", load, ceiling["from_host"]),
                             ("load + verification", load_sums, ceiling["from_host"])):
        table.add_row(name, f"{rate['gbps_median']:.1f}", f"{rate['gbps_min']:.1f}..{rate['gbps_max']:.1f}",
                      f"{roof['gbps_median']:.1f}", f"{rate['gbps_median'] / roof['gbps_median']:.0%}")
    console = Console()
    console.print(table)
    if results["scaled_down"]:
        console.print("note: layers scaled down from 64 to fit this machine; GB/s is what compares")
    console.print(f"round trip byte-exact: {results['round_trip_exact']}")
    hashes = results["host_hash_one_thread_gbps"]
    console.print(f"host hash, one thread: kvshare checksum {hashes['kvshare_checksum']:.2f} GB/s, "
                  f"xxh3-64 {hashes['xxh3_64']:.2f} GB/s")
