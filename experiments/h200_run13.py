"""Issue 19, run 13 on one H200: why a replica attached to a 100 GiB pool waits for the arena's whole DMA registration
(run 12: +33 s), and a pool restarted twice under an attached CUDA connector. Driven by `experiments/h200.py run13`.

    PYTHONPATH=/tmp/site:.:experiments python3 experiments/h200_run13.py run --out $OUT --budget 470

Parts, each a child process with its own deadline (whatever is left of --budget), rows written as they are measured:
- startup (100 GiB pool, then 32 GiB where time allows), one fresh process per row: cudaHostRegister through torch's
  binding, then through ctypes on torch's libcudart (KVSHARE_REGISTER_VIA, kvshare.transfer.hostmem), then ctypes
  with lazy registration (register_ahead off). Each: time to an engine without a pool (CUDA's start, not counted),
  then to an engine with its connector attached ("ready", split into the engine, the attach and a synchronize);
  while the background registration runs, the main thread times small calls over and over (pure Python: the GIL; a
  64 MiB numpy buffer: the process's mm lock; synchronize, a small H2D copy, a small kernel, a fresh cudaMalloc, a
  new stream: the driver), then the same calls once it is over; the time until every piece is registered; then two
  requests of 512 tokens (the first stores into the arena: with lazy registration it registers that piece itself).
- restart (16 GiB pool, 4 GiB pieces): one process holds a ConnectorCore over CUDA KV tensors; three pool lives on one
  socket, the first two killed (SIGKILL): in each life a store and a load of 4 chunks, byte-compared with the source
  blocks; after each life the mappings of every arena file in /proc/self/maps, VmRSS, RssShmem, VmPin, the host's
  Shmem and Mlocked, and the process's registrations.
- tail-profile: HOOK for the lead, not built here (see tail_profile below).
Output: startup.jsonl, restart.jsonl, summary.md; the log is the wrapper's.

A dry run on a CPU (no registration; the CPU probes still run; small pools) checks the plumbing:
    python experiments/h200_run13.py run --dry --out /tmp/run13 --budget 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

from h200_run12 import Clock, run_child

GIB = 1 << 30


def emit(path: str, **fields) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(fields) + "\n")
    print(f"  {Path(path).stem}", json.dumps(fields), flush=True)


def host_memory() -> dict:
    """This process's resident and pinned memory, and the host's shared and locked memory (GiB)."""
    wanted = {"VmRSS", "RssShmem", "VmPin", "VmLck", "Shmem", "Mlocked", "MemAvailable"}
    found = {}
    for name in ("/proc/self/status", "/proc/meminfo"):
        for line in Path(name).read_text().splitlines():
            key, _, value = line.partition(":")
            if key in wanted and value.strip().endswith("kB"):
                found[key] = round(int(value.split()[0]) / 2**20, 2)
    return found


def mappings(path: str) -> int:
    """How many mappings of `path` this process holds (a removed file shows as 'path (deleted)')."""
    return sum(path in line for line in Path("/proc/self/maps").read_text().splitlines())


# ---- startup -----------------------------------------------------------------------------------------------------
def probe_calls(cuda: bool) -> dict[str, Callable[[], None]]:
    """Small main-thread calls, each needing one thing a registration might hold: the GIL, the mm lock, the driver."""
    import numpy as np
    import torch

    calls = {"python 100k loop": lambda: sum(range(100_000)),
             "numpy 64 MiB alloc+touch": lambda: np.ones(64 << 20, dtype=np.uint8).sum()}
    if not cuda:
        return calls
    small = torch.ones(1 << 20, device="cuda")
    host = torch.ones(1 << 20)

    def pageable_copy():
        small.copy_(host)
        torch.cuda.synchronize()

    def fresh_malloc():
        torch.cuda.empty_cache()  # so the next allocation is a cudaMalloc, not the caching allocator's
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

    calls.update({"cuda synchronize": torch.cuda.synchronize,
                  "4 MiB pageable H2D copy": pageable_copy,
                  "small kernel + item": lambda: (small * 2).sum().item(),
                  "cudaMalloc 64 MiB": fresh_malloc,
                  "new stream": lambda: torch.cuda.Stream()})
    return calls


def probe_while(running: Callable[[], bool], calls: dict[str, Callable[[], None]], deadline: float) -> dict:
    """Time each call in turn, round after round, while `running()` (and before `deadline`): per call the number of
    rounds, the median and the longest time in ms."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    while time.monotonic() < deadline:
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e3)
        if not running():
            break
        time.sleep(0.005)
    return {name: dict(n=len(t), median_ms=round(statistics.median(t), 2), max_ms=round(max(t), 2))
            for name, t in times.items() if t}


def timed_request(engine, rid: str, length: int, seed: int) -> float:
    """Seconds for one request of `length` tokens (one generated) and its stores' commit."""
    import random

    from kvshare.engine.api import GenerationRequest, SamplingParams
    from kvshare.engine.engine import generate

    tokens = tuple(random.Random(seed).randrange(3, 1000) for _ in range(length))
    t0 = time.perf_counter()
    (result,) = generate(engine, [GenerationRequest(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))],
                         timeout=300)
    if engine.connector is not None:
        engine.connector.core.flush(300)
    assert result.finished is not None and result.finished.finish_reason != "error", result.finished
    return time.perf_counter() - t0


def startup(args) -> None:
    import torch

    from kvshare.connector import ConnectorConfig
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.pool_connector import PoolConnector
    from kvshare.transfer import hostmem

    cuda = args.device == "cuda"
    deadline = time.monotonic() + args.seconds
    arm = f"{args.pool_size}/{hostmem.REGISTER_VIA}/{'lazy' if args.lazy else 'ahead'}"  # one process's rows
    common = dict(arm=arm, pool=args.pool_size, via=hostmem.register_via() if cuda else "none (cpu)",
                  lazy=args.lazy, cudart=hostmem.find_cudart())

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def new_engine():
        return Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype="bfloat16",
                                   max_model_len=4096, num_blocks=256))

    t0 = time.perf_counter()
    warm = new_engine()  # pays CUDA's start, so "ready" below is the engine and the attach only
    sync()
    emit(args.rows, what="no pool (first CUDA start)", ready_s=time.perf_counter() - t0, **common)
    warm.shutdown()
    t0 = time.perf_counter()
    engine = new_engine()
    t1 = time.perf_counter()
    config = ConnectorConfig(address=args.pool, timeout=60.0, register_ahead=not args.lazy)
    engine.set_connector(PoolConnector.for_engine(engine, config))
    t2 = time.perf_counter()
    sync()
    t3 = time.perf_counter()
    transfer = engine.connector.core._attached.transfer  # a diagnostic may look inside; the code never does
    reg = transfer.registration if cuda else None  # CPU transfers register nothing
    pieces = reg.pieces.count if reg else 0
    emit(args.rows, what="attached", ready_s=t3 - t0, engine_s=t1 - t0, attach_s=t2 - t1, sync_s=t3 - t2,
         registered_at_ready=reg.registered() if reg else None, pieces=pieces, **common)
    calls = probe_calls(cuda)
    if args.lazy or reg is None:
        running = (lambda end: lambda: time.monotonic() < end)(time.monotonic() + 1.0)  # dry: exercise the loop
    else:
        running = lambda: reg.registered() < pieces  # noqa: E731
    during = probe_while(running, calls, deadline - 60)
    if reg is not None and not args.lazy:
        reg.wait_all()
    done = time.perf_counter()
    gib = transfer.pages.numel() / GIB
    emit(args.rows, what="registration over", since_ready_s=done - t3, since_start_s=done - t0,
         s_per_gib=(done - t0) / gib, registered=reg.registered() if reg else None, probes_during=during,
         probes_after=probe_while(lambda: False, calls, time.monotonic() + 5), **common)
    seed = zlib.crc32(arm.encode())  # prompts no earlier process stored: the first request stores, never loads
    first = timed_request(engine, "first", 512, seed=seed)
    registered = reg.registered() if reg else None
    second = timed_request(engine, "second", 512, seed=seed + 1)
    emit(args.rows, what="requests", first_s=first, second_s=second, registered_after_first=registered,
         stores=engine.connector.stats.stores, **common)
    engine.connector.close()
    engine.shutdown()


# ---- restart -----------------------------------------------------------------------------------------------------
def restart(args) -> None:
    import torch

    from kvshare.connector import ConnectorConfig
    from kvshare.connector.core import ConnectorCore
    from kvshare.keys import Namespace
    from kvshare.pool.testing import start_pool
    from kvshare.transfer import KVLayout
    from kvshare.units import parse_size

    cuda = args.device == "cuda"
    layout = KVLayout(4, 512, 16, 8, 128, torch.bfloat16)  # 64 KiB a block and layer; a 256-token chunk is 4 MiB
    kv = [torch.empty(layout.tensor_shape, dtype=layout.dtype, device=args.device) for _ in range(layout.num_layers)]
    for layer in kv:
        layer.view(torch.uint8).random_(0, 256)
    tmp = Path(tempfile.mkdtemp(prefix="run13-restart-"))
    socket_path = str(tmp / "pool.sock")
    config = ConnectorConfig(address=socket_path, timeout=30.0, retry_interval=0.5,
                             register_piece=parse_size(args.piece))
    core = ConnectorCore(config, Namespace("run13-restart", "bfloat16", layout.layout_id(), 256), block_tokens=16)
    core.attach(layout, kv)  # no pool yet: the first connection comes with the first life
    arenas: list[str] = []
    old_prompt = None
    for life in range(args.lives):
        arena = f"/dev/shm/kvshare-run13-{os.getpid()}-{life}.arena"
        arenas.append(arena)
        t0 = time.perf_counter()
        with start_pool(args.size, page_size="2MiB", socket=socket_path, arena=arena, check_integrity=False,
                        timeout=120) as (_, process):
            prepared = time.perf_counter() - t0
            attached = wait_attached(core, arena)
            t1 = time.perf_counter()
            if cuda:  # a diagnostic may look inside; the code never does. No reference kept: it holds the mapping
                core._attached.transfer.registration.wait_all()
            registered_s = time.perf_counter() - t1
            exact, hit_tokens = store_and_load(core, kv, layout, seed=life, cuda=cuda)
            stale = core.find(old_prompt, 0) if old_prompt else None
            old_prompt = prompt(seed=life)
            emit(args.rows, what="life up", life=life, pool_prepared_s=prepared, attached=attached,
                 registration_s=registered_s, loaded_tokens=hit_tokens, byte_exact=exact,
                 earlier_life_hit=stale is not None, maps={Path(a).name: mappings(a) for a in arenas},
                 pinned=pinned_pieces(), **host_memory())
            if life == args.lives - 1:
                break
            process.send_signal(signal.SIGKILL)
            process.wait()
        t2 = time.perf_counter()
        core.find(old_prompt, 0)  # the next request finds the pool gone: the life is retired, unregistered, unmapped
        emit(args.rows, what="life killed", life=life, retire_s=time.perf_counter() - t2,
             maps={Path(a).name: mappings(a) for a in arenas}, pinned=pinned_pieces(),
             **host_memory())
    core.close()
    emit(args.rows, what="closed", maps={Path(a).name: mappings(a) for a in arenas},
         pinned=pinned_pieces(), stats=core.stats.values(), **host_memory())


def pinned_pieces() -> list[int]:
    """Registered pieces of each arena view this process still holds a registration of (kvshare.transfer.hostmem)."""
    from kvshare.transfer import hostmem

    return [found.registered() for found in list(hostmem._registrations.values())]


def prompt(seed: int, chunks: int = 4) -> list[int]:
    import random

    return [random.Random(seed).randrange(3, 1000) for _ in range(chunks * 256 + 1)]


def wait_attached(core, arena: str, timeout: float = 30.0) -> float:
    """Seconds until the core's connection is to the life whose arena is `arena` (it reconnects on its next call)."""
    t0 = time.perf_counter()
    while arena not in core._attached.instance:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the connector did not reconnect to {arena} within {timeout} s")
        core.find(prompt(seed=-1), 0)
        time.sleep(0.1)
    return time.perf_counter() - t0


def store_and_load(core, kv, layout, seed: int, cuda: bool) -> tuple[bool, int]:
    """Store a prompt's 4 chunks from blocks [0, 64), load them into [256, 320), compare the bytes; (exact, tokens)."""
    import torch

    tokens = prompt(seed)
    source, target = list(range(64)), list(range(256, 320))
    for layer in kv:
        layer[256:320].zero_()
    handle = core.store(tokens, source, 0)
    if handle is None:
        return False, 0
    core.flush(120)
    hit = core.find(tokens, 0)
    if hit is None or not core.load(hit, target, 0):
        return False, 0
    if cuda:
        torch.cuda.synchronize()
    blocks = hit.end // layout.block_size
    exact = all(torch.equal(layer[:blocks].view(torch.uint8), layer[256 : 256 + blocks].view(torch.uint8))
                for layer in kv)
    return exact and blocks == 64, hit.end


# ---- tail-profile: HOOK for the lead -----------------------------------------------------------------------------
def tail_profile(args) -> None:
    """HOOK (issue 19, the fp8 B tail): not built here; the lead fills this in or runs a separate script."""
    raise SystemExit("tail-profile is not built in h200_run13.py")


# ---- orchestrator ------------------------------------------------------------------------------------------------
def spawn(mode: str, ns, clock: Clock, need: float, env: dict | None = None, **flags) -> bool:
    """Run a child part if at least `need` seconds are left; False if skipped, cut or failed (noted in the log)."""
    if clock.left() < need:
        print(f"== skip {mode} {flags}: {clock.left():.0f} s left, needs ~{need:.0f}", flush=True)
        return False
    command = [sys.executable, __file__, mode, "--device", ns.device, "--seconds", str(int(clock.left()))]
    for key, value in flags.items():
        command += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    print(f"== {mode} {' '.join(command[3:])} {env or ''}", flush=True)
    return run_child(mode, command, clock, env)


def startups(ns, clock: Clock, size: str, rows: Path, model: str, arms: list[tuple[str, bool]], need: float) -> None:
    from kvshare.pool.testing import start_pool

    if clock.left() < need + 30:
        print(f"== skip the {size} pool: {clock.left():.0f} s left", flush=True)
        return
    t0 = time.perf_counter()
    with start_pool(size, page_size="2MiB", check_integrity=False, timeout=min(180, clock.left())) as (address, _):
        emit(str(rows), pool=size, what="pool ready (arena prepared)", ready_s=time.perf_counter() - t0)
        for via, lazy in arms:
            flags = dict(pool=address, rows=rows, model=model, pool_size=size) | ({"lazy": True} if lazy else {})
            spawn("startup", ns, clock, need, env={"KVSHARE_REGISTER_VIA": via}, **flags)


def orchestrate(ns) -> None:
    from kvshare.engine.make_model import make_model

    if ns.dry:
        ns.device, ns.pools, ns.restart_pool, ns.piece = "cpu", "96MiB,64MiB", "64MiB", "16MiB"
    clock = Clock(ns.budget)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(make_model("tiny", Path(tempfile.mkdtemp()) / "tiny"))
    large, *small = ns.pools.split(",")
    arms = [("torch", False), ("ctypes", False), ("ctypes", True)]
    startups(ns, clock, large, out / "startup.jsonl", model, arms, need=45)
    spawn("restart", ns, clock, 45, rows=out / "restart.jsonl", size=ns.restart_pool, piece=ns.piece, lives=3)
    for size in small:  # where time allows
        startups(ns, clock, size, out / "startup.jsonl", model, arms[:2], need=25)
    summarize(out)


def summarize(out: Path) -> None:
    def rows(name: str) -> list[dict]:
        path = out / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    nan = float("nan")
    lines = ["| pool | via | lazy | ready s | engine / attach / sync s | registered at ready | all registered s "
             "(since start) | slowest main-thread call during, ms (same call after) | first / second request s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    startup_rows = rows("startup.jsonl")
    for ready in (r for r in startup_rows if r["what"] == "attached"):
        mine = [r for r in startup_rows if r.get("arm") == ready["arm"]]
        over = next((r for r in mine if r["what"] == "registration over"), {})
        req = next((r for r in mine if r["what"] == "requests"), {})
        during, after = over.get("probes_during", {}), over.get("probes_after", {})
        worst = max(during, key=lambda name: during[name]["max_ms"], default=None)
        slowest = f"{worst} {during[worst]['max_ms']} ({after.get(worst, {}).get('max_ms')})" if worst else "-"
        lines.append(f"| {ready['pool']} | {ready['via']} | {ready['lazy']} | {ready['ready_s']:.2f} | "
                     f"{ready['engine_s']:.2f} / {ready['attach_s']:.2f} / {ready['sync_s']:.2f} | "
                     f"{ready['registered_at_ready']} of {ready['pieces']} | {over.get('since_start_s', nan):.1f} | "
                     f"{slowest} | {req.get('first_s', nan):.2f} / {req.get('second_s', nan):.2f} |")
    lines += ["", "| restart row | life | byte exact | maps per arena | pinned pieces per view | VmRSS | RssShmem "
              "| Shmem, host "
              "| Mlocked |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows("restart.jsonl"):
        lines.append(f"| {r['what']} | {r.get('life', '')} | {r.get('byte_exact', '')} | {r.get('maps')} | "
                     f"{r.get('pinned')} | {r.get('VmRSS')} | {r.get('RssShmem')} | {r.get('Shmem')} | "
                     f"{r.get('Mlocked')} |")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--pools", default="100GiB,32GiB", help="start-up with each; the first fully, later ones if time")
    run.add_argument("--restart-pool", default="16GiB")
    run.add_argument("--piece", default="4GiB", help="registration piece of the restart part")
    run.add_argument("--device", default="cuda")
    run.add_argument("--dry", action="store_true", help="CPU, small pools: the plumbing only")
    run.add_argument("--budget", type=float, default=470.0, help="seconds for the whole run; parts get what is left")
    run.add_argument("--out", default=os.environ.get("OUT", "out/run13"))
    sub.add_parser("summary").add_argument("--out", type=Path, required=True)
    child = sub.add_parser("startup")
    for flag in ("--pool", "--rows", "--model", "--pool-size"):
        child.add_argument(flag, required=True)
    child.add_argument("--lazy", action="store_true", help="register only the pieces a transfer touches")
    again = sub.add_parser("restart")
    for flag in ("--rows", "--size", "--piece"):
        again.add_argument(flag, required=True)
    again.add_argument("--lives", type=int, default=3)
    for part in (child, again):
        part.add_argument("--device", default="cuda")
        part.add_argument("--seconds", type=float, default=300.0, help="this part's deadline")
    sub.add_parser("tail-profile")
    ns = parser.parse_args()
    {"run": orchestrate, "startup": startup, "restart": restart, "tail-profile": tail_profile,
     "summary": lambda a: summarize(a.out)}[ns.mode](ns)


if __name__ == "__main__":
    main()
