"""Issue 19, item 2 (nothing above the copy): where a cross-replica ON request's time above the load call goes, fp8 and
bf16 KV side by side, on one H200 (qwen2.5-32b shape, dummy weights, verification on).

    PYTHONPATH=/tmp/site:.:experiments python3 experiments/h200_tail_profile.py run --out $OUT/tail --budget 220

Parts, each a child process with its own deadline: per arm (fp8 then bf16) replica A stores a 2k warm-up and three
32k documents (experiments/h200_run12.py's `replica`), then one B process loads them: the warm-up (a pool hit, not
counted), document 1 timed by phase, document 2 timed by phase under torch.profiler (CPU and CUDA), document 3 timed
by phase (--settle: B first sleeps that long after its warm-up, so the arena's background registration is over;
--trace: the profiled request's chrome trace too). Phases, on the engine thread, each closed by a CUDA synchronize
so a phase holds its own GPU work:
schedule (the scheduler's step), load (the connector's load_prefix: the load's start, after the LOOKUP), prefill (the
tail's forward), sample; "other" is TTFT minus their sum (the LOOKUP and the inputs' upload are in it). The
synchronizes add a little; the unprofiled TTFT of run 12's B rows is the reference for the total. Output:
phases.jsonl, profile_<arm>.txt (the top ops by CUDA and by CPU time), summary.md.
--plain: TTFT only, and "enqueue", the host's time in load_prefix (unsynchronized: with the load in layer waves,
--waves, it returns once every copy is queued, so a value near the copy's time means the host paces the load).
--timeline: B profiles every run of its last document with named ranges and no synchronize (the GPU streams keep
their overlap) and prints each request's timeline (experiments/request_timeline.py): when the pool's copies end, the
forward's GPU work after them, the host's ranges; trace_<arm>_w<waves>.json.gz and timelines.jsonl beside the rows.

Dry run on a CPU: python experiments/h200_tail_profile.py run --device cpu --preset tiny --length 512 \
    --max-model-len 2048 --warmup 256 --pool-size 256MiB --out /tmp/tail --budget 200
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from h200_cross_replica import QUESTIONS, document, first_token
from h200_run12 import KV_DTYPES, Clock, jobs_file, spawn

PHASES = ("schedule", "load", "prefill", "sample")


def _timed(phases: dict, name: str, fn, sync):
    """fn wrapped so that each call adds its seconds (ended by `sync`, the device's work included) to phases[name]."""

    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            with record_function(f"phase:{name}"):  # a named range in the trace
                return fn(*args, **kwargs)
        finally:
            sync()
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - started

    return wrapper


class EngineThreadProfile:
    """torch.profiler run on the engine's own thread (the profiler records the ops of the thread that starts it):
    engine.step is wrapped so that the loop enters the profiler before its next step once `start()` is asked, and
    leaves it after a step once `stop()` is asked (the idle loop steps every IDLE_WAIT_S)."""

    def __init__(self, engine, activities):
        import torch

        self._new_profile = lambda: torch.profiler.profile(activities=activities)
        self.profile, self._step = None, engine.step
        self._want: str | None = None
        self._stopped = threading.Event()
        engine.step = self._wrapped

    def _wrapped(self):
        if self._want == "start" and self.profile is None:
            self.profile = self._new_profile()
            self.profile.__enter__()
            self._want = None
        try:
            return self._step()
        finally:
            if self._want == "stop" and self.profile is not None:
                self.profile.__exit__(None, None, None)
                self._want = None
                self._stopped.set()

    def start(self) -> None:
        self._want = "start"

    def stop(self):
        self._want = "stop"
        self._stopped.wait(30)
        return self.profile


def profiled(args) -> None:
    import torch

    from kvshare.connector import ConnectorConfig
    from kvshare.engine import engine as engine_module
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.pool_connector import PoolConnector

    jobs = json.loads(Path(args.jobs).read_text())
    engine = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype="bfloat16",
                                 kv_cache_dtype=KV_DTYPES[args.arm], max_model_len=args.max_model_len))
    engine.set_connector(PoolConnector.for_engine(engine, ConnectorConfig(address=args.pool, timeout=60.0)))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    phases: dict[str, float] = {}
    if args.timeline:  # named ranges only (no synchronize): the profiled request's GPU streams keep their overlap
        _annotate(engine, engine_module)
    elif args.plain:  # --plain: no phase timers (their synchronizes), no profile: TTFT as a client sees it; only the
        # host's time in load_prefix, which queues the load's copies (no sync: a load in waves returns while they run)
        engine.pool.load_prefix = _timed(phases, "enqueue", engine.pool.load_prefix, lambda: None)
    else:
        engine.scheduler.schedule = _timed(phases, "schedule", engine.scheduler.schedule, sync)
        engine.pool.load_prefix = _timed(phases, "load", engine.pool.load_prefix, sync)
        engine.runner.prefill = _timed(phases, "prefill", engine.runner.prefill, sync)
        engine_module.sample = _timed(phases, "sample", engine_module.sample, sync)  # engine.py calls it so
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
    stats = engine.connector.stats
    vocab = min(engine.model_config.vocab_size, 150000)
    out = Path(args.rows)
    # B only loads: its store of a prompt's tail (the document's last blocks and the question) would make the next
    # request of the same document hit those blocks too, a shorter tail than the first's, and bias a comparison of
    # waves run one after the other.
    engine.pool.store = lambda seq, num_tokens: None
    runs = [(index, job, waves) for index, job in enumerate(jobs)
            for waves in ([4] if job.get("warmup") else [int(w) for w in args.waves.split(",")])]
    for n, (index, job, waves) in enumerate(runs):
        if n == 1 and args.settle:  # after the warm-up: let the arena's background registration finish first
            time.sleep(args.settle)
        # The load's layer waves (kvshare.transfer.waves), side by side on the same document: B forgets its local
        # prefix cache first, so each request loads the document from the pool again.
        engine.connector.core.config = dataclasses.replace(engine.connector.core.config, load_waves=waves)
        engine.block_manager.hash_to_block.clear()  # the engine is idle between requests
        prompt = document(job["length"], job["seed"], vocab) + document(QUESTIONS, job["question"], vocab)
        if args.timeline:  # every run of the last document (one per waves value), profiled without synchronizes
            profile_this = index == len(jobs) - 1
        else:
            profile_this = index == 2 and not args.plain and n == len(runs) - 1  # the last run of the profiled doc
        phases.clear()
        load_before = stats.load_seconds
        if profile_this:
            profiler = EngineThreadProfile(engine, activities)
            profiler.start()
        ttft, finished = first_token(engine, f"{job['id']}-w{waves}-{n}", prompt)
        profile = profiler.stop() if profile_this else None
        row = dict(job, arm=args.arm, waves=waves, profiled=profile_this, ttft_s=ttft,
                   pool_hit=finished.usage.pool_hit_tokens, load_call_s=stats.load_seconds - load_before,
                   error=finished.error, enqueue_s=phases.pop("enqueue", 0.0),
                   **{f"{name}_s": phases.get(name, 0.0) for name in PHASES})
        row["other_s"] = (ttft or 0.0) - sum(phases.get(name, 0.0) for name in PHASES)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        kind = "profiled" if profile_this else "plain   "
        shown = float("nan") if ttft is None else ttft
        print(f"  B {args.arm} {job['length']} w{waves} {kind}: TTFT {shown:.3f} s enqueue {row['enqueue_s']:.3f} "
              + " ".join(f"{name} {phases.get(name, 0.0):.3f}" for name in PHASES)
              + f" other {row['other_s']:.3f}", flush=True)
        if profile_this and args.timeline:
            _write_timeline(profile, out.with_name(f"trace_{args.arm}_w{waves}.json"), row)
        elif profile_this:
            sort_cuda = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
            averages = profile.key_averages()
            text = (f"# {args.arm} {job['length']} tokens, TTFT {ttft:.3f} s\n\n## by self CUDA time\n"
                    + averages.table(sort_by=sort_cuda, row_limit=30)
                    + "\n## by self CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30))
            out.with_name(f"profile_{args.arm}.txt").write_text(text)
            if args.trace:
                trace = out.with_name(f"trace_{args.arm}.json")
                profile.export_chrome_trace(str(trace))
                with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
                    shutil.copyfileobj(raw, packed)
                trace.unlink()
    engine.connector.close()
    engine.shutdown()


def _annotate(engine, engine_module) -> None:
    """Name the request's steps in the trace (record_function ranges, nothing synchronized): the scheduler's step,
    the pool's LOOKUP and the load's start, the forward, the load's settling, sampling and the token's emission."""
    from torch.profiler import record_function

    def named(name, fn):
        def wrapper(*args, **kwargs):
            with record_function(f"range:{name}"):
                return fn(*args, **kwargs)
        return wrapper

    connector = engine.pool.connector
    start_load = connector.start_load

    def start_load_named(*args, **kwargs):
        with record_function("range:start_load"):
            pending = start_load(*args, **kwargs)
        if pending is not None:
            pending.finish = named("finish", pending.finish)
        return pending

    connector.lookup = named("lookup", connector.lookup)
    connector.start_load = start_load_named
    engine.scheduler.schedule = named("schedule", engine.scheduler.schedule)
    engine.runner.prefill = named("prefill", engine.runner.prefill)
    engine._postprocess = named("postprocess", engine._postprocess)
    engine_module.sample = named("sample", engine_module.sample)


def _write_timeline(profile, trace: Path, row: dict) -> None:
    """The request's chrome trace (gzip) and its summary (experiments/request_timeline.py), printed and added to the
    rows file."""
    from request_timeline import load_trace, render, timeline

    profile.export_chrome_trace(str(trace))
    summary = timeline(load_trace(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    print(f"  timeline {row['arm']} w{row['waves']} (TTFT {row['ttft_s']}):\n" + render(summary), flush=True)
    with open(trace.with_name("timelines.jsonl"), "a") as f:
        f.write(json.dumps(dict(arm=row["arm"], waves=row["waves"], ttft_s=row["ttft_s"], **summary)) + "\n")


def orchestrate(ns) -> None:
    from kvshare.engine.make_model import make_model
    from kvshare.pool.testing import start_pool

    clock = Clock(ns.budget)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ns.rows = Path(tempfile.mkdtemp()) / "store_rows.jsonl"  # A's rows: the log shows them; $OUT keeps 8 files
    ns.model = str(make_model(ns.preset, Path(tempfile.mkdtemp()) / ns.preset))
    # No per-client lease limit (default: half the arena): one replica at a time here, and a 256k bf16 prompt is
    # 64 GiB, more than half of any pool this host can hold beside it.
    with start_pool(ns.pool_size, page_size="2MiB", check_integrity=False, timeout=120,
                    max_leased_pages_per_client=0) as (address, _):
        ns.address = address
        for arm in ns.arms.split(","):
            spawn("replica", ns, clock, 40, script=__file__, role="A", arm=arm,
                  jobs=jobs_file([ns.length], [ns.docs], question=10, warmup=ns.warmup))
            spawn("profiled", ns, clock, 20, script=__file__, rows=out / "phases.jsonl", arm=arm, settle=ns.settle,
                  trace=int(ns.trace), plain=int(ns.plain), timeline=int(ns.timeline), waves=ns.waves,
                  jobs=jobs_file([ns.length], [ns.docs], question=20, warmup=ns.warmup))
    summarize(out)


def summarize(out: Path) -> None:
    path = out / "phases.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    lines = ["| KV | waves | request | n | TTFT s (min-max) | load call s | enqueue s | "
             + " | ".join(f"{p} s" for p in PHASES) + " | other s |", "| --- " * (8 + len(PHASES)) + "|"]
    for arm in ("fp8", "bf16"):
        for waves in sorted({r.get("waves", 1) for r in rows}):
            for profiled_rows in (False, True):
                group = [r for r in rows if r["arm"] == arm and not r.get("warmup") and r["profiled"] == profiled_rows
                         and r["ttft_s"] is not None and r.get("waves", 1) == waves]
                if group:
                    lines.append(_summary_row(arm, waves, profiled_rows, group))
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text, flush=True)


def _summary_row(arm: str, waves: int, profiled_rows: bool, group: list[dict]) -> str:
    def med(key):
        return f"{statistics.median(r[key] for r in group):.3f}"

    spread = f"{min(r['ttft_s'] for r in group):.3f}-{max(r['ttft_s'] for r in group):.3f}"
    return (f"| {arm} | {waves} | {'profiled' if profiled_rows else 'plain'} | {len(group)} | {med('ttft_s')} "
            f"({spread}) | {med('load_call_s')} | {statistics.median(r.get('enqueue_s', 0.0) for r in group):.3f} | "
            + " | ".join(med(f"{p}_s") for p in PHASES)
            + f" | {med('other_s')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--length", type=int, default=32768)
    run.add_argument("--pool-size", default="48GiB")
    run.add_argument("--max-model-len", type=int, default=40960)
    run.add_argument("--preset", default="qwen2.5-32b")
    run.add_argument("--warmup", type=int, default=2048)
    run.add_argument("--device", default="cuda")
    run.add_argument("--budget", type=float, default=220.0)
    run.add_argument("--out", default=os.environ.get("OUT", "out/tail"))
    run.add_argument("--settle", type=float, default=0.0, help="B sleeps this long after its warm-up (registration)")
    run.add_argument("--trace", action="store_true", help="also write the profiled request's chrome trace (gzip)")
    run.add_argument("--plain", action="store_true", help="B times TTFT only: no phase timers, no profile")
    run.add_argument("--timeline", action="store_true",
                     help="B profiles each run of its last document with named ranges and no synchronize, and writes "
                          "its chrome trace and timeline (experiments/request_timeline.py)")
    run.add_argument("--arms", default="fp8,bf16")
    run.add_argument("--docs", type=int, default=3, help="documents A stores and B loads, per arm")
    run.add_argument("--waves", default="4", help="B loads each document once per value: the load's layer waves "
                                                  "(1 = whole before the forward), side by side")
    for name in ("replica", "profiled"):
        child = sub.add_parser(name)
        for flag in ("--pool", "--rows", "--model", "--device", "--role", "--arm", "--jobs"):
            child.add_argument(flag, required=flag != "--role")
        child.add_argument("--max-model-len", type=int, required=True)
        child.add_argument("--settle", type=float, default=0.0)
        child.add_argument("--trace", type=int, default=0)
        child.add_argument("--plain", type=int, default=0)
        child.add_argument("--timeline", type=int, default=0)
        child.add_argument("--waves", default="4")
    ns = parser.parse_args()
    if ns.mode == "replica":
        from h200_run12 import replica

        replica(ns)
    else:
        {"run": orchestrate, "profiled": profiled}[ns.mode](ns)


if __name__ == "__main__":
    sys.exit(main())
