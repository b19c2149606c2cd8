"""`kvshare bench pool`: store/retrieve 1 MiB chunks through the pool vs plain memcpy vs Redis, LOOKUP latency of a
1,024-chunk key list, and pool start-up seconds per GiB, with the issue's targets as ratios. A benchmark, not a test.

Every rate is the best of `repeats` timed passes over the same bytes, measured side by side in one run.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import psutil

from kvshare.keys import chunk_keys, synthetic_keys, token_bytes, tool_namespace
from kvshare.pool.client import NewChunk, PoolClient, checksum
from kvshare.pool.testing import start_pool
from kvshare.units import parse_size

MiB = 1 << 20
CHUNK = MiB
BATCH = 64  # Redis pipeline depth
LOOKUP_CHUNKS, CHUNK_TOKENS = 1024, 256  # a 256k-token prompt
TARGETS = {"store_vs_memcpy": 0.7, "retrieve_vs_memcpy": 0.7, "store_vs_redis": 10.0, "retrieve_vs_redis": 10.0,
           "lookup_p99_ms": 2.0}


@dataclass(frozen=True)
class BenchConfig:
    chunks: int = 1024
    repeats: int = 5
    startup_size: str = "4GiB"
    redis: bool = True
    command: str = "kvshare bench pool"
    redis_chunks: int = 256  # redis-py GET runs at ~0.2 GB/s here: bound its share of the run


class BenchResult(msgspec.Struct):
    machine: str
    command: str
    chunk_bytes: int
    chunks: int
    page_size: int
    memcpy_gb_s: float  # the faster of the two below: what the ratios divide by
    memcpy_private_gb_s: float  # into private anonymous memory (numpy array)
    memcpy_shm_gb_s: float  # into a prepared /dev/shm mapping, like the arena
    pool_store_gb_s: float
    pool_store_checksum_gb_s: float  # the same, plus the writer's xxh3-64 of each chunk
    pool_retrieve_gb_s: float
    redis: str  # "redis-server X (N chunks)" or "redis: not available"
    redis_set_gb_s: float | None
    redis_get_gb_s: float | None
    lookup_keys: int
    lookup_p50_ms: float
    lookup_p99_ms: float
    lookup_server_p50_ms: float
    lookup_server_p99_ms: float
    load_average: list[float]  # 1/5/15-minute load when the run started: this machine is shared
    startup_gib: float
    startup_first_answer_s: float
    startup_ready_s: float
    startup_s_per_gib: float  # ready time / GiB, process start included
    prepare_s_per_gib: float  # (ready - first answer) / GiB: the arena preparation alone
    ratios: dict[str, float | None]
    targets: dict[str, float]
    met: dict[str, bool | None]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "unknown cpu")
    return (f"{model}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def best_rate(nbytes: int, repeats: int, run) -> float:
    """GB/s of the fastest of `repeats` calls of run() (each moving nbytes)."""
    best = min(_timed(run) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _copy_rate(src: np.ndarray, dst: np.ndarray, repeats: int) -> float:
    """GB/s of copying `src` into `dst` chunk by chunk (the views die with this call, so a mapping can close)."""
    return best_rate(src.nbytes, repeats, lambda: [np.copyto(dst[i], src[i]) for i in range(len(src))])


def bench_memcpy(src: np.ndarray, repeats: int) -> tuple[float, float]:
    """GB/s of chunk-by-chunk copies of `src` into (private anonymous memory, a prepared /dev/shm mapping). The pool
    copies into the second kind of memory; on some machines the two differ by 2x, so both are reported and the
    pool is compared with the faster."""
    private = _copy_rate(src, np.ones_like(src), repeats)  # touched, like the pool's prepared, populated pages
    path = f"/dev/shm/kvshare-bench-{os.getpid()}.memcpy"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, src.nbytes)
        with mmap.mmap(fd, src.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as mapping:
            shared = _copy_rate(src, np.frombuffer(mapping, dtype=np.uint8).reshape(src.shape), repeats)
    finally:
        os.close(fd)
        os.unlink(path)
    return private, shared


def bench_pool(client: PoolClient, src: np.ndarray, repeats: int) -> tuple[float, float, float]:
    """(store, store with checksum, retrieve) GB/s: RESERVE + copy + COMMIT; LOOKUP + copy out + RELEASE."""
    ns = tool_namespace("bench/pool")
    client.hello(ns, "pool bench")
    out = np.empty_like(src)
    state = {"keys": []}

    def store(with_checksum: bool) -> None:
        client.clear()
        tag = os.urandom(8)  # fresh keys: nothing is skipped as already present
        keys = synthetic_keys(tag, len(src))
        parents = [ns] + keys[:-1]
        r = client.reserve(ns, [NewChunk(k, p, b"", CHUNK) for k, p in zip(keys, parents)])
        sums = []
        for i, ref in enumerate(r.chunks):
            client.write(ref, src[i])
            sums.append(checksum(src[i]) if with_checksum else 0)
        client.commit(r.lease, sums)
        state["keys"] = keys

    def retrieve() -> None:
        keys = state["keys"]
        found = client.lookup(ns, keys, [b""] * len(keys))  # one LOOKUP of the whole prompt, as a connector does
        for i, ref in enumerate(found.chunks):
            client.read(ref, out[i])
        client.release(found.lease)

    store_rate = best_rate(src.nbytes, repeats, lambda: store(False))
    checksum_rate = best_rate(src.nbytes, repeats, lambda: store(True))
    # retrieve() reads the chunks the last store() left.
    retrieve_rate = best_rate(src.nbytes, repeats, retrieve)
    if not np.array_equal(out, src):
        raise AssertionError("pool bench: retrieved bytes differ from the stored ones")
    client.clear()
    return store_rate, checksum_rate, retrieve_rate


def bench_lookup(client: PoolClient, samples: int = 500) -> tuple[float, float, float, float]:
    """p50/p99 ms of one LOOKUP of a 1,024-chunk key list (all hits, with token verification), as the client sees it
    (round trip) and as the server spends it (handler time, from STATS: no socket, no client-side decoding)."""
    ns = tool_namespace("bench/lookup")
    client.hello(ns, "lookup bench")
    tokens = np.random.default_rng(0).integers(0, 150_000, LOOKUP_CHUNKS * CHUNK_TOKENS)
    keys = chunk_keys(ns, tokens, CHUNK_TOKENS)
    token_lists = [token_bytes(tokens[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS]) for i in range(LOOKUP_CHUNKS)]
    parents = [ns] + keys[:-1]
    r = client.reserve(ns, [NewChunk(k, p, t, 4096) for k, p, t in zip(keys, parents, token_lists)])
    client.commit(r.lease, [0] * len(keys))
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        found = client.lookup(ns, keys, token_lists)
        times.append(time.perf_counter() - started)
        if len(found.chunks) != LOOKUP_CHUNKS:
            raise AssertionError(f"lookup bench: {len(found.chunks)} of {LOOKUP_CHUNKS} chunks found")
        client.release(found.lease)
    client.clear()
    server = client.stats().requests["lookup"]  # this pool served no other LOOKUP
    ms = np.asarray(times) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), server.p50_ms, server.p99_ms


@contextlib.contextmanager
def local_redis():
    """A throw-away redis-server on a free loopback port, or None if the binary is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        banner = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
        version = banner.split()[2].removeprefix("v=")
        yield client, version
    finally:
        process.terminate()
        process.wait(10)


def bench_redis(client, src: np.ndarray, repeats: int) -> tuple[float, float]:
    values = [src[i].tobytes() for i in range(len(src))]  # redis-py needs bytes; converted outside the timing

    def set_all() -> None:
        pipe = client.pipeline(transaction=False)
        for start in range(0, len(values), BATCH):
            for i in range(start, min(start + BATCH, len(values))):
                pipe.set(f"c{i}", values[i])
            pipe.execute()

    def get_all() -> None:
        pipe = client.pipeline(transaction=False)
        for start in range(0, len(values), BATCH):
            for i in range(start, min(start + BATCH, len(values))):
                pipe.get(f"c{i}")
            got = pipe.execute()
            if got[0] != values[start]:
                raise AssertionError("redis bench: GET returned other bytes")

    set_rate = best_rate(src.nbytes, repeats, set_all)
    get_rate = best_rate(src.nbytes, repeats, get_all)
    client.flushall()
    return set_rate, get_rate


def bench_startup(size: int) -> tuple[float, float]:
    """Seconds from launching `kvshare pool serve` to its first answer, and to every page being prepared."""
    started = time.perf_counter()
    with start_pool(size, wait_ready=False, check_integrity=False) as (address, _):
        first = time.perf_counter() - started
        with PoolClient.connect(address, map_arena=False) as client:
            while not client.stats().ready:
                time.sleep(0.01)
        return first, time.perf_counter() - started


def run_bench(config: BenchConfig, json_path: str = "") -> int:
    """Run every part, print a table, optionally write JSON; 0 even if a target is missed (it is a benchmark)."""
    load = list(os.getloadavg())
    src = np.random.default_rng(1).integers(0, 256, (config.chunks, CHUNK), dtype=np.uint8)  # [chunks, 1 MiB]
    memcpy_private, memcpy_shm = bench_memcpy(src, config.repeats)
    memcpy = max(memcpy_private, memcpy_shm)
    size = (config.chunks + LOOKUP_CHUNKS + 64) * CHUNK
    with start_pool(size, page_size=CHUNK, check_integrity=False) as (address, _):
        with PoolClient.connect(address, populate=True) as client:
            store, store_sum, retrieve = bench_pool(client, src, config.repeats)
            lookup_p50, lookup_p99, server_p50, server_p99 = bench_lookup(client)
    redis_name, redis_set, redis_get = "redis: not available", None, None
    if config.redis:
        with local_redis() as found:
            if found is not None:
                redis_client, version = found
                n = min(config.chunks, config.redis_chunks)
                redis_set, redis_get = bench_redis(redis_client, src[:n], config.repeats)
                redis_name = f"redis-server {version} via redis-py, pipelined {BATCH} deep ({n} chunks)"
    else:
        redis_name = "redis: skipped (--no-redis)"
    startup_size = parse_size(config.startup_size)
    first, ready = bench_startup(startup_size)
    ratios = {
        "store_vs_memcpy": store / memcpy, "retrieve_vs_memcpy": retrieve / memcpy,
        "store_vs_redis": store / redis_set if redis_set else None,
        "retrieve_vs_redis": retrieve / redis_get if redis_get else None, "lookup_p99_ms": lookup_p99,
    }
    met = {k: (None if v is None else (v <= TARGETS[k] if k == "lookup_p99_ms" else v >= TARGETS[k]))
           for k, v in ratios.items()}
    result = BenchResult(
        machine=machine(), command=config.command, chunk_bytes=CHUNK, chunks=config.chunks, page_size=CHUNK,
        memcpy_gb_s=memcpy, memcpy_private_gb_s=memcpy_private, memcpy_shm_gb_s=memcpy_shm,
        pool_store_gb_s=store, pool_store_checksum_gb_s=store_sum, pool_retrieve_gb_s=retrieve,
        redis=redis_name, redis_set_gb_s=redis_set, redis_get_gb_s=redis_get, lookup_keys=LOOKUP_CHUNKS,
        lookup_p50_ms=lookup_p50, lookup_p99_ms=lookup_p99, lookup_server_p50_ms=server_p50,
        lookup_server_p99_ms=server_p99, load_average=load, startup_gib=startup_size / 2**30,
        startup_first_answer_s=first, startup_ready_s=ready, startup_s_per_gib=ready / (startup_size / 2**30),
        prepare_s_per_gib=(ready - first) / (startup_size / 2**30),
        ratios=ratios, targets=TARGETS, met=met,
    )
    print_result(result)
    if json_path:
        with open(json_path, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    return 0


def print_result(r: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    def gb(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} GB/s"

    load = "/".join(f"{x:.1f}" for x in r.load_average)
    table = Table(title=f"kvshare pool bench: {r.chunks} x 1 MiB chunks", caption=f"{r.machine}; load {load}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in [
        ("memcpy into private memory", gb(r.memcpy_private_gb_s)),
        ("memcpy into a /dev/shm mapping", gb(r.memcpy_shm_gb_s)),
        ("pool store (RESERVE + copy + COMMIT)", gb(r.pool_store_gb_s)),
        ("pool store + xxh3-64 checksum", gb(r.pool_store_checksum_gb_s)),
        ("pool retrieve (LOOKUP + copy + RELEASE)", gb(r.pool_retrieve_gb_s)),
        (f"Redis SET ({r.redis})", gb(r.redis_set_gb_s)), ("Redis GET", gb(r.redis_get_gb_s)),
        (f"LOOKUP of {r.lookup_keys} keys p50 / p99", f"{r.lookup_p50_ms:.3f} / {r.lookup_p99_ms:.3f} ms"),
        ("  of which in the server p50 / p99", f"{r.lookup_server_p50_ms:.3f} / {r.lookup_server_p99_ms:.3f} ms"),
        (f"start-up, {r.startup_gib:g} GiB: first answer / ready", f"{r.startup_first_answer_s:.2f} / "
         f"{r.startup_ready_s:.2f} s ({r.startup_s_per_gib:.3f} s/GiB; preparation {r.prepare_s_per_gib:.3f} s/GiB)"),
    ]:
        table.add_row(name, value)
    table.add_row("ratios below divide by", f"memcpy {gb(r.memcpy_gb_s)} (the faster)")
    for name, ratio in r.ratios.items():
        target = ("<= " if name == "lookup_p99_ms" else ">= ") + f"{r.targets[name]:g}"
        verdict = {True: "met", False: "MISSED", None: "n/a"}[r.met[name]]
        table.add_row(f"{name} (target {target})", "n/a" if ratio is None else f"{ratio:.2f}  {verdict}")
    Console().print(table)
