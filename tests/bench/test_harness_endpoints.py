"""The harness end to end in endpoint mode, against real HTTP replicas (the router package's stub servers):
rows, report files, and a mid-run failure that keeps the measured rows and writes a partial report."""

import json
import subprocess
import sys

import pytest

from kvshare.bench.rows import read_rows
from kvshare.processes import ManagedProcess, free_port, wait_http_ready


@pytest.fixture
def stubs(tmp_path):
    """Two running stub replicas; yields their URLs; always stops them."""
    processes, urls = [], []
    try:
        for name in ("A", "B"):
            port = free_port()
            argv = [sys.executable, "-m", "kvshare.router.stub", "--name", name, "--port", str(port)]
            processes.append(ManagedProcess(name, argv, tmp_path / f"stub-{name}.log"))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http_ready(urls[-1], processes[-1], 60)
        yield urls
    finally:
        for process in processes:
            process.stop()


def _kvshare(*args):
    return subprocess.run([sys.executable, "-m", "kvshare.cli", *args], capture_output=True, text=True, timeout=300)


def test_cross_replica_and_sessions_write_every_row_and_the_report(stubs, tiny_model, tmp_path):
    urls, out = ",".join(stubs), tmp_path / "cross"
    result = _kvshare("bench", "cross-replica", "--off", urls, "--on", urls, "--tokenizer", str(tiny_model),
                      "--lengths", "64,128", "--per-block", "2", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_rows(out / "requests.jsonl")
    measured = [r for r in rows if r.kind == "measured"]
    assert len(measured) == 4 * 2 * 2 and len([r for r in rows if r.kind == "warm"]) == 16
    assert {r.url for r in measured} == {stubs[1]} and {r.url for r in rows if r.kind == "warm"} == {stubs[0]}
    assert {r.prompt_tokens for r in measured if r.length == 64} == {64 + 32}  # exact token-id prompts
    assert all(r.ttft_s is not None and r.latency_s >= r.ttft_s for r in measured)
    assert [r.block for r in measured][:4] == ["OFF1"] * 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cross_replica"]["measured_requests"] == 16
    assert (out / "ttft_vs_length.png").stat().st_size > 0 and "OFF1:ON1" in (out / "report.md").read_text()

    out = tmp_path / "sessions"
    result = _kvshare("bench", "sessions", "--off", urls, "--on", urls, "--tokenizer", str(tiny_model),
                      "--contexts", "128", "--turns", "3", "--user-tokens", "16", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    turns = [r for r in read_rows(out / "requests.jsonl") if r.kind == "turn"]
    assert len(turns) == 2 * 2 * 3
    alternate = [r.url for r in turns if r.placement == "alternate" and r.arm == "ON"]
    assert alternate == [stubs[0], stubs[1], stubs[0]]
    assert len({r.url for r in turns if r.placement == "fixed" and r.arm == "ON"}) == 1
    assert (out / "session_turns.png").exists()


def test_a_replica_lost_mid_run_keeps_the_rows_and_writes_a_partial_report(stubs, tiny_model, tmp_path):
    dead = ",".join(f"http://127.0.0.1:{free_port()}" for _ in range(2))  # the ON set is gone when ON1 starts
    out = tmp_path / "partial"
    result = _kvshare("bench", "cross-replica", "--off", ",".join(stubs), "--on", dead, "--tokenizer",
                      str(tiny_model), "--lengths", "64", "--per-block", "2", "--out", str(out))
    assert result.returncode == 1
    assert "cannot reach" in result.stdout + result.stderr
    rows = read_rows(out / "requests.jsonl")
    assert [r.block for r in rows if r.kind == "measured"] == ["OFF1", "OFF1"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cross_replica"]["lengths"][0]["comparison"]["off"]["n"] == 2
    assert "Partial report" in (out / "report.md").read_text()


def test_skip_off_warm_sends_replica_a_nothing_in_off_blocks(stubs, tiny_model, tmp_path):
    urls, out = ",".join(stubs), tmp_path / "cross"
    result = _kvshare("bench", "cross-replica", "--off", urls, "--on", urls, "--tokenizer", str(tiny_model),
                      "--lengths", "64", "--per-block", "1", "--skip-off-warm", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_rows(out / "requests.jsonl")
    assert [r.block for r in rows if r.kind == "measured"] == ["OFF1", "ON1", "ON2", "OFF2"]
    assert [r.block for r in rows if r.kind == "warm"] == ["ON1", "ON2"]


def test_a_design_split_over_two_runs_reports_all_four_blocks(stubs, tiny_model, tmp_path):
    """OFF1,ON1 now and ON2,OFF2 later (a 255k design outlasts one GPU call): the second run's rows and report hold
    every block; a block given twice, or an unknown one, is refused before anything is sent."""
    urls = ",".join(stubs)
    common = ("--off", urls, "--on", urls, "--tokenizer", str(tiny_model), "--lengths", "64", "--per-block", "1")
    first, second = tmp_path / "first", tmp_path / "second"
    result = _kvshare("bench", "cross-replica", *common, "--blocks", "OFF1,ON1", "--out", str(first))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r.block for r in read_rows(first / "requests.jsonl") if r.kind == "measured"] == ["OFF1", "ON1"]
    result = _kvshare("bench", "cross-replica", *common, "--blocks", "ON2,OFF2", "--rows",
                      str(first / "requests.jsonl"), "--out", str(second))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_rows(second / "requests.jsonl")
    assert [r.block for r in rows if r.kind == "measured"] == ["OFF1", "ON1", "ON2", "OFF2"]
    summary = json.loads((second / "summary.json").read_text())
    assert summary["cross_replica"]["lengths"][0]["comparison"]["on"]["n"] == 2
    assert "OFF2:ON2" in (second / "report.md").read_text()

    for bad, message in ((("--blocks", "ON1", "--rows", str(first / "requests.jsonl")), "ON1"),
                         (("--blocks", "ON3"), "unknown block")):
        result = _kvshare("bench", "cross-replica", *common, *bad, "--out", str(tmp_path / "bad"))
        assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr


def test_sessions_switch_a_token_protected_routers_policy_only_with_its_token(stubs, tiny_model, tmp_path):
    """A router started with --admin-token-file refuses policy switches without the token: the benchmark says which
    flag to pass, and with --router-token-file it runs."""
    from kvshare.router.local import router

    token = tmp_path / "admin-token"
    token.write_text("bench-admin-token\n")
    served = router(stubs, "round-robin", "--admin-token-file", str(token)).start(ready_timeout_s=120)
    try:
        common = ("bench", "sessions", "--off", served.url, "--on", served.url, "--tokenizer", str(tiny_model),
                  "--contexts", "64", "--turns", "2", "--user-tokens", "16")
        result = _kvshare(*common, "--out", str(tmp_path / "refused"))
        assert result.returncode != 0 and "--router-token-file" in result.stdout + result.stderr
        result = _kvshare(*common, "--router-token-file", str(token), "--out", str(tmp_path / "ok"))
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        served.stop()


def test_piped_output_shows_progress_lines_and_whole_tables(stubs, tiny_model, tmp_path):
    """Not a terminal (CI, `| tee`): a line per step and per request as they happen, tables not cut at 80 columns,
    the drift check under the session tables, and where the report went."""
    urls, out = ",".join(stubs), tmp_path / "sessions"
    result = _kvshare("bench", "sessions", "--off", urls, "--on", urls, "--tokenizer", str(tiny_model),
                      "--contexts", "128", "--turns", "2", "--user-tokens", "16", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "starting the deployment" and lines[1].startswith("deployment ready: ")
    progress = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in progress] == [f"[{i}/8]" for i in range(1, 9)]
    assert "sessions alternate OFF 128: turn TTFT" in progress[0]
    assert "…" not in result.stdout and "after first tokens s" in result.stdout  # the last column's full header
    assert "Drift check:" in result.stdout and f"report: {out / 'report.md'}" in result.stdout
