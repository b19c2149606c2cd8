"""`kvshare pool bench-l2`: L2 write-behind and promotion throughput on loopback Redis, next to the pool's own L1
store/retrieve and plain redis-py SET/GET of the same values, all in one run; then what they imply for fetching a
128k-token prefix of the 32B shape (32 GiB) from another host over 25 and 100 Gb/s links. A benchmark, not a test.

Every rate is the best of `repeats` timed passes. L2 store = RESERVE + copy + COMMIT on pool A until its STATS count
every chunk written to Redis (the write-behind, end to end). L2 promote = one LOOKUP on pool B, whose L1 was just
cleared, that promotes every chunk from Redis (GET, verify, RESERVE, copy, COMMIT) before it answers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from kvshare.keys import chunk_keys, token_bytes
from kvshare.bench.pool import best_rate, machine
from kvshare.pool.client import NewChunk, PoolClient, checksum
from kvshare.pool.l2 import codec
from kvshare.pool.l2.testing import REDIS_MISSING, redis_available, start_redis, start_redis_cluster, url_of
from kvshare.pool.testing import start_pool

MiB, GiB = 1 << 20, 1 << 30
PAGE = 2 * MiB
CHUNK_TOKENS = 256
PREFIX_TOKENS = 128 * 1024
BYTES_PER_TOKEN = 256 * 1024  # qwen2.5-32b shape: 64 layers x 8 kv heads x 128 dim x 2 (K, V) x 2 bytes
LINKS_GBIT = (25, 100)
RECOMPUTE_S = 30.0  # FACTS: ~30 s to prefill 128k tokens of a 27-32B model on one H200
PCIE_GB_S = 55.0  # FACTS: pinned host <-> H200


@dataclass(frozen=True)
class L2BenchConfig:
    chunk_bytes: int = 8 * MiB
    chunks: int = 32
    repeats: int = 3
    cluster: bool = False
    command: str = "kvshare pool bench-l2"


class Backend(msgspec.Struct):
    name: str  # "standalone" | "cluster (3 masters)"
    l2_store_gb_s: float  # write-behind end to end: COMMIT until STATS l2_writes covers every chunk
    l2_promote_gb_s: float  # one LOOKUP promoting every chunk into an empty L1
    l2_promote_and_read_gb_s: float  # the same plus the replica copying the chunks out of the arena
    promote_one_chunk_ms: float  # one LOOKUP promoting a single chunk (the fixed cost plus one chunk)
    miss_lookup_ms: float  # median LOOKUP of one chunk that neither L1 nor L2 has (L2 GET round trip included)
    redis_set_gb_s: float  # plain redis-py pipelined SET of the same values (what Redis alone gives here)
    redis_get_gb_s: float
    raw_get_gb_s: float | None  # GETs over a bare socket, replies counted not parsed: the Redis server's ceiling here


class Prefix(msgspec.Struct):
    link_gbit_s: int
    wire_s: float  # 32 GiB / link rate
    measured_s: float  # 32 GiB / the loopback promote rate: our overhead (it includes loopback transfer)
    serial_s: float  # wire + measured: nothing overlaps (upper bound)
    overlapped_s: float  # max(wire, measured): batches pipelined


class L2BenchResult(msgspec.Struct):
    machine: str
    command: str
    load_average: list[float]
    redis: str
    chunk_bytes: int
    chunks: int
    repeats: int
    l1_store_gb_s: float
    l1_retrieve_gb_s: float
    l1_lookup_miss_ms: float  # the same miss LOOKUP on a pool without L2
    backends: list[Backend]
    prefix_tokens: int
    prefix_bytes: int
    prefix: list[Prefix]  # from the standalone backend's promote rate
    recompute_s: float
    pcie_floor_s: float


class Prompt:
    """A deterministic prompt of `n` chunks: keys, token bytes, NewChunks and data in one namespace."""

    def __init__(self, ns: bytes, n: int, chunk_bytes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, 150_000, n * CHUNK_TOKENS)
        self.ns = ns
        self.keys = chunk_keys(ns, tokens, CHUNK_TOKENS)
        self.tokens = [token_bytes(tokens[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS]) for i in range(n)]
        parents = [ns] + self.keys[:-1]
        self.new = [NewChunk(k, p, t, chunk_bytes) for k, p, t in zip(self.keys, parents, self.tokens)]
        self.data = rng.integers(0, 256, (n, chunk_bytes), dtype=np.uint8)  # [n, chunk_bytes]
        self.sums = [checksum(d) for d in self.data]


def store(client: PoolClient, prompt: Prompt) -> None:
    r = client.reserve(prompt.ns, prompt.new)
    for ref, data in zip(r.chunks, prompt.data):
        client.write(ref, data)
    client.commit(r.lease, prompt.sums)


def retrieve(client: PoolClient, prompt: Prompt, out: np.ndarray | None) -> int:
    found = client.lookup(prompt.ns, prompt.keys, prompt.tokens)
    if out is not None:
        for i, ref in enumerate(found.chunks):
            client.read(ref, out[i])
    if found.lease:
        client.release(found.lease)
    return len(found.chunks)


def wait_writes(client: PoolClient, count: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while client.stats().l2_writes < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench-l2: write-behind did not reach {count} chunks: {client.stats()}")
        time.sleep(0.002)


def median_ms(run, samples: int = 30) -> float:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e3)


def bench_l1(config: L2BenchConfig, size: int) -> tuple[float, float, float]:
    ns = os.urandom(16)
    with start_pool(size, page_size=PAGE, check_integrity=False, max_leased_pages_per_client=0) as (address, _):
        with PoolClient.connect(address, populate=True) as client:
            client.hello(ns, "bench-l2 L1")
            prompts = iter([Prompt(ns, config.chunks, config.chunk_bytes, seed) for seed in range(config.repeats)])
            nbytes = config.chunks * config.chunk_bytes
            store_rate = best_rate(nbytes, config.repeats, lambda: store(client, next(prompts)))
            last = Prompt(ns, config.chunks, config.chunk_bytes, config.repeats - 1)
            out = np.empty_like(last.data)
            retrieve_rate = best_rate(nbytes, config.repeats, lambda: retrieve(client, last, out))
            assert np.array_equal(out, last.data), "bench-l2: L1 retrieve returned other bytes"
            miss = Prompt(ns, 1, config.chunk_bytes, 999)
            return store_rate, retrieve_rate, median_ms(lambda: retrieve(client, miss, None))


def bench_backend(name: str, url: str, config: L2BenchConfig, size: int) -> Backend:
    ns = os.urandom(16)
    nbytes = config.chunks * config.chunk_bytes
    opts = dict(page_size=PAGE, check_integrity=False, max_leased_pages_per_client=0, l2=url,
                l2_promote_timeout=300, l2_queue=max(256, config.chunks), l2_timeout=30)
    with start_pool(size, **opts) as (a, _), start_pool(size, **opts) as (b, _):
        with PoolClient.connect(a, populate=True) as host_a, PoolClient.connect(b, populate=True) as host_b:
            host_a.hello(ns, "bench-l2 A")
            host_b.hello(ns, "bench-l2 B")
            prompts = [Prompt(ns, config.chunks, config.chunk_bytes, 100 + seed) for seed in range(config.repeats)]
            store_rate = _write_behind_rate(host_a, prompts, config)
            last = prompts[-1]
            out = np.empty_like(last.data)

            def promote(read: bool) -> None:
                host_b.clear()
                if retrieve(host_b, last, out if read else None) != config.chunks:
                    raise RuntimeError(f"bench-l2: promotion found fewer than {config.chunks} chunks: {host_b.stats()}")

            promote_rate = best_rate(nbytes, config.repeats, lambda: promote(False))
            promote_read_rate = best_rate(nbytes, config.repeats, lambda: promote(True))
            assert np.array_equal(out, last.data), "bench-l2: promoted bytes differ from the stored ones"
            one = Prompt(ns, 1, config.chunk_bytes, 7)
            store(host_a, one)
            wait_writes(host_a, config.chunks * config.repeats + 1)
            one_ms = min(_timed_ms(lambda: (host_b.clear(), retrieve(host_b, one, None)))
                         for _ in range(config.repeats))
            miss = Prompt(ns, 1, config.chunk_bytes, 999)
            miss_ms = median_ms(lambda: retrieve(host_b, miss, None))
    set_rate, get_rate, raw_rate = _plain_redis(url, config, prompts[-1])
    return Backend(name, store_rate, promote_rate, promote_read_rate, one_ms, miss_ms, set_rate, get_rate, raw_rate)


def _write_behind_rate(client: PoolClient, prompts: list[Prompt], config: L2BenchConfig) -> float:
    best = float("inf")
    for i, prompt in enumerate(prompts):
        started = time.perf_counter()
        store(client, prompt)
        wait_writes(client, config.chunks * (i + 1))
        best = min(best, time.perf_counter() - started)
    return config.chunks * config.chunk_bytes / best / 1e9


def _timed_ms(run) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def _plain_redis(url: str, config: L2BenchConfig, prompt: Prompt) -> tuple[float, float, float | None]:
    """redis-py pipelined SET/GET of the same values under other names: Redis and redis-py alone; and for a
    standalone Redis the raw-socket GET rate (no client parsing at all)."""
    from kvshare.pool.l2.config import L2Config
    from kvshare.pool.l2.store import RedisStore

    store_ = RedisStore(L2Config(url, timeout=30))
    values = [(codec.redis_key(prompt.ns, os.urandom(16)), prompt.data[i].tobytes()) for i in range(len(prompt.data))]
    batch = max(1, (64 * MiB) // config.chunk_bytes)
    batches = [values[i : i + batch] for i in range(0, len(values), batch)]
    nbytes = len(values) * config.chunk_bytes
    try:
        set_rate = best_rate(nbytes, config.repeats, lambda: [store_.set_many(b) for b in batches])
        get_rate = best_rate(nbytes, config.repeats, lambda: [store_.get_many([n for n, _ in b]) for b in batches])
        raw = None
        if not store_.config.cluster:
            host, port = store_.config.nodes[0]
            raw = best_rate(nbytes, config.repeats, lambda: _raw_get(host, port, batches, config.chunk_bytes))
    finally:
        store_.close()
    return set_rate, get_rate, raw


def _raw_get(host: str, port: int, batches, value_bytes: int) -> None:
    """Pipelined GETs on a bare socket; the replies are received into one buffer and only counted."""
    with socket.create_connection((host, port), timeout=30) as sock:
        reply = len(b"$%d\r\n" % value_bytes) + value_bytes + 2
        buffer = memoryview(bytearray(reply * max(len(b) for b in batches)))
        for b in batches:
            sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n.encode()) for n, _ in b))
            want, got = reply * len(b), 0
            while got < want:
                got += sock.recv_into(buffer[got:want])


def prefix_arithmetic(promote_gb_s: float) -> list[Prefix]:
    nbytes = PREFIX_TOKENS * BYTES_PER_TOKEN
    measured = nbytes / (promote_gb_s * 1e9)
    out = []
    for gbit in LINKS_GBIT:
        wire = nbytes * 8 / (gbit * 1e9)
        out.append(Prefix(gbit, wire, measured, wire + measured, max(wire, measured)))
    return out


def run_bench(config: L2BenchConfig, json_path: str = "", md_path: str = "") -> int:
    if not redis_available():
        print(f"kvshare pool bench-l2: {REDIS_MISSING}")
        return 1
    load = list(os.getloadavg())
    size = int(config.chunks * config.chunk_bytes * 1.5) + 64 * MiB
    size -= size % PAGE
    l1_store, l1_retrieve, l1_miss = bench_l1(config, size)
    backends = []
    with start_redis() as server:
        version = server.cli("info", "server").split("redis_version:")[1].split()[0]
        backends.append(bench_backend("standalone", url_of(server), config, size))
    if config.cluster:
        with start_redis_cluster() as servers:
            backends.append(bench_backend("cluster (3 masters)", url_of(servers), config, size))
    result = L2BenchResult(
        machine=machine(), command=config.command, load_average=load, redis=f"redis-server {version}, redis-py",
        chunk_bytes=config.chunk_bytes, chunks=config.chunks, repeats=config.repeats, l1_store_gb_s=l1_store,
        l1_retrieve_gb_s=l1_retrieve, l1_lookup_miss_ms=l1_miss, backends=backends, prefix_tokens=PREFIX_TOKENS,
        prefix_bytes=PREFIX_TOKENS * BYTES_PER_TOKEN, prefix=prefix_arithmetic(backends[0].l2_promote_gb_s),
        recompute_s=RECOMPUTE_S, pcie_floor_s=PREFIX_TOKENS * BYTES_PER_TOKEN / (PCIE_GB_S * 1e9),
    )
    text = markdown(result)
    print(text)
    if json_path:
        with open(json_path, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    if md_path:
        with open(md_path, "w") as f:
            f.write(text)
    return 0


def markdown(r: L2BenchResult) -> str:
    load = "/".join(f"{x:.1f}" for x in r.load_average)
    lines = [
        "# L2 tier benchmark (loopback Redis)", "",
        f"Command: `{r.command}`  ", f"Machine: {r.machine}; load {load} at start  ",
        f"Redis: {r.redis}; {r.chunks} chunks of {r.chunk_bytes / MiB:g} MiB per pass, best of {r.repeats}.", "",
        "| measure | " + " | ".join(b.name for b in r.backends) + " |",
        "| --- |" + " --- |" * len(r.backends),
    ]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(values) + " |")

    row("L1 store (RESERVE + copy + COMMIT), same run", [f"{r.l1_store_gb_s:.2f} GB/s"] * len(r.backends))
    row("L1 retrieve (LOOKUP + copy + RELEASE), same run", [f"{r.l1_retrieve_gb_s:.2f} GB/s"] * len(r.backends))
    row("L2 store: write-behind, COMMIT until written", [f"{b.l2_store_gb_s:.2f} GB/s" for b in r.backends])
    row("L2 promote: LOOKUP into an empty L1", [f"{b.l2_promote_gb_s:.2f} GB/s" for b in r.backends])
    row("L2 promote + replica copies out", [f"{b.l2_promote_and_read_gb_s:.2f} GB/s" for b in r.backends])
    row("plain redis-py SET / GET, same values", [f"{b.redis_set_gb_s:.2f} / {b.redis_get_gb_s:.2f} GB/s"
                                                  for b in r.backends])
    row("raw-socket GET, no parsing (Redis server ceiling)", [
        "n/a" if b.raw_get_gb_s is None else f"{b.raw_get_gb_s:.2f} GB/s" for b in r.backends])
    row(f"LOOKUP promoting one {r.chunk_bytes / MiB:g} MiB chunk", [f"{b.promote_one_chunk_ms:.1f} ms"
                                                                    for b in r.backends])
    row("LOOKUP miss (L1 and L2), median", [f"{b.miss_lookup_ms:.2f} ms (L1 only: {r.l1_lookup_miss_ms:.2f})"
                                            for b in r.backends])
    lines += [
        "", f"## A {r.prefix_tokens // 1024}k-token prefix of the 32B shape ({r.prefix_bytes / GiB:g} GiB) from "
        "another host", "",
        f"measured = {r.prefix_bytes / GiB:g} GiB / the standalone loopback promote rate (Redis, redis-py, "
        "verification, copy into the arena; it includes the loopback transfer, so serial double-counts the wire); "
        "wire = bytes / link rate. For scale: recompute about "
        f"{r.recompute_s:.0f} s (FACTS, H200), local pool -> GPU floor {r.pcie_floor_s:.2f} s (55 GB/s PCIe).", "",
        "| link | wire | measured overhead | serial (wire + measured) | overlapped (max) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in r.prefix:
        lines.append(f"| {p.link_gbit_s} Gb/s | {p.wire_s:.1f} s | {p.measured_s:.1f} s | {p.serial_s:.1f} s | "
                     f"{p.overlapped_s:.1f} s |")
    standalone = r.backends[0]
    lines += [
        "", "Reading: L2 pays for a prefix only if promotion beats recompute: "
        f"{r.prefix_bytes / GiB:g} GiB / {r.recompute_s:.0f} s = {r.prefix_bytes / r.recompute_s / 1e9:.2f} GB/s is "
        "the break-even rate, and a 100 Gb/s link alone would allow 12.5 GB/s. Here promotion runs at "
        f"{standalone.l2_promote_gb_s:.2f} GB/s, close to plain redis-py GET ({standalone.redis_get_gb_s:.2f} GB/s) "
        "under a Redis server that delivers at most "
        + ("n/a" if standalone.raw_get_gb_s is None else f"{standalone.raw_get_gb_s:.2f} GB/s")
        + " to a client that parses nothing: the store and its client, not the network and not kvshare's own "
        "work (verification, arena copies), set the pace. Measure again on the deployment's hosts before relying on "
        "L2 for long prefixes; on this shared machine it serves short prefixes and small models.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_bench(L2BenchConfig(chunks=8, repeats=1))
