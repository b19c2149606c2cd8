"""`kvshare bench l2-decision`: the connector's L2 decision on a mix of prompt lengths. Two "hosts" share one
Redis: replica A with pool A stores each document (written behind to L2); on the other host, pool D serves replica D
(--l2-promotion decide) and pool W replica W (--l2-promotion always: the decision off), both reaching Redis through a
link of --l2-rate bytes a second (a throttled loopback proxy, kvshare.pool.l2.testing.throttled); replica R has no
pool (recompute). Every document is fresh; after A has served it and its chunks are in L2, R, D and W each get it
(the order rotating), one request at a time, and their time to first token is measured at the client.

Warm-up, not measured: D, W and R prefill a few fresh prompts (D's decision learns this replica's prefill curve from
them), then one document from L2 (D has no L2 rate yet, so it promotes, and its pool measures the rate).
Shown: per length, each arm's median TTFT, D's decisions, and D / R and W / R. With the decision on, no length should
be slower than recompute by more than the model's error; with it off, the lengths where L2 is slower than recompute
are.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np

from kvshare.bench.client import completion_body, model_info, new_http_client, stream
from kvshare.bench.pool import machine
from kvshare.pool.client import PoolClient
from kvshare.pool.l2.testing import REDIS_MISSING, redis_available, start_redis, throttled
from kvshare.pool.testing import start_pool
from kvshare.processes import ServerProcess, free_port, kvshare_argv

ARMS = ("recompute", "decide", "always")
DECISIONS = ("chosen", "declined", "unmeasured")
WARM_LENGTHS = (256, 1024, 2048, 3072)
STATS_WAIT_S = 5.5  # the decision reads the pool's L2 rate at most every 5 s (kvshare.connector.promotion)
TOKEN_IDS = (100, 1000)


@dataclass(frozen=True)
class DecisionBenchConfig:
    model_dir: Path
    lengths: tuple[int, ...]
    reps: int
    l2_rate: float  # bytes per second of D's and W's link to L2
    out_dir: Path
    command: str
    threads: int = 1
    chunk_tokens: int = 256
    promote_timeout: float = 4.0  # pools D and W wait this long for a promotion (below the connector's 5 s)
    seed: int = 0


class Row(msgspec.Struct):
    rep: int
    tokens: int
    arm: str
    ttft_s: float
    pool_hit_tokens: int
    decision: str  # D's decision for this request ("chosen", "declined", "unmeasured"), "" for R and W


class LengthSummary(msgspec.Struct):
    tokens: int
    median_s: dict[str, float]  # arm -> median TTFT
    decisions: dict[str, int]  # D's decisions at this length
    decide_vs_recompute: float  # median D / median R
    always_vs_recompute: float


class DecisionBenchResult(msgspec.Struct):
    command: str
    machine: str
    l2_rate_mb_s: float
    reps: int
    promote_timeout_s: float
    promote_mb_s: float  # pool W's promotions as its STATS report them (l2_promoted_bytes / l2_promote_seconds)
    load_gb_s: float  # replica W's loads from its pool (its /metrics)
    summary: list[LengthSummary]
    rows: list[Row]


class _Replica:
    def __init__(self, name: str, process: ServerProcess) -> None:
        self.name, self.process = name, process

    @property
    def url(self) -> str:
        return self.process.url


def _replica(stack: contextlib.ExitStack, name: str, config: DecisionBenchConfig, *extra: str) -> _Replica:
    port = free_port()
    argv = kvshare_argv("serve", "--model", str(config.model_dir), "--port", str(port), "--threads",
                        str(config.threads), "--chunk-tokens", str(config.chunk_tokens), *extra)
    return _Replica(name, stack.enter_context(ServerProcess(argv, port, name)))


def _metrics(http: httpx.Client, url: str, names: dict[str, str]) -> dict[str, float]:
    """{short name: value} of the replica's counters named by `names` (metric name -> short name); 0 if absent."""
    values = dict.fromkeys(names.values(), 0.0)
    for line in http.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[names[name]] = float(value)
    return values


def _counters(http: httpx.Client, url: str) -> dict[str, float]:
    return _metrics(http, url, {f"kvshare_pool_l2_promote_{d}_total": d for d in DECISIONS})


def _rates(http: httpx.Client, pool_w: str, w: _Replica) -> tuple[float, float]:
    """(pool W's promote MB/s, replica W's load GB/s) over the whole run."""
    with PoolClient.connect(pool_w, map_arena=False) as client:
        stats = client.stats()
    load = _metrics(http, w.url, {"kvshare_pool_load_bytes_total": "bytes", "kvshare_pool_load_seconds_total": "s"})
    promote = stats.l2_promoted_bytes / stats.l2_promote_seconds / 1e6 if stats.l2_promote_seconds else 0.0
    return promote, load["bytes"] / load["s"] / 1e9 if load["s"] else 0.0


def _wait_written(address: str, before: int, chunks: int, timeout: float = 120.0) -> int:
    """Until pool A has written `chunks` more chunks behind to L2; returns its new count."""
    deadline = time.monotonic() + timeout
    with PoolClient.connect(address, map_arena=False) as client:
        while True:
            written = client.stats().l2_writes
            if written >= before + chunks:
                return written
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench l2-decision: pool A wrote {written - before} of {chunks} chunks to L2")
            time.sleep(0.02)


class _Run:
    def __init__(self, config: DecisionBenchConfig, http: httpx.Client, model: str, a: _Replica, pool_a: str,
                 arms: dict[str, _Replica]) -> None:
        self.config, self.http, self.model, self.a, self.pool_a, self.arms = config, http, model, a, pool_a, arms
        self.rng = np.random.default_rng(config.seed)
        self.written = 0
        # D's decision counters as last read. Read only after a request, never just before one: a /metrics scrape
        # right before a request on the same connection added ~30 ms to its TTFT on the build machine.
        self.counts: dict[str, float] = {}

    def fresh(self, n: int) -> list[int]:
        return self.rng.integers(*TOKEN_IDS, n).tolist()

    def ask(self, replica: _Replica, ids: list[int]):
        result = stream(self.http, replica.url, "/v1/completions", completion_body(self.model, ids, 1))
        if result.ttft_s is None:
            raise RuntimeError(f"bench l2-decision: {replica.name} streamed no token")
        return result

    def in_l2(self, ids: list[int]) -> None:
        """A serves ids (and stores them); wait until its pool has written the full chunks behind to L2."""
        self.ask(self.a, ids)
        self.written = _wait_written(self.pool_a, self.written, len(ids) // self.config.chunk_tokens)

    def warm_up(self) -> None:
        for n in WARM_LENGTHS:
            for replica in self.arms.values():
                self.ask(replica, self.fresh(n))
        ids = self.fresh(max(self.config.lengths))
        self.in_l2(ids)
        for replica in self.arms.values():
            self.ask(replica, ids)
        self.counts = _counters(self.http, self.arms["decide"].url)
        time.sleep(STATS_WAIT_S)

    def measure(self) -> list[Row]:
        rows, order = [], list(ARMS)
        for rep in range(self.config.reps):
            for n in self.rng.permutation(self.config.lengths).tolist():
                ids = self.fresh(n)
                self.in_l2(ids)
                order = order[1:] + order[:1]  # rotate: no arm always goes first
                for arm in order:
                    rows.append(self._one(rep, n, arm, ids))
                print(f"rep {rep} {n:>6} tokens: " + ", ".join(
                    f"{r.arm} {r.ttft_s:.3f} s{' (' + r.decision + ')' if r.decision else ''}"
                    for r in rows[-len(ARMS):]), flush=True)
        return rows

    def _one(self, rep: int, n: int, arm: str, ids: list[int]) -> Row:
        replica = self.arms[arm]
        result = self.ask(replica, ids)
        decision = ""
        if arm == "decide":
            before, self.counts = self.counts, _counters(self.http, replica.url)
            decision = next((d for d in DECISIONS if self.counts[d] > before[d]), "")
        return Row(rep, n, arm, result.ttft_s, result.pool_hit_tokens, decision)


def summarize(rows: list[Row], lengths: tuple[int, ...]) -> list[LengthSummary]:
    out = []
    for n in sorted(lengths):
        medians = {arm: statistics.median(r.ttft_s for r in rows if r.tokens == n and r.arm == arm) for arm in ARMS}
        decisions = {d: sum(r.decision == d for r in rows if r.tokens == n) for d in DECISIONS}
        out.append(LengthSummary(n, medians, decisions, medians["decide"] / medians["recompute"],
                                 medians["always"] / medians["recompute"]))
    return out


def run_bench(config: DecisionBenchConfig) -> int:
    if not redis_available():
        print(f"kvshare bench l2-decision: {REDIS_MISSING}")
        return 1
    config.out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(page_size="1MiB", check_integrity=False, max_leased_pages_per_client=0)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_redis())
        slow_port = stack.enter_context(throttled(server.port, config.l2_rate))
        direct, slow = f"redis://127.0.0.1:{server.port}", f"redis://127.0.0.1:{slow_port}"
        pool_a, _ = stack.enter_context(start_pool("256MiB", l2=direct, **common))
        far = dict(l2=slow, l2_promote_timeout=config.promote_timeout, l2_timeout=30, **common)
        pool_d, _ = stack.enter_context(start_pool("256MiB", **far))
        pool_w, _ = stack.enter_context(start_pool("256MiB", **far))
        a = _replica(stack, "A", config, "--pool", pool_a)
        arms = {"recompute": _replica(stack, "R", config),
                "decide": _replica(stack, "D", config, "--pool", pool_d, "--l2-promotion", "decide"),
                "always": _replica(stack, "W", config, "--pool", pool_w, "--l2-promotion", "always")}
        http = stack.enter_context(new_http_client())
        run = _Run(config, http, model_info(http, a.url).name, a, pool_a, arms)
        run.warm_up()
        rows = run.measure()
        promote_mb_s, load_gb_s = _rates(http, pool_w, arms["always"])
    result = DecisionBenchResult(config.command, machine(), config.l2_rate / 1e6, config.reps,
                                 config.promote_timeout, promote_mb_s, load_gb_s, summarize(rows, config.lengths),
                                 rows)
    (config.out_dir / "l2-decision.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    text = markdown(result)
    (config.out_dir / "l2-decision.md").write_text(text)
    plot(result, config.out_dir / "l2-decision.png")
    print(text)
    return 0


def markdown(r: DecisionBenchResult) -> str:
    lines = [
        "# The L2 decision on a mix of prompt lengths", "",
        f"Command: `{r.command}`  ", f"Machine: {r.machine}  ",
        f"Link to L2: {r.l2_rate_mb_s:g} MB/s (throttled loopback proxy); promote timeout {r.promote_timeout_s:g} s; "
        f"{r.reps} fresh documents per length, mixed order; median time to first token at the client. Measured "
        f"over the run: pool W promoted at {r.promote_mb_s:.2f} MB/s (its STATS), replica W loaded from its pool at "
        f"{r.load_gb_s:.2f} GB/s (its /metrics).", "",
        "| prompt tokens | recompute (R) s | decide (D) s | always (W) s | D / R | W / R | D's decisions |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in r.summary:
        decisions = ", ".join(f"{d} {k}" for d, k in s.decisions.items() if k) or "-"
        lines.append(f"| {s.tokens} | {s.median_s['recompute']:.3f} | {s.median_s['decide']:.3f} | "
                     f"{s.median_s['always']:.3f} | {s.decide_vs_recompute:.2f} | {s.always_vs_recompute:.2f} | "
                     f"{decisions} |")
    worst_d = max(r.summary, key=lambda s: s.decide_vs_recompute)
    worst_w = max(r.summary, key=lambda s: s.always_vs_recompute)
    lines += [
        "", f"- decision on: the slowest length against recompute is {worst_d.tokens} tokens at "
        f"{worst_d.decide_vs_recompute:.2f}x.",
        f"- decision off: the slowest length against recompute is {worst_w.tokens} tokens at "
        f"{worst_w.always_vs_recompute:.2f}x; slower than recompute by more than 10% at "
        + (", ".join(str(s.tokens) for s in r.summary if s.always_vs_recompute > 1.1) or "no length") + " tokens.",
        "", "![l2-decision.png](l2-decision.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(r: DecisionBenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [s.tokens for s in r.summary]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, marker in zip(ARMS, "os^"):
        ax.plot(tokens, [s.median_s[arm] for s in r.summary], marker + "-", label=arm)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s (median)")
    ax.set_title(f"L2 decision on vs off, link {r.l2_rate_mb_s:g} MB/s")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

