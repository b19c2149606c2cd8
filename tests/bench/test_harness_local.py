"""The harness end to end in --local mode on the tiny model: a real pool, real `kvshare serve` replicas and router.

Checks the mechanism, not timing: ON measured requests load their document from the pool, OFF ones compute it;
validate service finds equal greedy answers; a length beyond the model's limit stops with a clear message."""

import json
import subprocess
import sys

import pytest

from kvshare.bench.rows import read_rows

pytestmark = pytest.mark.slow


def _kvshare(*args):
    return subprocess.run([sys.executable, "-m", "kvshare.cli", *args], capture_output=True, text=True, timeout=600)


def _local(tiny_model):
    return ("--local", str(tiny_model), "--threads", "1", "--pool-size", "256MiB")


def test_cross_replica_and_sessions_on_local_replicas(tiny_model, tmp_path):
    out = tmp_path / "cross"
    result = _kvshare("bench", "cross-replica", *_local(tiny_model), "--lengths", "256,512", "--per-block", "1",
                      "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    measured = [r for r in read_rows(out / "requests.jsonl") if r.kind == "measured"]
    assert len(measured) == 8
    for row in measured:
        if row.arm == "ON":
            assert row.pool_hit_tokens == row.length, row  # the whole document came from the pool
        else:
            assert row.cached_tokens == 0 and row.pool_hit_tokens == 0, row
    assert (out / "report.md").exists() and (out / "ttft_vs_length.png").exists()

    out = tmp_path / "sessions"
    result = _kvshare("bench", "sessions", *_local(tiny_model), "--contexts", "512", "--turns", "3",
                      "--user-tokens", "32", "--answer-tokens", "8", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    turns = [r for r in read_rows(out / "requests.jsonl") if r.kind == "turn"]
    assert len(turns) == 12
    alternate_on = [r for r in turns if r.arm == "ON" and r.placement == "alternate"]
    assert len({r.replica for r in alternate_on}) == 2  # the router alternated
    # B loads turn 1 (computed on A) from the pool
    assert all(r.pool_hit_tokens > 0 for r in alternate_on if r.turn == 2)


def test_validate_service_passes_on_local_replicas(tiny_model, tmp_path):
    result = _kvshare("validate", "service", *_local(tiny_model), "--prompts", "2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = json.loads((tmp_path / "service.json").read_text())
    assert all(check["equal"] for check in verdict["checks"]) and len(verdict["checks"]) == 2


def test_a_length_beyond_the_model_limit_is_a_clear_error(tiny_model, tmp_path):
    result = _kvshare("bench", "cross-replica", *_local(tiny_model), "--lengths", "64k", "--per-block", "1",
                      "--out", str(tmp_path))
    assert result.returncode == 1
    assert "limit" in result.stdout + result.stderr
    assert "Partial report" in (tmp_path / "report.md").read_text()
