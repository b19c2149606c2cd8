"""Reports from rows: summary.json, report.md and plots exist and hold the rows; a partial run is marked partial."""

import json

from kvshare.bench import cross_replica, report, sessions
from kvshare.bench.rows import RequestRow, RowWriter, read_rows
from kvshare.bench.sessions import SessionsConfig

LENGTHS = (("1k", 1024), ("2k", 2048))


def _cross_rows():
    rows = []
    for block, arm in (("OFF1", "OFF"), ("ON1", "ON"), ("ON2", "ON"), ("OFF2", "OFF")):
        for label, tokens in LENGTHS:
            for i in range(3):
                ttft = tokens / 1000 * (1.0 if arm == "OFF" else 0.1) + i * 0.01
                rows.append(RequestRow(bench="cross-replica", kind="measured", arm=arm, block=block, url="http://b",
                                       started_at=0.0, length_label=label, length=tokens, ttft_s=ttft,
                                       latency_s=ttft + 0.1, pool_hit_tokens=tokens if arm == "ON" else 0))
    return rows


def _session_rows():
    rows = []
    for arm in ("OFF", "ON"):
        for placement in ("alternate", "fixed"):
            for turn in range(1, 4):
                rows.append(RequestRow(bench="sessions", kind="turn", arm=arm, placement=placement, url="http://r",
                                       started_at=0.0, session=f"{arm}-{placement}", turn=turn, length_label="1k",
                                       ttft_s=0.5 if arm == "ON" and turn > 1 else 1.0, latency_s=2.0))
    return rows


def test_summary_and_report_files_hold_the_measured_rows(tmp_path):
    rows = _cross_rows() + _session_rows()
    with RowWriter(tmp_path / "requests.jsonl") as writer:
        for row in rows:
            writer.write(row)
    assert read_rows(tmp_path / "requests.jsonl") == rows
    cross = cross_replica.summarize(rows, LENGTHS)
    sess = sessions.summarize(rows, SessionsConfig(contexts=(("1k", 1024),), turns=3))
    info = report.RunInfo("t", "kvshare bench x", report.machine_description(), "here", 0.0, 1.0)
    files = report.write_report(tmp_path, info, rows, cross, sess)
    assert {f.name for f in files} == {"summary.json", "report.md", "ttft_vs_length.png", "session_turns.png"}
    assert all(f.stat().st_size > 0 for f in files)
    summary = json.loads((tmp_path / "summary.json").read_text())
    first = summary["cross_replica"]["lengths"][0]
    assert summary["rows"] == len(rows) and summary["cross_replica"]["measured_requests"] == 24
    assert first["comparison"]["off"]["n"] == 6 and first["comparison"]["on"]["median"] == 0.1124
    assert abs(first["comparison"]["speedup"] - 1.034 / 0.1124) < 1e-9
    markdown = (tmp_path / "report.md").read_text()
    assert "kvshare bench x" in markdown and "OFF1:ON1" in markdown and "Partial" not in markdown
    gains = {g["placement"]: g for g in summary["sessions"]["gains"]}
    assert gains["alternate"]["off_total_s"] == 6.0
    on = next(c for c in summary["sessions"]["conditions"] if c["arm"] == "ON" and c["placement"] == "fixed")
    assert (on["ttft_sum_s"], on["after_first_token_s"]) == (2.0, 4.0)  # TTFTs 1 + 0.5 + 0.5; latencies 3 x 2.0
    assert "| 1k | fixed | ON | 1 | 1.000, 0.500, 0.500 | 6.000 [6.000, 6.000] | 2.000 | 4.000 |" in markdown


def test_partial_report_marks_the_error_and_keeps_nan_as_null(tmp_path):
    rows = _cross_rows()[:2]
    info = report.RunInfo("t", "cmd", "m", "d", 0.0, 1.0, error="cannot reach http://b")
    report.write_report(tmp_path, info, rows, cross_replica.summarize(rows, LENGTHS), None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["error"] == "cannot reach http://b"
    assert summary["cross_replica"]["lengths"][0]["comparison"]["on"]["median"] is None
    assert "Partial report" in (tmp_path / "report.md").read_text()


def _drifted_sessions():
    """alternate: turn 1 equal in both arms; fixed: turn 1 took 1.8x as long OFF as ON (the machine slowed down)."""
    rows = []
    for arm in ("OFF", "ON"):
        for placement in ("alternate", "fixed"):
            for turn in range(1, 4):
                first = 1.8 if (arm, placement) == ("OFF", "fixed") else 1.0
                ttft = first if turn == 1 else (0.5 if arm == "ON" else 1.0)
                rows.append(RequestRow(bench="sessions", kind="turn", arm=arm, placement=placement, url="http://r",
                                       started_at=0.0, session=f"{arm}-{placement}", turn=turn, length_label="1k",
                                       ttft_s=ttft, latency_s=ttft + 1.0))
    return sessions.summarize(rows, SessionsConfig(contexts=(("1k", 1024),), turns=3))


def test_the_drift_check_names_the_rows_it_discredits():
    note = report.drift_note(_drifted_sessions())
    assert "1k alternate 1.00; 1k fixed 1.80" in note
    assert "Here 1k fixed drifted beyond 1.2x" in note


def test_the_demo_explanation_carries_the_drift_warning():
    from kvshare.bench.demo import explanation
    from kvshare.bench.runner import Outcome

    info = report.RunInfo("t", "cmd", "m", "d", 0.0, 1.0)
    lines = explanation(Outcome([], None, _drifted_sessions(), info, []))
    fixed = next(line for line in lines if "1k, fixed" in line)
    alternate = next(line for line in lines if "1k, alternate" in line)
    assert "Not trustworthy: turn 1, the same work in both arms, took 1.80x as long OFF as ON" in fixed
    assert "trustworthy" not in alternate


def test_the_printed_summary_is_whole_when_piped_and_carries_the_drift_check():
    """Not a terminal (a pipe, a file): every cell in full, however wide the tables; the drift check below them."""
    import io

    rows = _cross_rows()
    cross = cross_replica.summarize(rows, LENGTHS)
    out = io.StringIO()
    console = report.summary_console(file=out)
    assert not console.is_terminal and console.width == report.PIPED_WIDTH
    info = report.RunInfo("t", "cmd", "m", "d", 0.0, 1.0)
    report.print_summary(info, cross, _drifted_sessions(), console=console)
    text = out.getvalue()
    assert "…" not in text
    for row in report.cross_rows(cross) + report.turn_rows(_drifted_sessions()):
        assert all(cell in text for cell in row), row
    assert "Drift check:" in " ".join(text.split()) and "1k fixed drifted" in " ".join(text.split())


def test_the_printed_summary_fits_a_narrow_terminal_by_wrapping_cells():
    """A terminal 60 columns wide: no line is wider, and no cell is cut to an ellipsis."""
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=60, force_terminal=True, color_system=None)
    rows = _cross_rows()
    report.print_summary(report.RunInfo("t", "cmd", "m", "d", 0.0, 1.0), cross_replica.summarize(rows, LENGTHS),
                         None, console=console)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 60 and "…" not in text
