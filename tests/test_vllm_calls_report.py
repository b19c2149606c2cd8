"""experiments/vllm_calls_report.py: several vllm_cross_replica calls pooled into one report and one figure. Rows of
the calls named (and of only the arms named after a colon) share cells; calls that measured different things (here,
other weights) never do, and a bad call is one line and exit 2. Starts nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "vllm_calls_report.py"


def write_call(folder: Path, rows: list[dict], **settings) -> Path:
    """A call's OUT as vllm_cross_replica leaves it: rows.jsonl and summary.json (the keys the report reads)."""
    folder.mkdir(parents=True)
    summary = {"device": "cuda", "model": "qwen2.5-32b", "dtype": "bfloat16", "quantization": "none",
               "load_format": "dummy", "kv_bytes_per_token": 1 << 18, "gbps": 55.0, "gbps_source": "measured",
               "max_tokens": 8, "answer_ids": "logprobs", "command": f"python experiments/vllm_cross_replica.py "
               f"--out {folder.name}", "started_utc": "2026-12-06 02:44", "seconds": 400, "budget_s": 480.0,
               "machine": {"cpu": "x", "cores": 16, "memory_gib": 125.8, "python": "3.12", "gpu": "NVIDIA H200",
                           "kernel": "k"},
               "packages": {"vllm": "0.26.0"}, "skipped": [], "arm_failures": {}, **settings}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "rows.jsonl"


def row(arm: str, role: str, ttft: float, **extra) -> dict:
    return {"kind": "measured", "arm": arm, "role": role, "repeat": 0, "length": 131072, "ttft_s": ttft,
            "error": "", "external_hit_tokens": 131056.0 if role == "B" else 0.0, "local_hit_tokens": 0.0,
            "exact": None if arm == "none" else True, "first_token_equal": None if arm == "none" else True, **extra}


def pool(*calls: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *calls, "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_calls_pool_into_one_report_and_figure(tmp_path):
    first = write_call(tmp_path / "one", [row("kvshare", "B", 1.0, gbps=55.0)])
    second = write_call(tmp_path / "two", [row("kvshare", "B", 0.8, gbps=51.0)], gbps=51.0)
    # an earlier session's call: its references are wanted, its loads (another code's) are not; its rows predate
    # rows carrying their rate
    earlier = write_call(tmp_path / "old", [row("none", "ref", 30.0), row("kvshare", "B", 5.0)], gbps=50.0,
                         skipped=[{"arm": "kvshare", "role": "B", "what": "x", "why": "budget"}])
    done = pool(str(first), str(second), f"{earlier}:none", out=tmp_path / "pooled")
    assert done.returncode == 0, done.stderr
    cells = {(c["arm"], c["role"]): c for c in json.loads((tmp_path / "pooled" / "summary.json").read_text())["cells"]}
    assert set(cells) == {("kvshare", "B"), ("none", "ref")}
    b = cells[("kvshare", "B")]
    assert (b["n"], b["median_ttft_s"], b["min_ttft_s"], b["max_ttft_s"]) == (2, 0.9, 0.8, 1.0)  # not the 5.0
    assert b["speedup_vs_none"] == 30.0 / 0.9
    assert b["floor_s"] == 131072 * (1 << 18) / 53.0e9  # each row's own call's rate
    assert cells[("none", "ref")]["floor_s"] == 131072 * (1 << 18) / 50.0e9  # its call's, not the first call's
    kept = [json.loads(line) for line in (tmp_path / "pooled" / "rows.jsonl").read_text().splitlines()]
    assert sorted(r["ttft_s"] for r in kept) == [0.8, 1.0, 30.0]
    report = (tmp_path / "pooled" / "report.md").read_text()
    assert "--out one`" in report and "--out two`" in report and "only its none rows" in report
    assert "Skipped" not in report  # the earlier call's skip was of an arm not kept
    assert "1200 s; budget 1440.0 s" in report  # the calls' seconds and budgets, summed
    assert (tmp_path / "pooled" / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calls_of_other_weights_never_share_a_cell(tmp_path):
    first = write_call(tmp_path / "bf16", [row("kvshare", "B", 1.0)])
    other = write_call(tmp_path / "fp8", [row("kvshare", "B", 0.8)], quantization="fp8")
    done = pool(str(first), str(other), out=tmp_path / "pooled")
    assert done.returncode == 2
    last = done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr and "its quantization is 'fp8', the first call's 'none'" in last
    assert not (tmp_path / "pooled").exists()


def test_a_call_without_its_summary_or_without_loads_is_one_line(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "rows.jsonl").write_text(json.dumps(row("kvshare", "B", 1.0)) + "\n")
    done = pool(str(alone / "rows.jsonl"), out=tmp_path / "pooled")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "no summary.json beside it" in done.stderr.splitlines()[-1]
    refs = write_call(tmp_path / "refs", [row("none", "ref", 30.0), row("kvshare", "B", 1.0)])
    done = pool(f"{refs}:none", out=tmp_path / "pooled")
    assert done.returncode == 2 and "no measured load" in done.stderr.splitlines()[-1]
