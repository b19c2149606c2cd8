"""`kvshare demo`: the whole mechanism at CPU scale in a few minutes — pool, two replicas, router, a short OFF-ON-ON-OFF
cross-replica design and a short session comparison, then the report. Stops everything it started, always."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvshare.bench.client import BenchError
from kvshare.bench.cross_replica import CrossReplicaConfig
from kvshare.bench.deploy import LocalConfig, LocalDeployment
from kvshare.bench.report import drifted, turn_one_ratios
from kvshare.bench.runner import Outcome, Plan, run_plan
from kvshare.bench.sessions import SessionsConfig
from kvshare.bench.workload import parse_lengths


@dataclass(frozen=True)
class DemoConfig:
    """Defaults sized for 2 CPU cores: each replica gets one thread, so the two never compete for a core."""

    model_dir: Path = Path(".models/small")
    out_dir: Path = Path("bench-results/demo")
    preset: str = "small"
    lengths: str = "512,1k"  # a 2k prefill takes ~25 s on one busy core: too slow for a demo
    per_block: int = 2
    contexts: str = "1k"
    turns: int = 6
    user_tokens: int = 128
    answer_tokens: int = 16
    threads: int = 1
    pool_size: str = "1GiB"
    seed: int = 0


def ensure_model(config: DemoConfig) -> None:
    """Generate the model folder with `kvshare make-model` when it is absent (a few seconds)."""
    if (config.model_dir / "config.json").exists():
        return
    print(f"generating the {config.preset} model into {config.model_dir} ...", flush=True)
    argv = [sys.executable, "-m", "kvshare.cli", "make-model",
            "--preset", config.preset, "--out", str(config.model_dir)]
    if subprocess.run(argv).returncode != 0:
        raise BenchError(f"`kvshare make-model --preset {config.preset}` failed; see its output above")


def run_demo(config: DemoConfig, command: str) -> Outcome:
    ensure_model(config)
    from kvshare.hf.tokenizer import Tokenizer

    codec = Tokenizer.from_dir(config.model_dir)
    plan = Plan(
        title="kvshare demo: shared KV pool at CPU scale",
        out_dir=config.out_dir,
        cross=CrossReplicaConfig(lengths=tuple(parse_lengths(config.lengths)), per_block=config.per_block,
                                 seed=config.seed),
        sessions=SessionsConfig(contexts=tuple(parse_lengths(config.contexts)), turns=config.turns,
                                user_tokens=config.user_tokens, answer_tokens=config.answer_tokens, seed=config.seed),
    )
    local = LocalConfig(model_dir=config.model_dir, log_dir=config.out_dir / "logs", threads=config.threads,
                        pool_size=config.pool_size)
    outcome = run_plan(plan, lambda: LocalDeployment(local), codec, command)
    _explain(outcome)
    return outcome


def _explain(outcome: Outcome) -> None:
    """A few plain sentences on what the numbers show, so a newcomer reads the mechanism, not just a table; a session
    figure that the drift check discredits says so in its own sentence."""
    lines = explanation(outcome)
    if lines:
        print("\n".join(lines))


def explanation(outcome: Outcome) -> list[str]:
    lines = []
    for r in outcome.cross.lengths if outcome.cross else ():
        c = r.comparison
        if c.off.n and c.on.n:
            lines.append(f"{r.label}: replica B answered in {c.on.median:.3f} s with the pool (it loaded "
                         f"{r.on_pool_hit_tokens:.0f} prompt tokens' KV that replica A had stored) vs "
                         f"{c.off.median:.3f} s without it (full prefill): {c.speedup:.1f}x.")
    ratios = turn_one_ratios(outcome.sessions) if outcome.sessions else {}
    for g in outcome.sessions.gains if outcome.sessions else ():
        if math.isnan(g.improvement):
            continue
        line = (f"sessions {g.context}, {g.placement}: total {g.off_total_s:.2f} s OFF vs {g.on_total_s:.2f} s ON "
                f"({100 * g.improvement:.0f}% faster).")
        ratio = ratios.get((g.context, g.placement))
        if ratio is not None and drifted(ratio):
            line += (f" Not trustworthy: turn 1, the same work in both arms, took {ratio:.2f}x as long OFF as ON, "
                     "so the machine's speed changed between the arms (see the drift check above).")
        lines.append(line)
    return lines
