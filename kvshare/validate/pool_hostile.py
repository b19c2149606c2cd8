"""The pool's rows of `kvshare validate hostile`: each single pool attack, then the flood, judged against the bounds
docs/security.md states (pool memory, an innocent client's STATS p99, no innocent request failing)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import msgspec

from kvshare.validate.hostile import Row
from kvshare.validate.pool_attacks import POOL_ATTACKS, FloodResult, PoolTarget, flood

MiB = 1 << 20


@dataclass(frozen=True)
class FloodPlan:
    connections: int = 1000
    seconds: float = 10.0
    max_rss_growth: int = 64 * MiB  # the bounds a flood must keep
    max_stats_p99_ms: float = 50.0


def pool_rows(target: PoolTarget, plan: FloodPlan | None, json_path: str = "") -> list[Row]:
    rows = []
    for attack in POOL_ATTACKS:
        if attack.needs_tcp and not target.tcp:
            continue
        try:
            verdict = attack.run(target)
            rows.append(Row(attack.name, "pool", attack.expected, verdict.observed, verdict.handled))
        except OSError as error:
            rows.append(Row(attack.name, "pool", attack.expected, f"attack could not complete: {error}", False))
    if plan is not None and plan.connections:
        result = flood(target, plan.connections, plan.seconds)
        rows += flood_rows(result, plan)
        if json_path:
            with open(json_path, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode({"plan": asdict(plan), "flood": asdict(result)})))
    return rows


def flood_rows(r: FloodResult, plan: FloodPlan) -> list[Row]:
    kinds = ", ".join(f"{n} {kind}" for kind, n in r.by_kind.items())
    name = f"flood: {r.connections} connections for {r.seconds:g} s"
    return [
        Row(f"{name} ({kinds})", "pool", f"pool RSS grows <= {plan.max_rss_growth // MiB} MiB",
            f"+{r.rss_growth / MiB:.1f} MiB (peak; +{(r.pool_rss_after - r.pool_rss_before) / MiB:.1f} after)",
            r.rss_growth <= plan.max_rss_growth),
        Row(name, "pool", f"innocent STATS p99 < {plan.max_stats_p99_ms:g} ms",
            f"p50 {r.stats_p50_ms:.2f} / p99 {r.stats_p99_ms:.2f} / max {r.stats_max_ms:.1f} ms "
            f"({r.stats_calls} calls)",
            r.stats_p99_ms < plan.max_stats_p99_ms),
        Row(name, "pool", "no innocent request fails",
            f"{r.innocent_failures} failed of {r.innocent_rounds} store+load rounds"
            + (f": {r.failure_examples[0]}" if r.failure_examples else ""),
            r.innocent_failures == 0 and r.innocent_rounds > 0),
    ]
