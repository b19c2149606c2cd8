"""Cross-replica TTFT on one GPU (issue 8): replicas A and B are separate processes sharing one pool; the 32B
model fits only one at a time, so A runs, stores its documents and exits, then B runs. Block order OFF-ON-ON-OFF.

    PYTHONPATH=/tmp/site:. python3 experiments/h200_cross_replica.py --lengths 32768,131072 --reps 2,2 --out $OUT
    # the hybrid 27B shape (issue 31): K/V of 16 attention layers + one state per 4096-token chunk
    PYTHONPATH=/tmp/site:. python3 experiments/h200_cross_replica.py run --preset qwen3.5-27b --chunk-tokens 4096 \
        --kv-cache-memory 20GiB --pool-size 64GiB --lengths 131072,262144 --reps 1,1 --blocks ON1,OFF1 \
        --questions 3 --warmup-len 8192 --out $OUT

--blocks picks the blocks and their order (the 27B hybrid's OFF costs ~30 s at 128k and a replica start ~50 s, so a
ten-minute call holds one ON and one OFF block); --questions has B ask several questions about each stored
document (each a pool hit of the same chunks: spread without another 256k prefill on A); --warmup-len makes each
replica process serve one unrecorded request first (the Triton kernels compile and autotune on a process's first
request: 16-60 s in run 30), A storing it and B loading it, so that what is recorded is the steady state.

Each replica is a process running the kvshare engine in-process (no HTTP): TTFT = submit -> first token event,
with the device synchronised by the sampler's read of the logits. OFF blocks run B without a pool (A's warm request
has no effect on a replica without a pool, so it is skipped). In ON blocks A's TTFT is also recorded: it is the first
(missing) request, which stores. The GPU service regression compares B ON with B OFF on one prompt: first-token
logits (max abs difference) and greedy tokens. A hybrid model has no local prefix cache, so its bit-for-bit check is
B's pool hit against A's own second request of the same prompt (a pool hit on A): the same tail computation from
the same loaded K/V and state, in another process. Rows go to OUT/cross_replica.jsonl as they are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = 64  # tokens of the new question B asks about the document
REGRESSION_LEN = 32768


def document(length: int, seed: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_token(engine, request_id: str, prompt: list[int]):
    """Submit a one-token greedy request and wait for it: (seconds from submit to the first token event, or None if
    none came; the finished event). TTFT is stamped in the event callback, so the wait's polling does not enter it."""
    from kvshare.engine.api import GenerationRequest, SamplingParams

    first, done = [], []
    started = time.perf_counter()

    def on_event(event):
        if event.token_id is not None and not first:
            first.append(time.perf_counter() - started)
        if event.finished:
            done.append(event)

    engine.submit(GenerationRequest(request_id, tuple(prompt), SamplingParams(max_tokens=1, ignore_eos=True)),
                  on_event)
    while not done:
        time.sleep(0.001)
    return (first[0] if first else None), done[0]


# ---- replica process ---------------------------------------------------------------------------------------------
def replica(args) -> None:
    import torch

    from kvshare.connector import ConnectorConfig
    from kvshare.engine.api import GenerationRequest, SamplingParams
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.pool_connector import PoolConnector

    jobs = json.loads(Path(args.jobs).read_text())
    if args.warmup_len:  # unrecorded (see the module docstring); a fixed document, so that B-on's warm-up is a hit
        jobs.insert(0, dict(id="warmup", block="WARM", arm="WARM", length=args.warmup_len, rep=0, seed=5,
                            question=6, warmup=True))
    started = time.perf_counter()
    from kvshare.units import parse_size

    engine = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype="bfloat16",
                                 max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
                                 kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None))
    if args.pool != "none":
        # Verification is on unless asked otherwise: on the GPU it costs ~1% of ON TTFT (issue 17, NOTES runs 9-10);
        # runs 3-4 and the two-GPU runs before issue 17 used --no-verify-checksums (host hashing cost +100% then).
        config = ConnectorConfig(address=args.pool, verify_checksums=not args.no_verify_checksums,
                                 chunk_tokens=args.chunk_tokens, unsafe_skip_state_load=args.unsafe_skip_state_load)
        engine.set_connector(PoolConnector.for_engine(engine, config))
    logits: list = []
    original = engine.runner.prefill
    # keep first-token logits (the runner's keyword arguments: a pool load's layer waits, the staged inputs)
    engine.runner.prefill = lambda seq, **kwargs: logits.append(original(seq, **kwargs)) or logits[-1]
    ready = time.perf_counter() - started
    with open(args.rows, "a") as out:
        for job in jobs:
            vocab = min(engine.model_config.vocab_size, 150000)
            prompt = document(job["length"], job["seed"], vocab) + document(QUESTIONS, job["question"], vocab)
            sampling = SamplingParams(max_tokens=job.get("max_tokens", 1), ignore_eos=True)
            first: list[float] = []
            tokens: list[int] = []
            done: list = []
            t0 = time.perf_counter()

            def on_event(event, first=first, tokens=tokens, done=done, t0=t0):
                if event.token_id is not None:
                    if not first:
                        first.append(time.perf_counter() - t0)
                    tokens.append(event.token_id)
                if event.finished:
                    done.append(event)

            engine.submit(GenerationRequest(job["id"], tuple(prompt), sampling), on_event)
            while not done:
                time.sleep(0.002)
            event = done[0]
            if engine.connector is not None:
                engine.connector.core.flush(600)  # A's stores are committed before B starts
            row = dict(job, role=args.role, ttft_s=first[0] if first else None, finish=event.finish_reason,
                       error=event.error, prompt_tokens=len(prompt), local_hit=event.usage.local_hit_tokens,
                       pool_hit=event.usage.pool_hit_tokens, replica_ready_s=ready)
            if job.get("warmup") and row["ttft_s"] is not None:
                print(f"  {args.role:>6} warm-up {job['length']} tokens: {row['ttft_s']:.3f} s", flush=True)
                continue
            if job.get("regression"):
                row["tokens"] = tokens
                torch.save(logits[-1].float().cpu(), Path(args.rows).with_name(f"logits-{job['id']}-{args.role}.pt"))
            out.write(json.dumps(row) + "\n")
            out.flush()
            if row["ttft_s"] is None:
                raise SystemExit(f"request {job['id']} failed: {event.error}")
            print(f"  {args.role:>6} {job['block']:>4} {job['length']:>7} tokens: TTFT {row['ttft_s']:.3f} s "
                  f"(pool hit {row['pool_hit']}, local hit {row['local_hit']})", flush=True)
    if engine.connector is not None:
        engine.connector.close()
    engine.shutdown()


# ---- orchestrator ------------------------------------------------------------------------------------------------
def run_replica(role: str, pool: str, jobs: list[dict], ns, *flags: str) -> None:
    if not jobs:
        return
    jobs_file = Path(tempfile.mkstemp(suffix=".json")[1])
    jobs_file.write_text(json.dumps(jobs))
    command = [sys.executable, __file__, "replica", "--role", role, "--pool", pool, "--jobs", str(jobs_file),
               "--model", ns.model, "--rows", str(ns.rows), "--device", ns.device,
               "--max-model-len", str(ns.max_model_len), "--chunk-tokens", str(ns.chunk_tokens),
               "--kv-cache-memory", ns.kv_cache_memory, "--kv-cache-dtype", ns.kv_cache_dtype,
               "--warmup-len", str(ns.warmup_len)]
    if ns.no_verify_checksums:
        command.append("--no-verify-checksums")
    command += flags
    subprocess.run(command, check=True, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def pool_bytes_per_token(preset: str, chunk_tokens: int, kv_cache_dtype: str) -> float:
    """What the pool holds per stored token: the K/V of every attention layer, plus a hybrid model's state per chunk."""
    import torch

    from kvshare.engine.make_model import PRESETS, hf_config
    from kvshare.hf.config import ModelConfig
    from kvshare.transfer.state import StateLayout

    config = ModelConfig.from_hf(hf_config(PRESETS[preset], 0, 1))
    kv = config.kv_bytes_per_token("bfloat16") // (2 if kv_cache_dtype == "fp8" else 1)
    if config.linear is None:
        return kv
    return kv + StateLayout.of_model(config, torch.float32, torch.bfloat16).nbytes / chunk_tokens


def cycles(jobs: list[dict], capacity: int, bytes_per_token: float) -> list[list[dict]]:
    """Split ON jobs into A/B cycles whose documents fit the pool together."""
    out, current, used = [], [], 0
    for job in jobs:
        need = (job["length"] + QUESTIONS) * bytes_per_token
        if current and used + need > capacity:
            out.append(current)
            current, used = [], 0
        current.append(job)
        used += need
    return out + ([current] if current else [])


def orchestrate(ns) -> None:
    from kvshare.engine.make_model import make_model
    from kvshare.pool.client import PoolClient
    from kvshare.pool.testing import start_pool

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ns.rows = out / "cross_replica.jsonl"
    ns.model = str(make_model(ns.preset, Path(tempfile.mkdtemp()) / ns.preset))
    lengths = [int(x) for x in ns.lengths.split(",")]
    reps = [int(x) for x in ns.reps.split(",")]
    seed = iter(range(1000, 10**6))
    blocks = {name: [dict(id=f"{name}-{l}-{r}", block=name, arm=name[:-1], length=l, rep=r, seed=next(seed),
                          question=next(seed)) for l, n in zip(lengths, reps) for r in range(n)]
              for name in ns.blocks.split(",")}
    regression = dict(id="regression", block="REG", arm="REG", length=ns.regression_len, rep=0, seed=7, question=8,
                      regression=True, max_tokens=16) if ns.regression_len else None
    again = dict(regression, id="regression-again") if regression else None  # A's own pool hit (a hybrid's)
    per_token = pool_bytes_per_token(ns.preset, ns.chunk_tokens, ns.kv_cache_dtype)
    t0 = time.perf_counter()
    with start_pool(ns.pool_size, page_size=ns.page_size, check_integrity=False) as (address, _):
        print(f"pool {ns.pool_size} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        capacity = int(0.9 * PoolClient.connect(address).stats().capacity_bytes)
        for name, jobs in blocks.items():
            print(f"== block {name}", flush=True)
            if name.startswith("OFF"):
                run_replica("B-off", "none", jobs + ([regression] if regression and name == "OFF1" else []), ns)
                continue
            extra = [regression, again] if regression and name == "ON1" else []
            for cycle in cycles(extra + jobs, capacity, per_token):
                with PoolClient.connect(address) as client:
                    client.clear()
                run_replica("A", address, cycle, ns)
                run_replica("B-on", address, [j if j.get("regression") else
                                              dict(j, id=f"{j['id']}-q{q}", question=j["question"] + 1 + q)
                                              for j in cycle for q in range(1 if j.get("regression") else
                                                                            ns.questions)], ns)
                if ns.negative_control and regression and name == "ON1":
                    # B with the hybrid bug: the K/V of the hit loaded, the state not (logits-regression-B-skip.pt)
                    run_replica("B-skip", address, [regression], ns, "--unsafe-skip-state-load")
    summarize(ns.rows, out)


def summarize(rows_path: Path, out: Path) -> None:
    import statistics

    import torch

    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    table = {}
    for row in rows:
        if row.get("regression") or row["ttft_s"] is None:
            continue
        key = (row["length"], "A (first, stores)" if row["role"] == "A" else f"B {row['arm']}")
        table.setdefault(key, []).append(row["ttft_s"])
    summary = {f"{l}|{k}": dict(median=statistics.median(v), min=min(v), max=max(v), n=len(v))
               for (l, k), v in table.items()}
    reg = [r for r in rows if r.get("id") == "regression" and r["role"] in ("B-off", "B-on")]
    if len(reg) == 2:
        a, b = (torch.load(rows_path.with_name(f"logits-regression-{role}.pt")) for role in ("B-off", "B-on"))
        off, on = sorted(reg, key=lambda r: r["role"])  # "B-off" < "B-on"
        agree = sum(x == y for x, y in zip(off["tokens"], on["tokens"]))
        summary["regression"] = dict(first_token_logit_max_abs_diff=float((a - b).abs().max()),
                                     logit_scale=float(a.abs().max()), argmax_equal=bool(a.argmax() == b.argmax()),
                                     greedy_tokens_agree=f"{agree}/{len(off['tokens'])}", pool_hit=on["pool_hit"])
    again = rows_path.with_name("logits-regression-again-A.pt")
    if again.exists() and rows_path.with_name("logits-regression-B-on.pt").exists():
        a_hit, b_hit = torch.load(again), torch.load(rows_path.with_name("logits-regression-B-on.pt"))
        summary["on_equals_a_pool_hit_bitwise"] = bool(torch.equal(a_hit, b_hit))
    skip = rows_path.with_name("logits-regression-B-skip.pt")
    if skip.exists() and rows_path.with_name("logits-regression-B-on.pt").exists():
        # the negative control against B's real hit: how far a missing state moves the first token's logits
        wrong, right = torch.load(skip), torch.load(rows_path.with_name("logits-regression-B-on.pt"))
        summary["negative_control"] = dict(max_abs_diff_vs_on=float((wrong - right).abs().max()),
                                           argmax_equal=bool(wrong.argmax() == right.argmax()),
                                           logit_scale=float(wrong.abs().max()),
                                           finite=bool(torch.isfinite(wrong).all()))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{'length':>8} {'arm':>20} {'median s':>9} {'min':>8} {'max':>8} {'n':>3}")
    for (l, k), v in sorted(table.items()):
        print(f"{l:>8} {k:>20} {statistics.median(v):>9.3f} {min(v):>8.3f} {max(v):>8.3f} {len(v):>3}")
    if "regression" in summary:
        print("regression:", summary["regression"])


STUDY = {131072: (31.715, 0.605), 262144: (92.047, 0.790)}  # the case study's medians (27B model), OFF -> ON


def floor_s(length: int, preset: str, chunk_tokens: int, kv_cache_dtype: str, gbps: float) -> float:
    """The transfer floor of B's hit on a `length`-token document: the bytes of every hit chunk's K/V and (a hybrid)
    one state, at the host->device copy rate measured on the machine (h200_floor.py: 55.2 GB/s on the H200)."""
    import torch

    from kvshare.engine.make_model import PRESETS, hf_config
    from kvshare.hf.config import ModelConfig
    from kvshare.transfer.state import StateLayout

    config = ModelConfig.from_hf(hf_config(PRESETS[preset], 0, 1))
    hit = length // chunk_tokens * chunk_tokens
    kv = hit * config.kv_bytes_per_token("bfloat16") // (2 if kv_cache_dtype == "fp8" else 1)
    state = StateLayout.of_model(config, torch.float32, torch.bfloat16).nbytes if config.linear else 0
    return (kv + state) / (gbps * 1e9)


def report(rows_paths: list[Path], out: Path, floor=None, title: str = "qwen2.5-32b shape") -> None:
    """Merge runs' rows into one table (markdown) and one plot: TTFT by input length, OFF vs ON, log scale;
    `floor(length)` (seconds), if given, is a column of the table and a line of the plot."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for path in rows_paths for line in path.read_text().splitlines()]
    rows = [r for r in rows if not r.get("regression") and r.get("ttft_s") is not None]
    groups: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        arm = {"A": "A (first, stores)", "B-off": "OFF", "B-on": "ON"}[r["role"]]
        groups.setdefault((r["length"], arm), []).append(r["ttft_s"])
    lines = ["| input tokens | arm | n | median TTFT s | min | max | blocks |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (length, arm), values in sorted(groups.items()):
        blocks = ",".join(sorted({r["block"] for r in rows if r["length"] == length and
                                  {"A": "A (first, stores)", "B-off": "OFF", "B-on": "ON"}[r["role"]] == arm}))
        lines.append(f"| {length} | {arm} | {len(values)} | {statistics.median(values):.3f} | {min(values):.3f} | "
                     f"{max(values):.3f} | {blocks} |")
    lines += ["", "| input | ours OFF -> ON (median s) | speedup | transfer floor s | ON minus floor | "
              "study OFF -> ON (27B, 2 GPUs) | study speedup |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for length in sorted({l for l, _ in groups}):
        off, on = groups.get((length, "OFF")), groups.get((length, "ON"))
        if not off or not on:
            continue
        m_off, m_on = statistics.median(off), statistics.median(on)
        study = STUDY.get(length) or STUDY.get(262144 if length > 200000 else -1)
        cell = f"{study[0]:.3f} -> {study[1]:.3f} | {study[0] / study[1]:.0f}x" if study else "- | -"
        floor_cell = f"{floor(length):.3f} | {m_on - floor(length):.3f}" if floor else "- | -"
        lines.append(f"| {length} | {m_off:.3f} -> {m_on:.3f} | {m_off / m_on:.1f}x | {floor_cell} | {cell} |")
    (out / "cross_replica_summary.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, marker in (("OFF", "o"), ("ON", "s"), ("A (first, stores)", "x")):
        xs = sorted(l for l, a in groups if a == arm)
        ax.plot(xs, [statistics.median(groups[(x, arm)]) for x in xs], marker=marker, label=arm)
        for x in xs:
            ax.vlines(x, min(groups[(x, arm)]), max(groups[(x, arm)]), alpha=0.4)
    if floor:
        xs = sorted({l for l, _ in groups})
        ax.plot(xs, [floor(x) for x in xs], linestyle="--", color="grey", label="transfer floor")
    ax.set(xscale="log", yscale="log", xlabel="input tokens", ylabel="TTFT (s), median with min-max",
           title=f"Cross-replica TTFT, {title}, one H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cross_replica_ttft.png", dpi=120)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode")
    run = sub.add_parser("run")
    run.add_argument("--lengths", default="32768,131072")
    run.add_argument("--reps", default="2,2", help="measured requests per block for each length")
    run.add_argument("--preset", default="qwen2.5-32b")
    run.add_argument("--device", default="cuda")
    run.add_argument("--max-model-len", type=int, default=262144)
    run.add_argument("--pool-size", default="100GiB")
    run.add_argument("--page-size", default="2MiB")
    run.add_argument("--regression-len", type=int, default=REGRESSION_LEN)
    run.add_argument("--no-verify-checksums", action="store_true", help="B trusts the pool's bytes (runs 3-4 did)")
    run.add_argument("--chunk-tokens", type=int, default=256, help="pool chunk (a hybrid stores a state per chunk)")
    run.add_argument("--kv-cache-memory", default="", help="the replicas' KV cache size (default: what is free)")
    run.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    run.add_argument("--blocks", default="OFF1,ON1,ON2,OFF2", help="which blocks run, in order (OFFn, ONn)")
    run.add_argument("--questions", type=int, default=1, help="B-on's questions per stored document")
    run.add_argument("--warmup-len", type=int, default=0, help="tokens of each process's unrecorded first request")
    run.add_argument("--negative-control", action="store_true",
                     help="a hybrid's B also loads the regression prompt without the state (the bug of issue 31)")
    run.add_argument("--out", default=os.environ.get("OUT", "out/cross_replica"))
    rep_ = sub.add_parser("report")
    rep_.add_argument("--rows", action="append", type=Path, required=True)
    rep_.add_argument("--out", type=Path, required=True)
    rep_.add_argument("--preset", default="", help="with --chunk-tokens: the transfer floor beside ON")
    rep_.add_argument("--chunk-tokens", type=int, default=256)
    rep_.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    rep_.add_argument("--gbps", type=float, default=55.2, help="host->device copy rate of the floor (GB/s)")
    rep = sub.add_parser("replica")
    for flag in ("--role", "--pool", "--jobs", "--model", "--rows", "--device"):
        rep.add_argument(flag, required=True)
    rep.add_argument("--max-model-len", type=int, required=True)
    rep.add_argument("--chunk-tokens", type=int, required=True)
    rep.add_argument("--kv-cache-memory", default="")
    rep.add_argument("--kv-cache-dtype", default="auto")
    rep.add_argument("--no-verify-checksums", action="store_true")
    rep.add_argument("--warmup-len", type=int, default=0)
    rep.add_argument("--unsafe-skip-state-load", action="store_true")
    ns = parser.parse_args()
    if ns.mode == "report":
        floor = (lambda length: floor_s(length, ns.preset, ns.chunk_tokens, ns.kv_cache_dtype, ns.gbps)) \
            if ns.preset else None
        return report(ns.rows, ns.out, floor, f"{ns.preset or 'qwen2.5-32b'} shape")
    replica(ns) if ns.mode == "replica" else orchestrate(ns)


if __name__ == "__main__":
    main()
