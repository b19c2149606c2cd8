"""Issue 17: what checksum verification costs a cross-replica load on one H200, the arms side by side in one run.

    PYTHONPATH=/tmp/site:.:experiments python3 experiments/h200_verify_cost.py run --out $OUT

Replica A (a process running the engine in-process, as in h200_cross_replica.py) prefills the documents and stores
them in the pool; then one fresh replica B process per arm loads them (a fresh process, so every document is a
cross-replica pool hit, never B's own prefix cache). TTFT = submit -> first token event. Arms:
- off:    B does not verify (`--no-verify-checksums`).
- device: B verifies with the GPU hash of each staging slot (the default on CUDA).
- host:   B verifies with the same function on host threads over the arena (`checksums_on="host"`).
- alternate: one B process that verifies (GPU hash) every other pair of documents, off on on off off on on off ...
          (rows: alt-off, alt-device): the two conditions share a process, so the ~30 ms by which B processes differ
          after the load (runs 9-10) cancels out.
- xxh3:   the design before issue 17, rebuilt here only: A' and B' hash xxh3-64 on host threads (A' after its copies,
          B' while its copies run). A' stores its own copy of the 32k documents (the pool holds the new function's
          checksums of A's), so this arm runs at 32k only.
Every B loads a short warm-up document first (not counted). Per request the rows also carry the connector's load
time (load call, verification included) and its load failures (a failed verification would recompute: a row with a
failure is not a pool hit and is reported as such). Also measured in the same run, in a probe process: the
transfer floor (8 GiB between the registered arena and the GPU, both ways), the GPU hash's throughput, and the host
hash's vs xxh3's (one thread and 16).
Rows go to OUT/rows.jsonl as they are measured; OUT/summary.json and the printed table at the end.

A dry run of everything but the GPU parts, on a CPU with a tiny model (probe: host rates only):
    python experiments/h200_verify_cost.py run --device cpu --preset tiny --lengths 512,1024 --reps 2,1 \
        --pool-size 256MiB --max-model-len 2048 --warmup 256 --out /tmp/verify-cost
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from h200_cross_replica import QUESTIONS, document, first_token

ARMS = {  # arm -> (verify, where B hashes); xxh3 also needs its own A'
    "off": (False, "device"),
    "device": (True, "device"),
    "host": (True, "host"),
    "xxh3": (True, "host"),
    "alternate": (True, "device"),  # rows say alt-off / alt-device
    "alt-off": (False, "device"),
    "alt-device": (True, "device"),
}


# ---- replica process ---------------------------------------------------------------------------------------------
def use_xxh3() -> None:
    """The old checksum (xxh3-64 of the units, hashed on host threads), for the comparison arm only."""
    import xxhash

    import kvshare.transfer.checksum as where

    def xxh3_checksum(pages, page_ids, nbytes):
        digest = xxhash.xxh3_64()
        for k, page in enumerate(page_ids):
            digest.update(memoryview(pages[page, : min(pages.shape[1], nbytes - k * pages.shape[1])]))
        return digest.intdigest()

    where.arena_checksum = xxh3_checksum  # start_checksums looks it up at call time
    where.HASH_THREADS = min(16, os.cpu_count() or 1)  # as before: xxh3 scales (the pool is made at first use)


def replica(args) -> None:
    from kvshare.connector import ConnectorConfig
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.pool_connector import PoolConnector
    from kvshare.hf.config import default_dtype

    verify, where = ARMS[args.arm]
    if args.arm == "xxh3":
        use_xxh3()
    jobs = json.loads(Path(args.jobs).read_text())
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device,
                                 dtype=default_dtype(args.device), max_model_len=args.max_model_len))
    config = ConnectorConfig(address=args.pool, verify_checksums=verify, checksums_on=where, timeout=60.0)
    engine.set_connector(PoolConnector.for_engine(engine, config))
    stats = engine.connector.stats
    ready = time.perf_counter() - started
    vocab = min(engine.model_config.vocab_size, 150000)
    measured = 0
    with open(args.rows, "a") as out:
        for job in jobs:
            arm = args.arm
            if args.arm == "alternate":  # ABBA order over the measured documents; the warm-up verifies
                verify = job.get("warmup", False) or measured % 4 in (1, 2)
                engine.connector.core.config = dataclasses.replace(config, verify_checksums=verify)
                arm = "alt-device" if verify else "alt-off"
                measured += not job.get("warmup", False)
            prompt = document(job["length"], job["seed"], vocab) + document(QUESTIONS, job["question"], vocab)
            before = (stats.load_seconds, stats.load_failures, stats.corrupt_chunks)
            ttft, finished = first_token(engine, job["id"], prompt)
            flushed = time.perf_counter()
            engine.connector.core.flush(600)  # A's stores are committed before the next request and before B
            row = dict(job, role=args.role, arm=arm, ttft_s=ttft,
                       error=finished.error, pool_hit=finished.usage.pool_hit_tokens,
                       load_s=stats.load_seconds - before[0], load_failures=stats.load_failures - before[1],
                       corrupt_chunks=stats.corrupt_chunks - before[2], commit_wait_s=time.perf_counter() - flushed,
                       replica_ready_s=ready)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"  {args.role:>3} {arm:>10} {job['length']:>7}: TTFT {row['ttft_s'] or float('nan'):.3f} s, "
                  f"load {row['load_s']:.3f} s, pool hit {row['pool_hit']}, failures {row['load_failures']}",
                  flush=True)
    engine.connector.close()
    engine.shutdown()


# ---- probe process: floor and hash rates -------------------------------------------------------------------------
def probe(args) -> None:
    import torch
    import xxhash

    from kvshare import checksum
    from kvshare.pool.client import PoolClient
    from kvshare.transfer.checksum import HASH_THREADS, torch_terms_sum
    from kvshare.transfer.hostmem import register_pages

    client = PoolClient.connect(args.pool)
    size = min(8 << 30, client.num_pages * client.page_size // 2)
    n = size // client.page_size
    arena, result = client.pages, {}

    def timed(fn, repeats=3):
        times = []
        for _ in range(repeats):
            synchronize()
            t0 = time.perf_counter()
            fn()
            synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        pages = torch.from_numpy(client.pages)
        register_pages(pages, n)
        host = pages[:n].view(-1)
        device = torch.empty(n * client.page_size, dtype=torch.uint8, device="cuda")
        device.random_(0, 256)  # never time on zeros: the first copy out fills the arena too
        result["d2h_gb_s"] = size / timed(lambda: host.copy_(device, non_blocking=True)) / 1e9
        result["h2d_gb_s"] = size / timed(lambda: device.copy_(host, non_blocking=True)) / 1e9
        slot = min(64 << 20, size)  # a staging slot: 32 pages of 2 MiB
        rows = torch.from_numpy(checksum.chunk_coefficients(slot, client.page_size, client.page_size)).cuda()
        words = device.view(torch.int64).view(-1, *rows.shape)

        def gpu_hash():
            for k in range(words.shape[0]):
                torch_terms_sum(words[k], rows)

        result["gpu_hash_gb_s"] = size / timed(gpu_hash) / 1e9
        for kv_gib, length in ((8, 32768), (32, 131072)):
            result[f"floor_{length}_s"] = (kv_gib << 30) / (result["h2d_gb_s"] * 1e9)
    else:
        arena[:n] = np.random.default_rng(0).integers(0, 256, (n, client.page_size), dtype=np.uint8)
    one = arena[: max(1, min(n, (1 << 30) // client.page_size))].reshape(-1)
    result["host_hash_1thread_gb_s"] = one.size / timed(lambda: checksum.checksum(one), 2) / 1e9
    result["xxh3_1thread_gb_s"] = one.size / timed(lambda: xxhash.xxh3_64_intdigest(one), 2) / 1e9
    per_chunk = max(1, (64 << 20) // client.page_size)
    chunks = [[arena[p] for p in range(i, min(i + per_chunk, len(one) // client.page_size))]
              for i in range(0, len(one) // client.page_size, per_chunk)]  # 64 MiB chunks as page lists, 1 GiB
    default_batch = checksum._BATCH_BLOCKS
    for threads in (1, 4, HASH_THREADS):  # how the numpy path scales with threads (the GIL), by numpy pass size
        with ThreadPoolExecutor(threads) as pool:
            for batch in sorted({1, 4, default_batch}):
                checksum._BATCH_BLOCKS = batch
                rate = one.size / timed(lambda: list(pool.map(checksum.parts_checksum, chunks)), 2) / 1e9
                result[f"host_hash_batch{batch}_threads{threads}_gb_s"] = rate
            result[f"xxh3_threads{threads}_gb_s"] = one.size / timed(
                lambda: list(pool.map(lambda c: [xxhash.xxh3_64_intdigest(p) for p in c], chunks)), 2) / 1e9
    checksum._BATCH_BLOCKS = default_batch
    Path(args.rows).with_name("probe.json").write_text(json.dumps(result, indent=2))
    print("probe:", json.dumps(result), flush=True)


# ---- orchestrator ------------------------------------------------------------------------------------------------
def spawn(mode: str, ns, **extra) -> None:
    command = [sys.executable, __file__, mode, "--pool", ns.address, "--rows", str(ns.rows), "--model", ns.model,
               "--max-model-len", str(ns.max_model_len), "--device", ns.device]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(command, check=True, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def replica_jobs(lengths: list[int], reps: list[int], question: int, warmup: int) -> list[dict]:
    jobs = [dict(id=f"warmup-{question}", length=warmup, rep=-1, seed=999, question=question, warmup=True)]
    seed = iter(range(1000, 10**6))
    for length, n in zip(lengths, reps):
        jobs += [dict(id=f"{length}-{r}-{question}", length=length, rep=r, seed=next(seed), question=question + r)
                 for r in range(n)]
    return jobs


def run_replica(ns, role: str, arm: str, jobs: list[dict]) -> None:
    path = Path(tempfile.mkstemp(suffix=".json")[1])
    path.write_text(json.dumps(jobs))
    print(f"== {role} {arm}", flush=True)
    spawn("replica", ns, role=role, arm=arm, jobs=path)


def orchestrate(ns) -> None:
    from kvshare.engine.make_model import make_model
    from kvshare.pool.client import PoolClient
    from kvshare.pool.testing import start_pool

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ns.rows = out / "rows.jsonl"
    ns.model = str(make_model(ns.preset, Path(tempfile.mkdtemp()) / ns.preset))
    lengths, reps = [int(x) for x in ns.lengths.split(",")], [int(x) for x in ns.reps.split(",")]
    t0 = time.perf_counter()
    with start_pool(ns.pool_size, page_size="2MiB", check_integrity=False) as (address, _):
        ns.address = address
        print(f"pool {ns.pool_size} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        spawn("probe", ns)
        run_replica(ns, "A", "device", replica_jobs(lengths, reps, question=10, warmup=ns.warmup))
        for arm in ns.arms.split(","):
            if arm == "xxh3":
                continue
            run_replica(ns, "B", arm, replica_jobs(lengths, reps, question=20, warmup=ns.warmup))
        if "xxh3" in ns.arms.split(","):
            with PoolClient.connect(address) as client:
                client.clear()
            short = [(l, n) for l, n in zip(lengths, reps) if l <= 32768]
            xl, xr = [l for l, _ in short], [n for _, n in short]
            run_replica(ns, "A", "xxh3", replica_jobs(xl, xr, question=10, warmup=ns.warmup))
            run_replica(ns, "B", "xxh3", replica_jobs(xl, xr, question=20, warmup=ns.warmup))
    summarize(out)


def summarize(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    probe_path = out / "probe.json"
    probe_result = json.loads(probe_path.read_text()) if probe_path.exists() else {}
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        if row["role"] == "B" and not row.get("warmup"):
            groups.setdefault((row["length"], row["arm"]), []).append(row)
    summary = {"probe": probe_result, "arms": {}, "stores": {}}
    lines = ["| input | arm | n | ON TTFT median s | min | max | vs off | load call median s | failed loads |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (length, arm), group in sorted(groups.items(), key=lambda kv: (kv[0][0], list(ARMS).index(kv[0][1]))):
        ttft = [r["ttft_s"] for r in group if r["ttft_s"] is not None]
        off = groups.get((length, "alt-off" if arm.startswith("alt-") else "off"))
        off_median = statistics.median(r["ttft_s"] for r in off) if off else None
        median = statistics.median(ttft)
        delta = f"{(median - off_median) / off_median:+.1%}" if off_median else "-"
        load = statistics.median(r["load_s"] for r in group)
        failures = sum(r["load_failures"] for r in group)
        summary["arms"][f"{length}|{arm}"] = dict(n=len(ttft), median=median, min=min(ttft), max=max(ttft),
                                                 vs_off=delta, load_median=load, load_failures=failures,
                                                 ttft=ttft, load=[r["load_s"] for r in group])
        lines.append(f"| {length} | {arm} | {len(ttft)} | {median:.3f} | {min(ttft):.3f} | {max(ttft):.3f} | {delta} | "
                     f"{load:.3f} | {failures} |")
    for row in rows:
        if row["role"] == "A" and not row.get("warmup"):
            summary["stores"].setdefault(f"{row['length']}|{row['arm']}", []).append(
                dict(ttft_s=row["ttft_s"], commit_wait_s=row["commit_wait_s"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if probe_result:
        print("floor and rates:", ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in probe_result.items()))
    for key, values in summary["stores"].items():
        print(f"A {key}: commit wait after the request (s) {[round(v['commit_wait_s'], 3) for v in values]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--lengths", default="32768,131072")
    run.add_argument("--reps", default="3,2", help="documents per length (each B loads every one)")
    run.add_argument("--arms", default="off,device,host,xxh3")
    run.add_argument("--pool-size", default="100GiB")
    run.add_argument("--max-model-len", type=int, default=135168)
    run.add_argument("--preset", default="qwen2.5-32b")
    run.add_argument("--warmup", type=int, default=2048, help="tokens of the warm-up document every B loads first")
    run.add_argument("--device", default="cuda")
    run.add_argument("--out", default=os.environ.get("OUT", "out/verify_cost"))
    summary = sub.add_parser("summary")
    summary.add_argument("--out", type=Path, required=True)
    for name in ("replica", "probe"):
        child = sub.add_parser(name)
        for flag in ("--pool", "--rows", "--model"):
            child.add_argument(flag, required=True)
        child.add_argument("--max-model-len", type=int, required=True)
        child.add_argument("--device", required=True)
        if name == "replica":
            for flag in ("--role", "--arm", "--jobs"):
                child.add_argument(flag, required=True)
    ns = parser.parse_args()
    {"run": orchestrate, "replica": replica, "probe": probe, "summary": lambda a: summarize(a.out)}[ns.mode](ns)


if __name__ == "__main__":
    main()
