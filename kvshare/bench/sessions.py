"""Six-turn synthetic chat sessions, placed `alternate` (A, B, A, B, ...) or `fixed`, with the pool OFF and ON.

Each turn appends the previous answer and a new user message, so turn k's prompt starts with turn k-1's prompt and
answer: a replica (or the pool) that has that prefix serves it without recomputing. Placement is the router's job
when the deployment has one (POST /admin/policy); otherwise the harness picks the replica itself.

Invariant: every session's text is unique in the run (seeded by arm, placement, context and session index), so no
session can hit a prefix another session left behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import httpx
import xxhash

from kvshare.bench import stats
from kvshare.bench.client import BenchError, chat_body, model_info, new_http_client
from kvshare.bench.deploy import Deployment, Endpoints
from kvshare.bench.measure import timed_row, warm_up
from kvshare.bench.rows import RequestRow, RowWriter, measured
from kvshare.bench.workload import Codec, SessionScript, document_ids, session_script

ARMS = ("OFF", "ON")
PLACEMENTS = ("alternate", "fixed")


@dataclass(frozen=True)
class SessionsConfig:
    contexts: tuple[tuple[str, int], ...]
    turns: int = 6
    user_tokens: int = 256  # tokens of each later user message
    answer_tokens: int = 32
    sessions: int = 1  # sessions per (arm, placement, context)
    placements: tuple[str, ...] = PLACEMENTS
    seed: int = 0

    @property
    def total_requests(self) -> int:
        return len(ARMS) * len(self.placements) * len(self.contexts) * self.sessions * self.turns


@dataclass(frozen=True)
class ConditionResult:
    """One (context, placement, arm): per-turn median TTFT and the median total session time, which splits into the
    time to each turn's first token and the time after it (the answer's decode): a cache can only shorten the first,
    and anything that slows decode (a store running beside it) shows in the second."""

    context: str
    placement: str
    arm: str
    sessions: int
    turn_ttft_medians: list[float]
    total_time: stats.Summary
    ttft_sum_s: float  # median over sessions of the turns' TTFTs added up
    after_first_token_s: float  # median over sessions of the turns' (latency - TTFT) added up


@dataclass(frozen=True)
class PlacementGain:
    """ON's improvement over OFF in total session time: 1 - median(ON) / median(OFF)."""

    context: str
    placement: str
    off_total_s: float
    on_total_s: float
    improvement: float


@dataclass(frozen=True)
class SessionsSummary:
    conditions: list[ConditionResult] = field(default_factory=list)
    gains: list[PlacementGain] = field(default_factory=list)


def run_sessions(
    deployment: Deployment, codec: Codec, config: SessionsConfig, writer: RowWriter,
    on_row: Callable[[RequestRow], None] = lambda row: None,
) -> None:
    """All arms, placements, contexts and sessions; raises BenchError (after writing the failed row) on a failure."""
    with new_http_client() as http:
        for a, arm in enumerate(ARMS):
            for p, placement in enumerate(config.placements):
                endpoints = deployment.activate(arm, policy=placement)
                model = model_info(http, endpoints.router or endpoints.replicas[0]).name
                warm_up(http, endpoints.replicas or (endpoints.router,), document_ids(codec, 64, config.seed, a, p, 99),
                        model, dict(bench="sessions", arm=arm, placement=placement), writer)
                for c, context in enumerate(config.contexts):
                    for s in range(config.sessions):
                        script = session_script(codec, context, config.turns, config.user_tokens, config.seed,
                                                stream=((a * 16 + p) * 64 + c) * 1024 + s)
                        session_id = f"{arm}-{placement}-{context[0]}-{s}-seed{config.seed}"
                        _run_session(http, endpoints, model, script, arm, placement, session_id, config, writer, on_row,
                                     deployment.settle)


def _run_session(http: httpx.Client, endpoints: Endpoints, model: str, script: SessionScript, arm: str,
                 placement: str, session_id: str, config: SessionsConfig, writer: RowWriter, on_row,
                 settle: Callable[[], None]) -> None:
    messages: list[dict[str, str]] = []
    for turn, user_message in enumerate(script.user_messages, start=1):
        settle()  # the user's think time: the previous turn's stores are committed before the next turn (untimed)
        messages.append({"role": "user", "content": user_message})
        url = target(endpoints, placement, session_id, turn)
        row, answer = timed_row(
            http, url, "/v1/chat/completions", chat_body(model, messages, config.answer_tokens, user=session_id),
            dict(bench="sessions", kind="turn", arm=arm, placement=placement, session=session_id, turn=turn,
                 length_label=script.context_label, length=script.context_tokens),
            headers={"X-Session-ID": session_id},
        )
        writer.write(row)
        on_row(row)
        if row.error:
            raise BenchError(row.error)
        messages.append({"role": "assistant", "content": answer})


def target(endpoints: Endpoints, placement: str, session_id: str, turn: int) -> str:
    """The URL for a turn: the router when there is one (it places), else A/B alternating or a fixed hashed pick."""
    if endpoints.router:
        return endpoints.router
    replicas = endpoints.replicas
    if placement == "alternate":
        return replicas[(turn - 1) % len(replicas)]
    if placement == "fixed":
        return replicas[xxhash.xxh64_intdigest(session_id.encode()) % len(replicas)]
    raise BenchError(f"unknown placement {placement!r}: use alternate or fixed")


def summarize(rows: list[RequestRow], config: SessionsConfig, seed: int = 0) -> SessionsSummary:
    done = measured(rows, "turn")
    conditions, gains = [], []
    for label, _ in config.contexts:
        for placement in config.placements:
            totals = {}
            for arm in ARMS:
                mine = [r for r in done if r.length_label == label and r.placement == placement and r.arm == arm]
                per_session = _complete_sessions(mine, config.turns)
                totals[arm] = [sum(r.latency_s for r in turns) for turns in per_session.values()]
                ttfts = [sum(r.ttft_s for r in turns) for turns in per_session.values()]
                conditions.append(ConditionResult(
                    context=label, placement=placement, arm=arm, sessions=len(per_session),
                    turn_ttft_medians=[stats.median([r.ttft_s for r in mine if r.turn == t])
                                       for t in range(1, config.turns + 1)],
                    total_time=stats.summarize(totals[arm], seed), ttft_sum_s=stats.median(ttfts),
                    after_first_token_s=stats.median([t - f for t, f in zip(totals[arm], ttfts)]),
                ))
            off, on = stats.median(totals["OFF"]), stats.median(totals["ON"])
            gains.append(PlacementGain(label, placement, off, on, stats.improvement(off, on)))
    return SessionsSummary(conditions, gains)


def _complete_sessions(rows: list[RequestRow], turns: int) -> dict[str, list[RequestRow]]:
    """Sessions that finished every turn (a partial session has no total time)."""
    by_session: dict[str, list[RequestRow]] = {}
    for row in rows:
        by_session.setdefault(row.session, []).append(row)
    return {sid: rs for sid, rs in by_session.items() if len(rs) == turns}
