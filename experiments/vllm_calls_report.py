"""Pool the rows of several experiments/vllm_cross_replica.py calls into one report and one figure.

A device session's measurement is often several calls chained by --previous (docs/results/h200-vllm/README.md), each
with a report.md of its own that mixes in whatever --previous rows it was given. This starts nothing: it reads the
rows.jsonl of each call named, and the summary.json beside it, keeps only the arms named after a colon
(`PATH:none` takes an earlier session's references and not its loads), checks that every call measured the same
thing (device, model, dtype, weights, K/V bytes per token), and writes into --out what one call would have:
report.md, summary.json and rows.jsonl, plus ttft.png (for the cells that load: every request's TTFT, the cells'
medians and the transfer floor) and the list of the calls pooled, each with its command, machine and floor rate.
Each row keeps the floor rate its own call measured (vllm_cross_replica.row_rate); the machine and settings in the
report's header are the first call's.

    python experiments/vllm_calls_report.py \\
        docs/results/h200-vllm/gpu/session20/kv-offload/rows.jsonl \\
        docs/results/h200-vllm/gpu/session20/kv-offload-128k/rows.jsonl \\
        docs/results/h200-vllm/gpu/session20/lmcache-mp/rows.jsonl \\
        docs/results/h200-vllm/gpu/session20/kvshare-128k/rows.jsonl \\
        docs/results/h200-vllm/gpu/session10/call9/rows.jsonl:none --out docs/results/h200-vllm/gpu/session20/pooled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cross_replica as xr  # noqa: E402

# What must be equal across calls for their rows to share a cell: the same prompts' answers and bytes.
SAME = ("device", "model", "dtype", "quantization", "kv_bytes_per_token")
# A summary's keys that describe its own call's result, not the settings the pooled report inherits.
PER_CALL = ("seconds", "cells", "stores", "registrations", "skipped", "arm_failures", "rows", "previous_rows")
COLORS = {"none": "tab:red", "kvshare": "tab:blue", "offload": "tab:orange", "lmcache": "tab:olive",
          "lmcache-mp": "tab:green"}


class CallError(ValueError):
    """A call that cannot be pooled; its message is the one line the user sees."""


def parse_call(text: str) -> tuple[Path, set[str] | None]:
    """PATH or PATH:ARM,ARM -> (the rows file, the arms kept; None = every arm)."""
    head, sep, tail = text.rpartition(":")
    arms = tail.split(",")
    if sep and head and all(arm in xr.ARMS for arm in arms):
        return Path(head), set(arms)
    return Path(text), None


def load_call(text: str) -> tuple[dict, list[dict]]:
    """One call's summary, narrowed to the arms kept (its skips, failures and "kept_arms"), and the rows kept of
    it, each with the floor rate its call measured."""
    path, arms = parse_call(text)
    if not path.is_file():
        raise CallError(f"{text}: no such file (a call's OUT/rows.jsonl, optionally :ARM,ARM)")
    summary_path = path.parent / "summary.json"
    if not summary_path.is_file():
        raise CallError(f"{path}: no summary.json beside it (the call's own; its machine and settings are needed)")
    try:
        summary = json.loads(summary_path.read_text())
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise CallError(f"{path.parent}: not a call's output ({error})") from None
    # Rows from before rows carried their rate take their own call's, not the first call's (row_rate's fallback).
    rows = [{**r, "gbps": r.get("gbps") or summary.get("gbps")} for r in rows]
    if arms is None:
        return summary, rows
    summary["kept_arms"] = sorted(arms)
    summary["skipped"] = [s for s in summary.get("skipped", []) if s.get("arm") in arms]
    summary["arm_failures"] = {arm: why for arm, why in summary.get("arm_failures", {}).items() if arm in arms}
    return summary, [r for r in rows if r.get("arm") in arms]


def check_same(calls: list[dict], names: list[str]) -> None:
    """Rows share cells only when their calls measured the same thing (a missing quantization is an older call's
    "none": bf16 weights)."""
    first = calls[0]
    for summary, name in zip(calls[1:], names[1:], strict=True):
        for key in SAME:
            mine, theirs = first.get(key, "none"), summary.get(key, "none")
            if mine != theirs:
                raise CallError(f"{name}: its {key} is {theirs!r}, the first call's {mine!r}; rows of different "
                                f"{key} never share a cell")


def pooled_run(calls: list[dict], rows: list[dict], out: Path, command: str) -> xr.Run:
    """A Run that holds every kept row as --previous rows, with the first call's settings and the calls' seconds
    and budgets summed (so the report's "N s; budget B s" is the session's)."""
    meta = {k: v for k, v in calls[0].items() if k not in PER_CALL}
    meta["command"] = command
    meta["budget_s"] = sum(c.get("budget_s", 0.0) for c in calls)
    meta["calls"] = [{"command": c["command"], "started_utc": c.get("started_utc"), "machine": c.get("machine"),
                      "gbps": c.get("gbps"), "kept_arms": c.get("kept_arms")} for c in calls]
    seconds = sum(c.get("seconds", 0) for c in calls)
    skipped = [{**s, "what": f"{s['what']} (call {i})"} for i, c in enumerate(calls, 1) for s in c.get("skipped", [])]
    failures = {f"{arm} (call {i})": why for i, c in enumerate(calls, 1) for arm, why in c.get("arm_failures", {})
                .items()}
    return xr.Run(None, None, out, time.monotonic() - seconds, previous=rows, skipped=skipped,
                  arm_failures=failures, meta=meta)


def calls_section(meta: dict) -> str:
    lines = ["", "## The calls pooled here", ""]
    for i, call in enumerate(meta["calls"], 1):
        machine = call.get("machine") or {}
        lines.append(f"{i}. started {call.get('started_utc')} UTC on {machine.get('gpu') or 'no GPU'} (host kernel "
                     f"{machine.get('kernel', '?')}), floor {call.get('gbps')} GB/s"
                     + (f", only its {', '.join(call['kept_arms'])} rows" if call.get("kept_arms") else "")
                     + f": `{call['command']}`")
    return "\n".join(lines) + "\n"


def plot_ttft(path: Path, summary: dict, rows: list[dict]) -> Path:
    """One panel per length with the cells that load (vllm_cross_replica.is_load): each request (a dot), the cell's
    median (a bar) and the transfer floor (dashed), on a linear axis from 0; recompute's median is in the title
    (on one axis with it, 30 s against 0.8 s, the loads would be one dot)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["kind"] == "measured" and r.get("ttft_s") is not None]
    loads = [c for c in summary["cells"] if xr.is_load(c["role"]) and c["median_ttft_s"] is not None]
    lengths = sorted({c["length"] for c in loads})
    heights = [1.0 + 0.45 * sum(1 for c in loads if c["length"] == n) for n in lengths]
    fig, axes = plt.subplots(len(lengths), 1, figsize=(8.5, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, length in zip(axes[:, 0], lengths, strict=True):
        cells = [c for c in loads if c["length"] == length][::-1]  # the first cell on top
        top = 0.0
        for y, cell in enumerate(cells):
            mine = [r["ttft_s"] for r in measured
                    if (r["arm"], r["role"], r["length"]) == (cell["arm"], cell["role"], length)]
            color = COLORS.get(cell["arm"], "tab:gray")
            ax.scatter(mine, [y] * len(mine), s=22, color=color, alpha=0.6, zorder=3)
            ax.scatter([cell["median_ttft_s"]], [y], marker="|", s=420, color=color, zorder=4)
            ax.annotate(f"{cell['median_ttft_s']:.3f} s (n={cell['n']})", (max(mine), y), xytext=(8, -3),
                        textcoords="offset points", fontsize=8)
            top = max(top, *mine)
        floor = statistics.median(c["floor_s"] for c in cells)
        ax.axvline(floor, linestyle="--", color="black", linewidth=1)
        ax.annotate(f"floor {floor:.3f} s", (floor, len(cells) - 0.55), xytext=(-4, 0), textcoords="offset points",
                    ha="right", fontsize=8)
        ax.set_yticks(range(len(cells)), [c["label"] for c in cells], fontsize=8)
        ax.set_ylim(-0.7, len(cells) - 0.3)
        ax.set_xlim(0, top * 1.25)
        ax.grid(True, axis="x", alpha=0.3)
        recompute = [c["median_ttft_s"] for c in summary["cells"] if (c["arm"], c["role"], c["length"]) ==
                     ("none", "ref", length)]
        ax.set_title(f"{length:,} tokens" + (f" (recompute: {recompute[0]:.2f} s)" if recompute else ""),
                     fontsize=10)
    axes[-1, 0].set_xlabel("TTFT through the router (s); dots: requests, bars: medians")
    gpu = (summary.get("machine") or {}).get("gpu") or summary["device"]
    fig.suptitle(f"{summary['model']} on {gpu}: a hit's time to first token", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("calls", nargs="+", metavar="ROWS[:ARMS]", help="a call's OUT/rows.jsonl (its summary.json "
                   "beside it), optionally :ARM,ARM to keep only those arms' rows; the first call's settings head "
                   "the report")
    p.add_argument("--out", type=Path, required=True, help="folder for report.md, summary.json, rows.jsonl, ttft.png")
    args = p.parse_args()
    try:
        loaded = [load_call(text) for text in args.calls]
        check_same([summary for summary, _ in loaded], args.calls)
    except CallError as error:
        p.error(str(error))
    rows = [row for _, call_rows in loaded for row in call_rows]
    if not any(r["kind"] == "measured" and xr.is_load(r["role"]) for r in rows):
        p.error("no measured load (a hit) in the rows kept: nothing to report")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([os.path.relpath(sys.argv[0], xr.ROOT), *sys.argv[1:]])
    run = pooled_run([summary for summary, _ in loaded], rows, args.out, command)
    summary = xr.write_report(run)
    (args.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figure = plot_ttft(args.out / "ttft.png", summary, rows)
    report = args.out / "report.md"
    report.write_text(report.read_text() + f"\n![TTFT per request]({figure.name})\n" + calls_section(run.meta))
    print(xr.table(summary), flush=True)
    print(f"wrote {args.out}/report.md, summary.json, rows.jsonl, {figure.name} ({len(loaded)} calls, "
          f"{sum(1 for r in rows if r['kind'] == 'measured')} requests)", flush=True)


if __name__ == "__main__":
    main()
