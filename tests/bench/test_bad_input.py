"""Bad input through the real CLI: unreachable endpoints and bad flags give clear errors, a partial report, rc != 0."""

import json
import subprocess
import sys

from kvshare.processes import free_port


def _kvshare(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvshare.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_unreachable_endpoint_gives_a_clear_error_and_a_partial_report(tiny_model, tmp_path):
    dead = ",".join(f"http://127.0.0.1:{free_port()}" for _ in range(2))
    out = tmp_path / "run"
    result = _kvshare("bench", "cross-replica", "--off", dead, "--on", dead, "--tokenizer", str(tiny_model),
                      "--lengths", "256", "--per-block", "1", "--out", str(out))
    assert result.returncode == 1
    assert "cannot reach" in result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "cannot reach" in summary["run"]["error"]
    assert "Partial report" in (out / "report.md").read_text()
    assert (out / "requests.jsonl").exists()


def test_bad_flags_are_refused_before_anything_starts(tiny_model, tmp_path):
    result = _kvshare("bench", "sessions", "--tokenizer", str(tiny_model), "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "no deployment" in result.stderr
    result = _kvshare("bench", "cross-replica", "--local", str(tmp_path / "missing"), "--lengths", "1k")
    assert result.returncode == 2 and "make-model" in result.stderr
    result = _kvshare("bench", "cross-replica", "--off", "a,b", "--on", "c,d", "--tokenizer", str(tiny_model))
    assert result.returncode == 2 and "cannot read endpoints" in result.stderr
    # A local pool whose per-client lease limit (half the arena) cannot hold the longest prompt's KV: ON would
    # quietly recompute most of it, so the run is refused with the size that works.
    result = _kvshare("bench", "cross-replica", "--local", str(tiny_model), "--lengths", "512", "--pool-size", "8MiB",
                      "--chunk-tokens", "32", "--out", str(tmp_path / "y"))
    assert result.returncode == 2 and "--pool-size" in result.stderr and "half the arena" in result.stderr, \
        result.stderr
    assert not (tmp_path / "y" / "logs").exists()  # nothing was started

