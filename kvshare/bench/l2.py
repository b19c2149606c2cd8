"""`kvshare bench l2`: the L2 tier on loopback Redis (standalone, and with --cluster a cluster of several masters):
write-behind and promotion throughput next to the pool's own L1 figures, the original ("redis-py") and the striped
promotion paths side by side in one run, and what the Redis client alone gets; then what the rates mean for a
128k-token prefix of the 32B shape (32 GiB) from another host. A benchmark, not a test.

Method. L2 store = RESERVE + copy + COMMIT on pool A until its STATS count every chunk written to Redis (the
write-behind, end to end). Promotion = one LOOKUP on a pool B whose L1 was just cleared, promoting every chunk (GET,
verify, RESERVE, copy, COMMIT) before it answers. One B pool per path, on the same Redis holding the same values;
each B first promotes a one-chunk prompt (connections open, the striped path learns the chunk size), then the paths
take turns pass by pass (old-new, then new-old: drift on a shared machine hits both), `repeats` passes each. Rates:
the best pass and the median. CPU: seconds of the promoting pool process and of the Redis server(s) per GB promoted
(from /proc, median over the passes): work per byte, which a busy machine's wall time hides.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from kvshare.bench.pool import best_rate, machine
from kvshare.keys import chunk_keys, token_bytes
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
RECOMPUTE_S = 35.5  # docs/results/h200x2: 128k tokens of the 32B shape prefilled on one H200 (OFF median)
PCIE_GB_S = 55.0  # FACTS: pinned host <-> H200
PATHS = ("redis-py", "striped")
TIMEOUT_S = 300.0  # a slow pass on a busy machine must not fail the run


@dataclass(frozen=True)
class L2BenchConfig:
    chunk_bytes: int = 8 * MiB
    chunks: int = 32
    repeats: int = 3
    cluster: bool = False
    masters: int = 3
    connections: int = 4  # the striped path's --l2-connections
    command: str = "kvshare bench l2"


class PathResult(msgspec.Struct):
    path: str  # "redis-py" (the original) or "striped"
    promote_gb_s: float  # best pass: one LOOKUP promoting every chunk into an empty L1
    promote_median_gb_s: float
    promote_and_read_gb_s: float  # best pass of the same plus the replica copying the chunks out of the arena
    promote_one_chunk_ms: float  # one LOOKUP promoting a single chunk (the fixed cost plus one chunk), best
    pool_cpu_s_per_gb: float  # CPU seconds of the promoting pool process per GB promoted (median over passes)
    redis_cpu_s_per_gb: float  # CPU seconds of the Redis server(s) per GB promoted (median over passes)


class Backend(msgspec.Struct):
    name: str  # "standalone" | "cluster (N masters)"
    l2_store_gb_s: float  # write-behind end to end: COMMIT until STATS l2_writes covers every chunk
    miss_lookup_ms: float  # median LOOKUP of one chunk that neither L1 nor L2 has (the striped path)
    paths: list[PathResult]
    redis_set_gb_s: float  # plain redis-py pipelined SET of the same values
    redis_get_gb_s: float  # plain redis-py pipelined GET (one connection, what the original path reads through)
    raw_get_gb_s: float | None  # GETs on one bare socket into one reused buffer, nothing parsed (standalone only)
    write_drops_filled: int = 0  # chunks of the promoted prompts whose write-behind was dropped, SET by the bench


class Prefix(msgspec.Struct):
    path: str
    link_gbit_s: int
    wire_s: float  # 32 GiB / link rate
    measured_s: float  # 32 GiB / the loopback promote rate (it includes the loopback transfer)
    overlapped_s: float  # max(wire, measured): batches pipelined


class L2BenchResult(msgspec.Struct):
    machine: str
    command: str
    load_average: list[float]
    redis: str
    chunk_bytes: int
    chunks: int
    repeats: int
    connections: int
    l1_store_gb_s: float
    l1_retrieve_gb_s: float
    l1_lookup_miss_ms: float  # the same miss LOOKUP on a pool without L2
    backends: list[Backend]
    prefix_tokens: int
    prefix_bytes: int
    prefix: list[Prefix]  # from the standalone backend's promote rates
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


def wait_writes(client: PoolClient, count: int, timeout: float = TIMEOUT_S) -> None:
    """Until `count` write-behinds are over, written or dropped (a busy machine can time one out)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats.l2_writes + stats.l2_write_drops >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench l2: write-behind did not reach {count} chunks: {stats}")
        time.sleep(0.002)


def median_ms(run, samples: int = 30) -> float:
    return float(np.median([_timed(run) for _ in range(samples)]) * 1e3)


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_l1(config: L2BenchConfig, size: int) -> tuple[float, float, float]:
    ns = os.urandom(16)
    with start_pool(size, page_size=PAGE, check_integrity=False, max_leased_pages_per_client=0) as (address, _):
        with PoolClient.connect(address, populate=True, timeout=TIMEOUT_S) as client:
            client.hello(ns, "bench l2: L1")
            prompts = iter([Prompt(ns, config.chunks, config.chunk_bytes, seed) for seed in range(config.repeats)])
            nbytes = config.chunks * config.chunk_bytes
            store_rate = best_rate(nbytes, config.repeats, lambda: store(client, next(prompts)))
            last = Prompt(ns, config.chunks, config.chunk_bytes, config.repeats - 1)
            out = np.empty_like(last.data)
            retrieve_rate = best_rate(nbytes, config.repeats, lambda: retrieve(client, last, out))
            if not np.array_equal(out, last.data):
                raise RuntimeError("bench l2: L1 retrieve returned other bytes")
            miss = Prompt(ns, 1, config.chunk_bytes, 999)
            return store_rate, retrieve_rate, median_ms(lambda: retrieve(client, miss, None))


class _Promoting:
    """One B pool (one promotion path) and what its passes measured."""

    def __init__(self, path: str, client: PoolClient, pid: int) -> None:
        self.path, self.client, self.pid = path, client, pid
        self.seconds: list[float] = []
        self.read_seconds: list[float] = []
        self.pool_cpu: list[float] = []
        self.redis_cpu: list[float] = []

    def promote(self, prompt: Prompt, out: np.ndarray | None, redis_pids: list[int]) -> None:
        self.client.clear()
        pool0, redis0 = cpu_seconds(self.pid), sum(map(cpu_seconds, redis_pids))
        started = time.perf_counter()
        found = retrieve(self.client, prompt, out)
        elapsed = time.perf_counter() - started
        if found != len(prompt.keys):
            raise RuntimeError(f"bench l2: the {self.path} path promoted {found} of {len(prompt.keys)} chunks: "
                               f"{self.client.stats()}")
        (self.read_seconds if out is not None else self.seconds).append(elapsed)
        if out is None:
            self.pool_cpu.append(cpu_seconds(self.pid) - pool0)
            self.redis_cpu.append(sum(map(cpu_seconds, redis_pids)) - redis0)


def bench_backend(name: str, servers, config: L2BenchConfig, size: int) -> Backend:
    url = url_of(servers)
    redis_pids = [s.process.pid for s in (servers if isinstance(servers, list) else [servers])]
    ns = os.urandom(16)
    gb = config.chunks * config.chunk_bytes / 1e9
    common = dict(page_size=PAGE, check_integrity=False, max_leased_pages_per_client=0, l2=url,
                  l2_promote_timeout=TIMEOUT_S, l2_queue=max(256, config.chunks), l2_timeout=30)
    with contextlib.ExitStack() as stack:
        host_a = _pool(stack, size, ns, "A", common)[0]
        prompts = [Prompt(ns, config.chunks, config.chunk_bytes, 100 + seed) for seed in range(config.repeats)]
        store_rate = _write_behind_rate(host_a, prompts, config)
        _forget(url, [p.ns for p in prompts[:-1]], [p.keys for p in prompts[:-1]])  # only the last one is promoted
        warm, one, last = Prompt(ns, 1, config.chunk_bytes, 7), Prompt(ns, 1, config.chunk_bytes, 8), prompts[-1]
        store(host_a, warm)
        store(host_a, one)
        wait_writes(host_a, config.chunks * config.repeats + 2)
        dropped = _fill_gaps(url, [warm, one, last])  # what a dropped write-behind left out, SET directly
        paths = []
        for path in PATHS:
            extra = dict(l2_fetch=path, l2_connections=config.connections)
            client, pid = _pool(stack, size, ns, f"B {path}", {**common, **extra})
            retrieve(client, warm, None)  # connections open; the striped path learns the chunk size
            paths.append(_Promoting(path, client, pid))
        out = np.empty_like(last.data)
        for r in range(config.repeats):
            for p in paths if r % 2 == 0 else paths[::-1]:
                p.promote(last, None, redis_pids)
                p.promote(last, out, redis_pids)
                if not np.array_equal(out, last.data):
                    raise RuntimeError(f"bench l2: the {p.path} path promoted other bytes than were stored")
        results = []
        for p in paths:
            one_ms = min(_timed(lambda p=p: (p.client.clear(), retrieve(p.client, one, None)))
                         for _ in range(config.repeats)) * 1e3
            results.append(PathResult(
                p.path, gb / min(p.seconds), gb / statistics.median(p.seconds), gb / min(p.read_seconds), one_ms,
                statistics.median(p.pool_cpu) / gb, statistics.median(p.redis_cpu) / gb))
        miss = Prompt(ns, 1, config.chunk_bytes, 999)
        miss_ms = median_ms(lambda: retrieve(paths[-1].client, miss, None))
    set_rate, get_rate, raw_rate = _plain_redis(url, config, last)
    return Backend(name, store_rate, miss_ms, results, set_rate, get_rate, raw_rate, dropped)


def _pool(stack: contextlib.ExitStack, size: int, ns: bytes, name: str, opts: dict) -> tuple[PoolClient, int]:
    address, process = stack.enter_context(start_pool(size, **opts))
    client = stack.enter_context(PoolClient.connect(address, populate=True, timeout=TIMEOUT_S))
    client.hello(ns, f"bench l2: {name}")
    return client, process.pid


def _write_behind_rate(client: PoolClient, prompts: list[Prompt], config: L2BenchConfig) -> float:
    best = float("inf")
    for i, prompt in enumerate(prompts):
        started = time.perf_counter()
        store(client, prompt)
        wait_writes(client, config.chunks * (i + 1))
        best = min(best, time.perf_counter() - started)
    return config.chunks * config.chunk_bytes / best / 1e9


def _fill_gaps(url: str, prompts: list[Prompt]) -> int:
    """SET the L2 value of every chunk of `prompts` that L2 lacks (a write-behind dropped on a busy machine), encoded
    as the write-behind encodes it; returns how many."""
    from kvshare.pool.l2.config import L2Config
    from kvshare.pool.l2.store import RedisStore

    store_ = RedisStore(L2Config(url, timeout=30))
    try:
        missing = []
        for p in prompts:
            names = [codec.redis_key(p.ns, key) for key in p.keys]
            found = store_.get_many(names)
            for i, value in enumerate(found):
                if value is None:
                    header = codec.Header(codec.VERSION, p.ns, p.keys[i], p.new[i].parent, p.tokens[i],
                                          len(p.data[i]), p.sums[i])
                    missing.append((names[i], codec.encode(header, p.data[i])))
        if missing:
            store_.set_many(missing)
        return len(missing)
    finally:
        store_.close()


def _forget(url: str, namespaces: list[bytes], keys: list[list[bytes]]) -> None:
    """Delete chunks from L2 (the write-behind rate's extra prompts: the machine's memory is better left free)."""
    from kvshare.pool.l2.config import L2Config
    from kvshare.pool.l2.store import RedisStore

    store_ = RedisStore(L2Config(url, timeout=30))
    try:
        store_.delete_many([codec.redis_key(ns, key) for ns, ks in zip(namespaces, keys) for key in ks])
    finally:
        store_.close()


def _plain_redis(url: str, config: L2BenchConfig, prompt: Prompt) -> tuple[float, float, float | None]:
    """redis-py pipelined SET/GET of the same values under other names (Redis and redis-py alone; deleted after);
    for a standalone Redis also the bare-socket GET rate."""
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
            buffer = memoryview(bytearray(len(b"$%d\r\n" % config.chunk_bytes) + config.chunk_bytes + 2) * batch)
            raw = best_rate(nbytes, config.repeats, lambda: _raw_get(host, port, batches, config.chunk_bytes, buffer))
    finally:
        with contextlib.suppress(Exception):
            store_.delete_many([name for name, _ in values])
        store_.close()
    return set_rate, get_rate, raw


def _raw_get(host: str, port: int, batches, value_bytes: int, buffer: memoryview) -> None:
    """Pipelined GETs on one bare socket; the replies are received into one reused buffer and only counted."""
    with socket.create_connection((host, port), timeout=30) as sock:
        reply = len(b"$%d\r\n" % value_bytes) + value_bytes + 2
        for b in batches:
            sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n.encode()) for n, _ in b))
            want, got = reply * len(b), 0
            while got < want:
                got += sock.recv_into(buffer[got:want])


def prefix_arithmetic(paths: list[PathResult]) -> list[Prefix]:
    nbytes = PREFIX_TOKENS * BYTES_PER_TOKEN
    out = []
    for p in paths:
        measured = nbytes / (p.promote_gb_s * 1e9)
        for gbit in LINKS_GBIT:
            wire = nbytes * 8 / (gbit * 1e9)
            out.append(Prefix(p.path, gbit, wire, measured, max(wire, measured)))
    return out


def run_bench(config: L2BenchConfig, json_path: str = "", md_path: str = "") -> int:
    if not redis_available():
        print(f"kvshare bench l2: {REDIS_MISSING}")
        return 1
    load = list(os.getloadavg())
    size = int((config.chunks + 2) * config.chunk_bytes * 1.5) + 64 * MiB
    size -= size % PAGE
    l1_store, l1_retrieve, l1_miss = bench_l1(config, size)
    backends = []
    with start_redis() as server:
        version = server.cli("info", "server").split("redis_version:")[1].split()[0]
        backends.append(bench_backend("standalone", server, config, size))
    if config.cluster:
        with start_redis_cluster(config.masters) as servers:
            backends.append(bench_backend(f"cluster ({config.masters} masters)", servers, config, size))
    result = L2BenchResult(
        machine=machine(), command=config.command, load_average=load, redis=f"redis-server {version}",
        chunk_bytes=config.chunk_bytes, chunks=config.chunks, repeats=config.repeats, connections=config.connections,
        l1_store_gb_s=l1_store, l1_retrieve_gb_s=l1_retrieve, l1_lookup_miss_ms=l1_miss, backends=backends,
        prefix_tokens=PREFIX_TOKENS, prefix_bytes=PREFIX_TOKENS * BYTES_PER_TOKEN,
        prefix=prefix_arithmetic(backends[0].paths), recompute_s=RECOMPUTE_S,
        pcie_floor_s=PREFIX_TOKENS * BYTES_PER_TOKEN / (PCIE_GB_S * 1e9),
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


def _path(backend: Backend, name: str) -> PathResult:
    return next(p for p in backend.paths if p.path == name)


def markdown(r: L2BenchResult) -> str:
    load = "/".join(f"{x:.1f}" for x in r.load_average)
    names = [b.name for b in r.backends]
    lines = [
        "# L2 tier benchmark (loopback Redis): the original and the striped promotion side by side", "",
        f"Command: `{r.command}`  ", f"Machine: {r.machine}; load {load} at start  ",
        f"Redis: {r.redis}; {r.chunks} chunks of {r.chunk_bytes / MiB:g} MiB per pass, {r.repeats} passes per path "
        f"(paths alternating), striped with {r.connections} connections per node.", "",
        "| measure | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names),
    ]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(values) + " |")

    row("L1 store (RESERVE + copy + COMMIT), same run", [f"{r.l1_store_gb_s:.2f} GB/s"] * len(names))
    row("L1 retrieve (LOOKUP + copy + RELEASE), same run", [f"{r.l1_retrieve_gb_s:.2f} GB/s"] * len(names))
    row("L2 store: write-behind, COMMIT until written", [f"{b.l2_store_gb_s:.2f} GB/s" for b in r.backends])
    for path, label in (("redis-py", "redis-py (before)"), ("striped", "striped (now)")):
        ps = [_path(b, path) for b in r.backends]
        row(f"**L2 promote, {label}**: best / median", [f"**{p.promote_gb_s:.2f}** / {p.promote_median_gb_s:.2f} GB/s"
                                                         for p in ps])
        row(f"L2 promote + replica copies out, {label}", [f"{p.promote_and_read_gb_s:.2f} GB/s" for p in ps])
        row(f"CPU per GB promoted, {label}: pool / Redis", [f"{p.pool_cpu_s_per_gb:.2f} / {p.redis_cpu_s_per_gb:.2f} s"
                                                            for p in ps])
        row(f"LOOKUP promoting one {r.chunk_bytes / MiB:g} MiB chunk, {label}", [f"{p.promote_one_chunk_ms:.1f} ms"
                                                                                  for p in ps])
    row("striped / redis-py, best promote rate", [
        f"{_path(b, 'striped').promote_gb_s / _path(b, 'redis-py').promote_gb_s:.2f}x" for b in r.backends])
    row("plain redis-py SET / GET, same values", [f"{b.redis_set_gb_s:.2f} / {b.redis_get_gb_s:.2f} GB/s"
                                                  for b in r.backends])
    row("bare-socket GET, one connection, nothing parsed", [
        "n/a" if b.raw_get_gb_s is None else f"{b.raw_get_gb_s:.2f} GB/s" for b in r.backends])
    row("LOOKUP miss (L1 and L2), median", [f"{b.miss_lookup_ms:.2f} ms (L1 only: {r.l1_lookup_miss_ms:.2f})"
                                            for b in r.backends])
    if any(b.write_drops_filled for b in r.backends):
        row("write-behinds dropped (timeouts), values SET by the bench", [str(b.write_drops_filled)
                                                                           for b in r.backends])
    lines += [
        "", f"## A {r.prefix_tokens // 1024}k-token prefix of the 32B shape ({r.prefix_bytes / GiB:g} GiB) from "
        "another host", "",
        f"measured = {r.prefix_bytes / GiB:g} GiB / the standalone loopback promote rate (Redis, client, "
        "verification, copy into the arena; it includes the loopback transfer); wire = bytes / link rate. For "
        f"scale: recompute {r.recompute_s:.1f} s (one H200, docs/results/h200x2), local pool -> GPU floor "
        f"{r.pcie_floor_s:.2f} s (55 GB/s PCIe).", "",
        "| path | link | wire | measured | overlapped (max) |", "| --- | --- | --- | --- | --- |",
    ]
    for p in r.prefix:
        lines.append(f"| {p.path} | {p.link_gbit_s} Gb/s | {p.wire_s:.1f} s | {p.measured_s:.1f} s | "
                     f"{p.overlapped_s:.1f} s |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_bench(L2BenchConfig(chunks=8, repeats=1))
