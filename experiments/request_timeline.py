"""Issue 19: one request's timeline from a torch.profiler chrome trace, without a single synchronize added: the
engine thread's named ranges (record_function, no sync) and, per GPU stream, when its copies and kernels ran. What
it answers for a cross-replica ON request: when the pool's host->device copies end, how much of the forward's GPU
work runs after them, and what sits between the last kernel and the first token.

    python experiments/request_timeline.py trace.json[.gz]     # prints the summary of a trace written by
                                                               # h200_tail_profile.py --timeline

Times are milliseconds from the first engine range of the request ("range:schedule"). Names used by the ranges:
range:schedule, range:lookup, range:start_load, range:prefill, range:finish, range:sample.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def load_trace(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def timeline(events: list[dict]) -> dict:
    """The request's summary: host ranges, per-stream GPU spans, and the GPU work after the last host->device copy."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    ranges = [e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith("range:")]
    if not ranges:
        return {"error": "no range:* annotations in the trace"}
    # t0: the scheduler step that admitted the request (the last one to start before its LOOKUP; an idle step may
    # precede it in the trace).
    lookups = [e["ts"] for e in ranges if e["name"] == "range:lookup"]
    steps = [e["ts"] for e in ranges if e["name"] == "range:schedule" and (not lookups or e["ts"] <= min(lookups))]
    t0 = max(steps) if steps else min(e["ts"] for e in ranges)

    def ms(ts: float) -> float:
        return round((ts - t0) / 1000.0, 3)

    host = defaultdict(lambda: {"n": 0, "first_start_ms": None, "last_end_ms": None, "total_ms": 0.0})
    for e in ranges:
        h = host[e["name"]]
        h["n"] += 1
        h["first_start_ms"] = ms(e["ts"]) if h["first_start_ms"] is None else min(h["first_start_ms"], ms(e["ts"]))
        end = ms(e["ts"] + e["dur"])
        h["last_end_ms"] = end if h["last_end_ms"] is None else max(h["last_end_ms"], end)
        h["total_ms"] = round(h["total_ms"] + e["dur"] / 1000.0, 3)
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams: dict = defaultdict(lambda: {"kernels": 0, "h2d": 0, "d2h": 0, "other_copies": 0, "busy_ms": 0.0,
                                         "first_start_ms": None, "last_end_ms": None})
    for e in gpu:
        s = streams[str(e.get("args", {}).get("stream", "?"))]
        kind = _kind(e)
        s[kind] += 1
        s["busy_ms"] = round(s["busy_ms"] + e["dur"] / 1000.0, 3)
        start, end = ms(e["ts"]), ms(e["ts"] + e["dur"])
        s["first_start_ms"] = start if s["first_start_ms"] is None else min(s["first_start_ms"], start)
        s["last_end_ms"] = end if s["last_end_ms"] is None else max(s["last_end_ms"], end)
    h2d = [e for e in gpu if _kind(e) == "h2d" and e["dur"] > 1000]  # the pool's copies (MiBs), not small uploads
    copies_end = max((e["ts"] + e["dur"] for e in h2d), default=None)
    result = {"host": dict(host), "streams": dict(streams)}
    if copies_end is not None:
        result["pool_copies"] = {"n": len(h2d), "first_start_ms": ms(min(e["ts"] for e in h2d)),
                                 "last_end_ms": ms(copies_end)}
        after = [e for e in gpu if e.get("cat") == "kernel" and e["ts"] + e["dur"] > copies_end]
        names = defaultdict(float)
        for e in after:
            names[e["name"][:60]] += (min(e["dur"], e["ts"] + e["dur"] - copies_end)) / 1000.0
        result["after_copies"] = {
            "kernels": len(after),
            "kernel_ms": round(sum(names.values()), 3),
            "last_kernel_end_ms": ms(max((e["ts"] + e["dur"] for e in after), default=copies_end)),
            "top": sorted(((round(v, 3), k) for k, v in names.items()), reverse=True)[:8],
        }
    last_d2h = [e for e in gpu if _kind(e) == "d2h"]
    if last_d2h:
        e = max(last_d2h, key=lambda e: e["ts"])
        result["last_d2h_end_ms"] = ms(e["ts"] + e["dur"])
    return result


def _kind(e: dict) -> str:
    if e.get("cat") == "kernel":
        return "kernels"
    name = e.get("name", "")
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    return "other_copies"


def render(summary: dict) -> str:
    if "error" in summary:
        return summary["error"]
    lines = ["host ranges (ms from range:schedule): name n first-start last-end total"]
    for name, h in sorted(summary["host"].items(), key=lambda kv: kv[1]["first_start_ms"]):
        lines.append(f"  {name:18s} {h['n']:5d} {h['first_start_ms']:9.1f} {h['last_end_ms']:9.1f} "
                     f"{h['total_ms']:9.1f}")
    lines.append("GPU streams: stream kernels h2d d2h other first-start last-end busy")
    for name, s in sorted(summary["streams"].items(), key=lambda kv: kv[1]["first_start_ms"]):
        lines.append(f"  {name:6s} {s['kernels']:6d} {s['h2d']:5d} {s['d2h']:4d} {s['other_copies']:5d} "
                     f"{s['first_start_ms']:9.1f} {s['last_end_ms']:9.1f} {s['busy_ms']:9.1f}")
    if "pool_copies" in summary:
        p, a = summary["pool_copies"], summary["after_copies"]
        lines.append(f"pool copies: {p['n']} from {p['first_start_ms']:.1f} to {p['last_end_ms']:.1f} ms; after them "
                     f"{a['kernels']} kernels, {a['kernel_ms']:.1f} ms of kernel time, the last ending at "
                     f"{a['last_kernel_end_ms']:.1f} ms")
        lines += [f"    {v:8.2f} ms  {k}" for v, k in a["top"]]
    if "last_d2h_end_ms" in summary:
        lines.append(f"last device->host copy ends at {summary['last_d2h_end_ms']:.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(timeline(load_trace(sys.argv[1]))))
