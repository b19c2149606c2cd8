"""`kvshare validate soak`: a bounded end-to-end run under injected faults (pool, two replicas, router, tiny model on
CPU) that checks every completed answer against a cache-OFF reference and ends with a leak check of the pool.

Pass criteria (SoakResult.passed): no mismatch, no failed request except those in flight on a killed replica, every
stalled writer's late COMMIT refused and every stalled reader's pages unchanged (I10), and after a quiet period past
the lease timeout no leased, reserved or quarantined page in the pool and its integrity check passing.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from kvshare.processes import kvshare_argv
from kvshare.validate.deployment import DeployConfig, SoakDeployment
from kvshare.validate.faults import KINDS, Fault, Injector
from kvshare.validate.workload import Outcome, Prompts, Reference, send, shared_prefixes

MAX_REPORTED = 10


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 10.0
    fault_period_s: float = 15.0
    workers: int = 2  # concurrent clients (the build machine has 2 cores)
    seed: int = 0
    model_dir: str = ""  # "" -> a generated tiny model
    pool_size: str = "8MiB"
    lease_timeout_s: float = 4.0
    log_dir: str = ""  # "" -> a temp dir, removed afterwards


class Mismatch(msgspec.Struct):
    prompt_tokens: int
    max_tokens: int
    stream: bool
    got: str
    want: str


class SoakResult(msgspec.Struct):
    minutes: float
    requests_sent: int
    requests_served: int
    streamed_served: int
    pool_hit_tokens: int  # summed over served answers: proves the cache was in use, not bypassed
    requests_with_pool_hits: int
    mismatches: int
    requests_lost: int  # failed while in flight on a killed replica (workload + the injector's own streams)
    request_errors: int  # failed outside any replica kill: must be 0
    faults: dict[str, int]
    fault_log: list[dict]
    leaked_pages: int  # reserved and quarantined pages after the quiet period
    leaked_leases: int  # read + write leases (fenced ones included) after the quiet period
    fence_violations: int  # stalled writers whose late COMMIT was accepted, stalled readers whose pages changed
    leased_pages_by_client: dict[int, int]
    integrity_ok: bool
    final_pool: dict  # the last pool life's stats (hits prove the replicas reconnected)
    mismatch_examples: list[Mismatch]
    error_examples: list[str]

    @property
    def passed(self) -> bool:
        return (self.mismatches == 0 and self.request_errors == 0 and self.leaked_pages == 0
                and self.leaked_leases == 0 and self.fence_violations == 0 and self.integrity_ok
                and self.requests_served > 0)


class _Tally:
    """Outcomes from all workers; the lock guards the lists (workers append concurrently)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.mismatches: list[Mismatch] = []

    def add(self, outcome: Outcome, want: str | None) -> None:
        with self.lock:
            self.outcomes.append(outcome)
            if want is not None and outcome.text != want:
                r = outcome.request
                self.mismatches.append(Mismatch(len(r.ids), r.max_tokens, r.stream, outcome.text, want))


def run_soak(config: SoakConfig) -> SoakResult:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the report
    with tempfile.TemporaryDirectory(prefix="kvshare-soak-run-") as tmp:
        model_dir = Path(config.model_dir) if config.model_dir else _tiny_model(Path(tmp))
        log_dir = Path(config.log_dir) if config.log_dir else Path(tmp) / "logs"
        deploy = DeployConfig(model_dir, log_dir, pool_size=config.pool_size, lease_timeout_s=config.lease_timeout_s)
        with SoakDeployment(deploy) as d:
            d.start()
            return _soak(config, d, model_dir)


def _soak(config: SoakConfig, d: SoakDeployment, model_dir: Path) -> SoakResult:
    from kvshare.hf.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    tally, crashed = _Tally(), []
    injector = Injector(d, config.fault_period_s)
    shared = shared_prefixes(config.seed)
    deadline = time.monotonic() + config.minutes * 60
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0), trust_env=False) as http:
        reference = Reference(d.url("ref"), http)
        workers = [threading.Thread(target=_work, args=(Prompts(config.seed * 1000 + i, shared, tokenizer.encode),
                                                        d.url("router"), http, reference, tally, crashed, deadline))
                   for i in range(config.workers)]
        injector.start()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        injector.join()
    if crashed:  # e.g. the reference replica failed: the answers were not all checked, so the soak cannot pass
        raise RuntimeError(f"{len(crashed)} soak worker(s) stopped early; the first: {crashed[0]!r}") from crashed[0]
    quiet = config.lease_timeout_s + 3.0  # past the lease timeout: anything still leased then has leaked
    time.sleep(quiet)
    return _result(config, tally, injector, d)


def _work(prompts: Prompts, base: str, http: httpx.Client, reference: Reference, tally: _Tally,
          crashed: list[BaseException], deadline: float) -> None:
    answer = ""
    try:
        while time.monotonic() < deadline:
            request = prompts.next(answer)
            outcome = send(http, base, request)
            want = reference.answer(request) if outcome.ok else None
            tally.add(outcome, want)
            answer = outcome.text if outcome.ok else ""
    except Exception as error:  # noqa: BLE001 - handed to the main thread, which fails the soak
        crashed.append(error)


def _result(config: SoakConfig, tally: _Tally, injector: Injector, d: SoakDeployment) -> SoakResult:
    from kvshare.pool.client import PoolClient

    with PoolClient.connect(d.pool_socket, map_arena=False) as client:
        integrity = client.health(deep=True)
        stats = client.stats()
    served = [o for o in tally.outcomes if o.ok]
    failed = [o for o in tally.outcomes if not o.ok]
    kills = [f for f in injector.faults if f.kind == "replica_kill"]
    in_kill = [any(o.started <= f.ended and o.ended >= f.started for f in kills) for o in failed]
    lost = [o for o, k in zip(failed, in_kill) if k]
    errors = [o for o, k in zip(failed, in_kill) if not k]
    counts = {kind: sum(f.kind == kind for f in injector.faults) for kind in KINDS}
    return SoakResult(
        minutes=config.minutes, requests_sent=len(tally.outcomes), requests_served=len(served),
        streamed_served=sum(o.request.stream for o in served), pool_hit_tokens=sum(o.pool_hit_tokens for o in served),
        requests_with_pool_hits=sum(o.pool_hit_tokens > 0 for o in served), mismatches=len(tally.mismatches),
        requests_lost=len(lost) + injector.lost_by_injector, request_errors=len(errors), faults=counts,
        fault_log=[_fault_row(f, injector.faults[0].started if injector.faults else 0) for f in injector.faults],
        leaked_pages=stats.pages_reserved + stats.pages_quarantined,
        leaked_leases=stats.read_leases + stats.write_leases,
        fence_violations=injector.fence_violations,
        leased_pages_by_client=stats.leased_pages_by_client, integrity_ok=integrity,
        final_pool=msgspec.to_builtins(stats), mismatch_examples=tally.mismatches[:MAX_REPORTED],
        error_examples=[o.error for o in errors[:MAX_REPORTED]],
    )


def _fault_row(fault: Fault, t0: float) -> dict:
    return {"kind": fault.kind, "at_s": round(fault.started - t0, 1), "took_s": round(fault.ended - fault.started, 1),
            "target": fault.target, "detail": fault.detail}


def _tiny_model(directory: Path) -> Path:
    """`kvshare make-model --preset tiny`, as a process: the soak reaches the engine only through its processes."""
    out = directory / "tiny-model"
    subprocess.run(kvshare_argv("make-model", "--preset", "tiny", "--out", str(out)), check=True,
                   stdout=subprocess.DEVNULL)
    return out


def markdown(result: SoakResult, command: str) -> str:
    """A short human report of a soak result."""
    r = result
    lines = [
        f"# Soak: {r.minutes:g} minutes under faults — {'PASS' if r.passed else 'FAIL'}", "",
        f"Command: `{command}`", "",
        "| what | value |", "| --- | --- |",
        f"| requests sent / served (streamed) | {r.requests_sent} / {r.requests_served} ({r.streamed_served}) |",
        f"| answers with pool hits / pool hit tokens | {r.requests_with_pool_hits} / {r.pool_hit_tokens} |",
        f"| mismatches vs cache-OFF reference (replica A verifies checksums, B does not) | {r.mismatches} |",
        f"| fence violations (stalled writer's late COMMIT accepted, stalled reader's pages changed) | "
        f"{r.fence_violations} |",
        f"| requests lost (in flight on a killed replica) | {r.requests_lost} |",
        f"| request errors (anything else) | {r.request_errors} |",
        f"| faults | {', '.join(f'{k} {v}' for k, v in r.faults.items())} |",
        f"| leaked pages / leases after the quiet period | {r.leaked_pages} / {r.leaked_leases} |",
        f"| pool integrity check (deep health) | {'ok' if r.integrity_ok else 'FAILED'} |",
        f"| last pool life: hit tokens, chunks, evictions, expired leases, lease-limited | "
        f"{r.final_pool.get('hit_tokens')}, {r.final_pool.get('chunks')}, {r.final_pool.get('evictions')}, "
        f"{r.final_pool.get('expired_leases')}, {r.final_pool.get('lease_limited')} |",
        "", "## Faults", "", "| t (s) | kind | target | took (s) | detail |", "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {f['at_s']} | {f['kind']} | {f['target']} | {f['took_s']} | {f['detail']} |" for f in r.fault_log]
    return "\n".join(lines) + "\n"
