"""The output folder of a benchmark run: summary.json, report.md with tables, PNG plots, and the rich summary table.

Invariant: a report can be written from whatever rows exist, so a failed or interrupted run still gets one, marked
partial with the reason.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvshare.bench.cross_replica import CrossReplicaSummary
from kvshare.bench.rows import RequestRow
from kvshare.bench.sessions import SessionsSummary


@dataclass(frozen=True)
class RunInfo:
    title: str
    command: str
    machine: str
    deployment: str
    started_at: float
    finished_at: float
    error: str = ""  # empty when the run completed

    @property
    def partial(self) -> bool:
        return bool(self.error)


def command_line(argv: list[str] | None = None) -> str:
    return "kvshare " + shlex.join(sys.argv[1:] if argv is None else argv)


def machine_description() -> str:
    """CPU model, cores, RAM, OS and Python: enough to tell two machines' reports apart."""
    import psutil

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = psutil.virtual_memory().total / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def write_report(out_dir: Path, info: RunInfo, rows: list[RequestRow], cross: CrossReplicaSummary | None,
                 sessions: SessionsSummary | None) -> list[Path]:
    """Write summary.json, report.md and the plots into `out_dir`; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"run": info, "cross_replica": cross, "sessions": sessions, "rows": len(rows),
               "errors": [row.error for row in rows if row.error]}
    paths = [out_dir / "summary.json"]
    paths[0].write_bytes(msgspec.json.format(msgspec.json.encode(_finite(summary))) + b"\n")
    plots = []
    if cross and cross.measured_requests:
        plots.append(_plot_cross(out_dir / "ttft_vs_length.png", cross))
    if sessions and any(c.sessions for c in sessions.conditions):
        plots.append(_plot_sessions(out_dir / "session_turns.png", sessions))
    markdown = out_dir / "report.md"
    markdown.write_text(_markdown(info, rows, cross, sessions, [p.name for p in plots]))
    return paths + plots + [markdown]


def _finite(value):
    """NaN and inf become None in JSON (an empty sample has no median)."""
    value = msgspec.to_builtins(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _plot_cross(path: Path, cross: CrossReplicaSummary) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [r.tokens for r in cross.lengths]
    for arm, color in (("off", "tab:red"), ("on", "tab:blue")):
        s = [getattr(r.comparison, arm) for r in cross.lengths]
        medians = [v.median for v in s]
        errors = [[max(0.0, v.median - v.ci_low) for v in s], [max(0.0, v.ci_high - v.median) for v in s]]
        ax.errorbar(x, medians, yerr=errors, marker="o", capsize=4, color=color, label=f"cache {arm.upper()}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [r.label for r in cross.lengths])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("cross-replica TTFT, median (s)")
    ax.set_title("Time to first token on replica B (bars: bootstrap 95% CI)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_sessions(path: Path, sessions: SessionsSummary) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(dict.fromkeys(c.context for c in sessions.conditions))
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.2 * len(contexts), 4.0), squeeze=False)
    styles = {"OFF": "--", "ON": "-"}
    for ax, context in zip(axes[0], contexts):
        for c in (c for c in sessions.conditions if c.context == context):
            turns = range(1, len(c.turn_ttft_medians) + 1)
            ax.plot(turns, c.turn_ttft_medians, styles[c.arm], marker="o", label=f"{c.placement}, cache {c.arm}")
        ax.set_yscale("log")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT, median (s)")
        ax.set_title(f"sessions, initial context {context}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: float, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return "–" if math.isnan(value) else f"{100 * value:.0f}%"


def cross_rows(cross: CrossReplicaSummary) -> list[list[str]]:
    """The per-length table (markdown and terminal share it)."""
    table = []
    for r in cross.lengths:
        c = r.comparison
        table.append([
            r.label, f"{c.off.n}/{c.on.n}",
            f"{_fmt(c.off.median)} [{_fmt(c.off.ci_low)}, {_fmt(c.off.ci_high)}]", _fmt(c.off.iqr),
            f"{_fmt(c.on.median)} [{_fmt(c.on.ci_low)}, {_fmt(c.on.ci_high)}]", _fmt(c.on.iqr),
            f"{_fmt(c.speedup, 2)}x [{_fmt(c.speedup_ci_low, 2)}, {_fmt(c.speedup_ci_high, 2)}]",
            " / ".join(f"{p.off_block}:{p.on_block} {_fmt(p.speedup, 2)}x" for p in r.pairs),
            _fmt(r.on_pool_hit_tokens, 0),
        ])
    return table


CROSS_HEADER = ["length", "n OFF/ON", "OFF median s [95% CI]", "OFF IQR", "ON median s [95% CI]", "ON IQR",
                "speedup [95% CI]", "block pairs", "ON pool hits (tokens)"]
SESSION_HEADER = ["context", "placement", "OFF session s", "ON session s", "ON improvement"]
TURN_HEADER = ["context", "placement", "arm", "sessions", "TTFT per turn, median s", "session total s [95% CI]",
               "of which TTFTs s", "after first tokens s"]


def session_rows(sessions: SessionsSummary) -> list[list[str]]:
    return [[g.context, g.placement, _fmt(g.off_total_s), _fmt(g.on_total_s), _pct(g.improvement)]
            for g in sessions.gains]


def turn_rows(sessions: SessionsSummary) -> list[list[str]]:
    return [[c.context, c.placement, c.arm, str(c.sessions), ", ".join(_fmt(t) for t in c.turn_ttft_medians),
             f"{_fmt(c.total_time.median)} [{_fmt(c.total_time.ci_low)}, {_fmt(c.total_time.ci_high)}]",
             _fmt(c.ttft_sum_s), _fmt(c.after_first_token_s)]
            for c in sessions.conditions]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


# Turn 1's OFF/ON TTFT ratio beyond [1 / DRIFT_TOLERANCE, DRIFT_TOLERANCE]: the arms did not run at the same speed.
DRIFT_TOLERANCE = 1.2


def turn_one_ratios(sessions: SessionsSummary) -> dict[tuple[str, str], float]:
    """(context, placement) -> OFF/ON median TTFT of turn 1. Turn 1 is a fresh context in every arm: the same work,
    which no cache can speed up. A ratio far from 1 means the machine's speed drifted between the arms (which run one
    after the other)."""
    ratios = {}
    for off in (c for c in sessions.conditions if c.arm == "OFF" and c.turn_ttft_medians):
        on = next((c for c in sessions.conditions if c.arm == "ON" and (c.context, c.placement) ==
                   (off.context, off.placement)), None)
        if on and on.turn_ttft_medians:
            ratios[(off.context, off.placement)] = off.turn_ttft_medians[0] / on.turn_ttft_medians[0]
    return ratios


def drifted(ratio: float) -> bool:
    return not 1 / DRIFT_TOLERANCE <= ratio <= DRIFT_TOLERANCE


def drift_note(sessions: SessionsSummary) -> str:
    """The drift check as the report and the printed summary both give it."""
    ratios = turn_one_ratios(sessions)
    listed = "; ".join(f"{context} {placement} {_fmt(ratio, 2)}" for (context, placement), ratio in ratios.items())
    note = ("Drift check: turn 1 does the same work in both arms (a fresh context), so its OFF/ON TTFT ratio "
            f"should be about 1: {listed or 'n/a'}. Far from 1, the machine's load changed between the "
            "arms and the session improvements are not trustworthy; rerun with more --sessions on a quiet machine.")
    bad = [f"{context} {placement}" for (context, placement), ratio in ratios.items() if drifted(ratio)]
    if bad:
        note += (f" Here {', '.join(bad)} drifted beyond {DRIFT_TOLERANCE:g}x: do not read an improvement into "
                 f"{'those rows' if len(bad) > 1 else 'that row'}.")
    return note


def _markdown(info: RunInfo, rows, cross, sessions, plots: list[str]) -> str:
    import datetime

    when = datetime.datetime.fromtimestamp(info.started_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"# {info.title}", ""]
    if info.partial:
        out += [f"**Partial report: the run stopped early.** {info.error}", ""]
    out += [f"- Command: `{info.command}`", f"- Machine: {info.machine}", f"- Deployment: {info.deployment}",
            f"- Started {when}; ran {info.finished_at - info.started_at:.0f} s; {len(rows)} requests in "
            "`requests.jsonl` (one row each, measured or not)", ""]
    if cross is not None:
        out += ["## Cross-replica time to first token", "",
                "Each measured request sends a fresh document plus a new question to replica B after replica A "
                "served the same document (A computes it and, with the pool ON, stores it). Blocks run "
                "OFF1, ON1, ON2, OFF2; speedup = median OFF / median ON; CIs are percentile bootstraps (2000 "
                "resamples, seeded); block pairs compare OFF1 with ON1 and OFF2 with ON2, which exposes drift.", "",
                _table(CROSS_HEADER, cross_rows(cross)), ""]
    if sessions is not None:
        out += ["## Sessions", "",
                "Each turn appends the previous answer and a new user message. `alternate` sends turns to A, B, "
                "A, B, ...; `fixed` keeps a session on one replica. Improvement = 1 - ON / OFF median total session "
                "time.", "", _table(SESSION_HEADER, session_rows(sessions)), "",
                _table(TURN_HEADER, turn_rows(sessions)), "", drift_note(sessions), ""]
    out += [f"![{name}]({name})" for name in plots]
    return "\n".join(out) + "\n"


# Columns of a summary printed into a pipe or a file: wide enough for every table whole (rich's 80 cut them).
PIPED_WIDTH = 400


def summary_console(file=None):
    """A rich Console at the terminal's real width (tables then wrap their cells to fit it), or at PIPED_WIDTH when
    the output is not a terminal, so that nothing is cut."""
    from rich.console import Console

    console = Console(file=file)
    return console if console.is_terminal else Console(file=file, width=PIPED_WIDTH)


def print_summary(info: RunInfo, cross: CrossReplicaSummary | None, sessions: SessionsSummary | None,
                  console=None) -> None:
    from rich.table import Table

    console = console or summary_console()
    for title, header, rows in _terminal_tables(cross, sessions):
        table = Table(title=title)
        for column in header:
            table.add_column(column, overflow="fold")  # a cell too wide wraps onto more lines, never "…"
        for row in rows:
            table.add_row(*row)
        console.print(table)
    if sessions is not None:
        console.print(drift_note(sessions), markup=False)
    if info.partial:
        console.print(f"[bold red]partial run:[/] {info.error}")


def _terminal_tables(cross, sessions):
    if cross is not None:
        yield "cross-replica TTFT", CROSS_HEADER, cross_rows(cross)
    if sessions is not None:
        yield "sessions: ON vs OFF", SESSION_HEADER, session_rows(sessions)
        yield "sessions: per turn", TURN_HEADER, turn_rows(sessions)
