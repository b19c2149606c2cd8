"""Issue 9's side-by-side: our two-H200 figures (summary.json of `kvshare bench cross-replica` and `sessions`) next
to the case study's, as a Markdown table and one plot.

    python experiments/h200x2_compare.py --cross docs/results/h200x2/cross-32k/summary.json \
        --cross docs/results/h200x2/cross-128k/summary.json --cross docs/results/h200x2/cross-255k/summary.json \
        --sessions docs/results/h200x2/sessions-2/summary.json --out docs/results/h200x2

The study's model is a 27B one on two GPUs; ours is the qwen2.5-32b shape with dummy weights (256 KiB of KV per
token), so the comparison is of shape, not of exact seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STUDY_TTFT = {"128k": (31.715, 0.605), "256k": (92.047, 0.790)}  # (OFF s, ON s), cross-replica
STUDY_SESSIONS = {("alternate", "32k"): "about 35%", ("alternate", "128k"): "about 45%"}  # fixed: "little"


def cross_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for length in json.loads(path.read_text())["cross_replica"]["lengths"]:
            c = length["comparison"]
            study = STUDY_TTFT.get("256k" if length["tokens"] > 200_000 else length["label"])  # 255k is the 256k row
            # 261120: 255k
            label = f"{round(length['tokens'] / 1024)}k" if length["label"].isdigit() else length["label"]
            rows.append(dict(label=label, off=c["off"]["median"], on=c["on"]["median"], n_off=c["off"]["n"],
                             n_on=c["on"]["n"], study=study))
    return rows


def session_rows(path: Path) -> list[dict]:
    conditions = json.loads(path.read_text())["sessions"]["conditions"]
    totals = {(c["context"], c["placement"], c["arm"]): c["total_time"]["median"] for c in conditions}
    rows = []
    for context, placement in dict.fromkeys((c["context"], c["placement"]) for c in conditions):
        off, on = totals[(context, placement, "OFF")], totals[(context, placement, "ON")]
        rows.append(dict(context=context, placement=placement, off=off, on=on, gain=1 - on / off,
                         study=STUDY_SESSIONS.get((placement, context), "little")))
    return rows


def markdown(cross: list[dict], sessions: list[dict]) -> str:
    lines = ["| cross-replica | ours OFF s (n) | ours ON s (n) | ours speedup | study OFF -> ON s | study speedup |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in cross:
        study = f"{r['study'][0]} -> {r['study'][1]} | {r['study'][0] / r['study'][1]:.0f}x" if r["study"] else "- | -"
        lines.append(f"| {r['label']} | {r['off']:.3f} ({r['n_off']}) | {r['on']:.3f} ({r['n_on']}) | "
                     f"{r['off'] / r['on']:.1f}x | {study} |")
    lines += ["", "| sessions (6 turns) | placement | ours OFF s | ours ON s | ours ON gain | study gain |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in sessions:
        lines.append(f"| {r['context']} | {r['placement']} | {r['off']:.3f} | {r['on']:.3f} | {r['gain']:.0%} | "
                     f"{r['study']} |")
    return "\n".join(lines) + "\n"


def plot(cross: list[dict], sessions: list[dict], out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels, x = [], 0
    for r in cross:
        pairs = [("ours", r["off"], r["on"])] + ([("study", *r["study"])] if r["study"] else [])
        for who, off, on in pairs:
            left.bar([x, x + 0.4], [off, on], width=0.4, color=["tab:gray", "tab:blue"])
            labels.append((x + 0.2, f"{r['label']}\n{who}"))
            x += 1
    left.set_xticks([p for p, _ in labels], [t for _, t in labels])
    left.set_yscale("log")
    left.set_ylabel("TTFT s (log): gray OFF, blue ON")
    left.set_title("cross-replica TTFT")
    names = [f"{r['context']}\n{r['placement']}" for r in sessions]
    right.bar(names, [100 * r["gain"] for r in sessions], color="tab:blue")
    right.axhline(0, color="black", linewidth=0.8)
    right.set_ylabel("ON session-time gain %")
    right.set_title("six-turn sessions (one session per condition)")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cross", type=Path, action="append", default=[], help="cross-replica summary.json")
    parser.add_argument("--sessions", type=Path, required=True, help="sessions summary.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cross, sessions = cross_rows(args.cross), session_rows(args.sessions)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(cross, sessions)
    (args.out / "compare.md").write_text(text)
    plot(cross, sessions, args.out)
    print(text)


if __name__ == "__main__":
    main()
