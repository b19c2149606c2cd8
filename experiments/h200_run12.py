"""Issue 19, run 12 on one H200: replica start-up with the arena registered in pieces, and fp8 vs bf16 cross-replica
ON TTFT with the transfer floor measured in the same run. Driven by `experiments/h200.py run12` (pytest first).

    PYTHONPATH=/tmp/site:.:experiments python3 experiments/h200_run12.py run --out $OUT --budget 380

Parts, each a child process with its own deadline (whatever is left of --budget), rows written as they are measured:
- startup (32 GiB pool, then 100 GiB): in one process, time to a ready engine (tiny model, CUDA) with no pool (the
  first one pays CUDA's start), again with no pool, then attached to the pool (the arena registered in the background,
  16 GiB pieces, 4 threads); then how long the background registration took in all; then eager registrations of
  fresh mappings of the same arena by threads and piece size (these pages are already faulted in by then).
- probe: pinned host<->device copies of 8 GiB of the registered arena (the transfer floor).
- fp8 / bf16 (qwen2.5-32b shape, dummy weights, bf16 compute; the 100 GiB pool): replica A stores a warm-up document,
  two 32k documents and one 128k document; then fresh B processes (two where time allows) load them all, each after
  the warm-up (a pool hit, not counted). TTFT = submit -> first token event; the rows carry the connector's load call.
Output (at most 8 files): startup.jsonl, probe.json, rows.jsonl, summary.md; the log is the wrapper's.

A dry run on a CPU (tiny model, small pools) checks the plumbing:
    python experiments/h200_run12.py run --device cpu --preset tiny --lengths 512,1024 --pools 64MiB,96MiB \
        --fp8-pool 96MiB --max-model-len 2048 --warmup 256 --out /tmp/run12 --budget 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from h200_cross_replica import QUESTIONS, document, first_token

KV_DTYPES = {"fp8": "fp8", "bf16": "auto"}


# ---- startup -----------------------------------------------------------------------------------------------------
def startup(args) -> None:
    import torch

    from kvshare.connector import ConnectorConfig
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.pool_connector import PoolConnector
    from kvshare.pool.client import PoolClient
    from kvshare.transfer import arena_pages
    from kvshare.transfer.hostmem import Pieces, Registration
    from kvshare.units import parse_size

    out = open(args.rows, "a")

    def row(**fields):
        fields.update(pool=args.pool_size)
        out.write(json.dumps(fields) + "\n")
        out.flush()
        print("  startup", json.dumps(fields), flush=True)

    def ready_engine(pool: str | None):
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype="bfloat16",
                                     max_model_len=4096, num_blocks=256))
        if pool:
            engine.set_connector(PoolConnector.for_engine(engine, ConnectorConfig(address=pool, timeout=60.0)))
        if args.device == "cuda":
            torch.cuda.synchronize()
        return engine, time.perf_counter() - t0

    for what in ("no pool (first CUDA start)", "no pool"):
        engine, seconds = ready_engine(None)
        row(what=what, ready_s=seconds)
        engine.shutdown()
    engine, seconds = ready_engine(args.pool)
    transfer = engine.connector.core._attached.transfer  # a diagnostic may look inside; the code never does
    registration = transfer.registration if args.device == "cuda" else None  # CPU transfers register nothing
    row(what="attached, background registration", ready_s=seconds,
        registered_at_ready=registration.registered() if registration else None,
        pieces=registration.pieces.count if registration else None)
    if registration is not None:
        t0 = time.perf_counter()
        registration.wait_all()
        waited = time.perf_counter() - t0
        row(what="background registration done", after_ready_s=waited, since_start_s=waited + seconds,
            s_per_gib_since_start=(waited + seconds) / (transfer.pages.numel() / 2**30))
    engine.connector.close()
    engine.shutdown()
    if args.device != "cuda":
        return
    for spec in args.trials.split(","):
        threads, piece = spec.split("x")
        with PoolClient.connect(args.pool) as client:  # a fresh mapping: nothing of it registered yet
            pages = arena_pages(client)
            reg = Registration(pages.data_ptr(), Pieces.of(pages.shape[0], pages.shape[1], parse_size(piece)),
                               int(threads))
            t0 = time.perf_counter()
            reg.start().wait_all()
            seconds = time.perf_counter() - t0
            gib = pages.numel() / 2**30
            row(what="eager registration of a fresh mapping", threads=int(threads), piece=piece,
                pieces=reg.pieces.count, seconds=seconds, s_per_gib=seconds / gib)
            reg.close()
            del pages


# ---- probe: the transfer floor ----------------------------------------------------------------------------------
def probe(args) -> None:
    import torch

    from kvshare.pool.client import PoolClient
    from kvshare.transfer.hostmem import register_pages

    client = PoolClient.connect(args.pool)
    size = min(8 << 30, client.num_pages * client.page_size // 2)
    n = size // client.page_size
    result = {}
    if args.device == "cuda":
        pages = torch.from_numpy(client.pages)
        t0 = time.perf_counter()
        register_pages(pages, n)
        result["register_8gib_s"] = time.perf_counter() - t0
        host = pages[:n].view(-1)
        device = torch.empty(n * client.page_size, dtype=torch.uint8, device="cuda")
        device.random_(0, 256)  # never time on zeros

        def timed(fn, repeats=3):
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        result["d2h_gb_s"] = size / timed(lambda: host.copy_(device, non_blocking=True)) / 1e9
        result["h2d_gb_s"] = size / timed(lambda: device.copy_(host, non_blocking=True)) / 1e9
        kv = {"bf16": 256 << 10, "fp8": 128 << 10}  # bytes per token, qwen2.5-32b shape
        for name, per_token in kv.items():
            for length in (32768, 131072):
                result[f"floor_{name}_{length}_s"] = per_token * length / (result["h2d_gb_s"] * 1e9)
    Path(args.rows).with_name("probe.json").write_text(json.dumps(result, indent=2))
    print("probe:", json.dumps(result), flush=True)


# ---- replica: A stores, B loads ---------------------------------------------------------------------------------
def replica(args) -> None:
    from kvshare.connector import ConnectorConfig
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.pool_connector import PoolConnector

    jobs = json.loads(Path(args.jobs).read_text())
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype="bfloat16",
                                 kv_cache_dtype=KV_DTYPES[args.arm], max_model_len=args.max_model_len))
    engine.set_connector(PoolConnector.for_engine(engine, ConnectorConfig(address=args.pool, timeout=60.0)))
    stats = engine.connector.stats
    ready = time.perf_counter() - started
    vocab = min(engine.model_config.vocab_size, 150000)
    with open(args.rows, "a") as out:
        for job in jobs:
            prompt = document(job["length"], job["seed"], vocab) + document(QUESTIONS, job["question"], vocab)
            before = (stats.load_seconds, stats.load_failures)
            ttft, finished = first_token(engine, job["id"], prompt)
            flushed = time.perf_counter()
            engine.connector.core.flush(600)  # A's stores are committed before the next request and before B
            row = dict(job, role=args.role, arm=args.arm, ttft_s=ttft, error=finished.error,
                       pool_hit=finished.usage.pool_hit_tokens, load_s=stats.load_seconds - before[0],
                       load_failures=stats.load_failures - before[1], commit_wait_s=time.perf_counter() - flushed,
                       replica_ready_s=ready)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"  {args.role:>3} {args.arm:>4} {job['length']:>7}: TTFT {row['ttft_s'] or float('nan'):.3f} s, "
                  f"load {row['load_s']:.3f} s, pool hit {row['pool_hit']}, failures {row['load_failures']}",
                  flush=True)
    engine.connector.close()
    engine.shutdown()


# ---- orchestrator ------------------------------------------------------------------------------------------------
class Clock:
    """What is left of the run's budget; every child gets at most that as its timeout."""

    def __init__(self, budget: float):
        self.end = time.monotonic() + budget

    def left(self) -> float:
        return self.end - time.monotonic()


def spawn(mode: str, ns, clock: Clock, need: float, script: str = __file__, **extra) -> bool:
    """Run a child part (`script mode ...`) if at least `need` seconds are left; False if skipped, cut or failed
    (noted in the log)."""
    if clock.left() < need:
        print(f"== skip {mode} {extra}: {clock.left():.0f} s left, needs ~{need:.0f}", flush=True)
        return False
    command = [sys.executable, script, mode, "--pool", ns.address, "--rows", str(extra.pop("rows", ns.rows)),
               "--model", extra.pop("model", ns.model), "--max-model-len", str(ns.max_model_len),
               "--device", ns.device]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    print(f"== {mode} {' '.join(command[3:])}", flush=True)
    return run_child(mode, command, clock)


def run_child(mode: str, command: list[str], clock: Clock, env: dict | None = None) -> bool:
    """Run one child part under what is left of the budget (expandable CUDA segments, unbuffered output, plus `env`);
    False if it was cut or failed (noted in the log)."""
    child_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTHONUNBUFFERED": "1",
                 **(env or {})}
    try:
        result = subprocess.run(command, env=child_env, timeout=max(1.0, clock.left()))
    except subprocess.TimeoutExpired:
        print(f"== {mode} cut at the budget's end", flush=True)
        return False
    if result.returncode:
        print(f"== {mode} failed with {result.returncode}", flush=True)
    return result.returncode == 0


def jobs_file(lengths: list[int], reps: list[int], question: int, warmup: int) -> str:
    jobs = [dict(id=f"warmup-{question}", length=warmup, rep=-1, seed=999, question=question, warmup=True)]
    seed = iter(range(1000, 10**6))
    for length, n in zip(lengths, reps):
        jobs += [dict(id=f"{length}-{r}-{question}", length=length, rep=r, seed=next(seed), question=question + r)
                 for r in range(n)]
    path = tempfile.mkstemp(suffix=".json")[1]
    Path(path).write_text(json.dumps(jobs))
    return path


def orchestrate(ns) -> None:
    from kvshare.engine.make_model import make_model
    from kvshare.pool.testing import start_pool

    clock = Clock(ns.budget)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ns.rows = out / "rows.jsonl"
    tiny = str(make_model("tiny", Path(tempfile.mkdtemp()) / "tiny"))
    ns.model = str(make_model(ns.preset, Path(tempfile.mkdtemp()) / ns.preset))
    pools = ns.pools.split(",")
    for size in pools:
        t0 = time.perf_counter()
        with start_pool(size, page_size="2MiB", check_integrity=False, timeout=120) as (address, _):
            ns.address = address
            prepared = time.perf_counter() - t0
            with open(out / "startup.jsonl", "a") as f:
                f.write(json.dumps(dict(pool=size, what="pool ready (arena prepared)", ready_s=prepared)) + "\n")
            print(f"pool {size} ready in {prepared:.1f} s", flush=True)
            trials = ns.trials_small if size != pools[-1] else ns.trials_large
            spawn("startup", ns, clock, 20, rows=out / "startup.jsonl", model=tiny, pool_size=size, trials=trials)
            if size != ns.fp8_pool:
                continue
            spawn("probe", ns, clock, 15)
            lengths, reps = [int(x) for x in ns.lengths.split(",")], [int(x) for x in ns.reps.split(",")]
            for arm in ("fp8", "bf16"):
                spawn("replica", ns, clock, 70, role="A", arm=arm,
                      jobs=jobs_file(lengths, reps, question=10, warmup=ns.warmup))
                spawn("replica", ns, clock, 18, role="B", arm=arm,
                      jobs=jobs_file(lengths, reps, question=20, warmup=ns.warmup))
            for arm in ("fp8", "bf16"):  # a second B process per arm where time allows: n doubles
                spawn("replica", ns, clock, 18, role="B2", arm=arm,
                      jobs=jobs_file(lengths, reps, question=30, warmup=ns.warmup))
    summarize(out)


def summarize(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()] \
        if (out / "rows.jsonl").exists() else []
    probe_path = out / "probe.json"
    floor = json.loads(probe_path.read_text()) if probe_path.exists() else {}
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        if row["role"].startswith("B") and not row.get("warmup") and row["ttft_s"] is not None:
            groups.setdefault((row["length"], row["arm"]), []).append(row)
    lines = ["| input | KV | n | ON TTFT median s | min | max | load call median s | transfer floor s | "
             "ON - floor s | pool hit tokens | failed loads |", "| --- | --- | --- | --- | --- | --- | --- | --- | "
             "--- | --- | --- |"]
    for (length, arm), group in sorted(groups.items()):
        ttft = [r["ttft_s"] for r in group]
        median = statistics.median(ttft)
        f = floor.get(f"floor_{arm}_{length}_s")
        lines.append(f"| {length} | {arm} | {len(ttft)} | {median:.3f} | {min(ttft):.3f} | {max(ttft):.3f} | "
                     f"{statistics.median(r['load_s'] for r in group):.3f} | {f and f'{f:.3f}'} | "
                     f"{f and f'{median - f:.3f}'} | {min(r['pool_hit'] for r in group)} | "
                     f"{sum(r['load_failures'] for r in group)} |")
    stores = [f"A {r['arm']} {r['length']}: TTFT {r['ttft_s']:.3f} s (stores), commit wait {r['commit_wait_s']:.3f} s"
              for r in rows if r["role"] == "A" and not r.get("warmup") and r["ttft_s"] is not None]
    startup_path = out / "startup.jsonl"
    start_rows = [json.loads(line) for line in startup_path.read_text().splitlines()] if startup_path.exists() else []
    text = "\n".join(lines + [""] + stores + ["", "start-up:"] + [json.dumps(r) for r in start_rows]
                     + ["", f"floor: {json.dumps(floor)}"])
    (out / "summary.md").write_text(text + "\n")
    print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--lengths", default="32768,131072")
    run.add_argument("--reps", default="2,1", help="documents per length (each B loads every one)")
    run.add_argument("--pools", default="32GiB,100GiB", help="start-up is measured with each; the last serves fp8")
    run.add_argument("--fp8-pool", default="100GiB")
    run.add_argument("--trials-small", default="1x4GiB,4x4GiB,8x4GiB,2x16GiB", help="threads x piece")
    run.add_argument("--trials-large", default="8x4GiB")
    run.add_argument("--max-model-len", type=int, default=135168)
    run.add_argument("--preset", default="qwen2.5-32b")
    run.add_argument("--warmup", type=int, default=2048)
    run.add_argument("--device", default="cuda")
    run.add_argument("--budget", type=float, default=380.0, help="seconds for the whole run; parts get what is left")
    run.add_argument("--out", default=os.environ.get("OUT", "out/run12"))
    summary = sub.add_parser("summary")
    summary.add_argument("--out", type=Path, required=True)
    for name in ("startup", "probe", "replica"):
        child = sub.add_parser(name)
        for flag in ("--pool", "--rows", "--model", "--device"):
            child.add_argument(flag, required=True)
        child.add_argument("--max-model-len", type=int, required=True)
        if name == "replica":
            for flag in ("--role", "--arm", "--jobs"):
                child.add_argument(flag, required=True)
        if name == "startup":
            child.add_argument("--pool-size", required=True)
            child.add_argument("--trials", default="")
    ns = parser.parse_args()
    {"run": orchestrate, "startup": startup, "probe": probe, "replica": replica,
     "summary": lambda a: summarize(a.out)}[ns.mode](ns)


if __name__ == "__main__":
    main()
