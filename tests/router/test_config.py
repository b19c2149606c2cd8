"""Configuration and command line: replica lists from flags and files, and errors that say what to do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshare.bench.router_overhead import request_body, run_overhead_bench
from kvshare.router.config import RouterConfig, read_replicas_file


def test_replicas_file_skips_comments_and_blanks(tmp_path):
    path = tmp_path / "replicas.txt"
    path.write_text("# two replicas\nhttp://127.0.0.1:8001/\n\n  http://127.0.0.1:8002\n")
    assert read_replicas_file(path) == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize(
    "replicas, message",
    [((), "--replica URL"), (("127.0.0.1:8001",), "http://"), (("http://a:1", "http://a:1"), "listed twice")],
)
def test_bad_replica_lists_are_refused_with_a_hint(replicas, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(replicas)


def test_route_without_replicas_exits_2_with_the_fix():
    result = subprocess.run([sys.executable, "-m", "kvshare.cli", "route"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--replica URL" in result.stderr


@pytest.mark.parametrize("prompt_tokens, prompt_words", [(0, '"hello"'), (5000, "5,000 token ids")])
def test_overhead_bench_writes_json_and_markdown(tmp_path, prompt_tokens, prompt_words):
    path = tmp_path / "overhead.json"
    # the exit code is timing: not asserted
    run_overhead_bench(requests=4, first_token_delay_ms=1.0, json_path=str(path), prompt_tokens=prompt_tokens)
    report = json.loads(path.read_text())
    assert len(report["samples_ms"]["direct"]) == len(report["samples_ms"]["routed"]) == 4
    assert set(report["overhead"]) >= {"median_ms", "p10_ms", "p90_ms", "iqr_ms"}
    assert report["setup"]["prompt_tokens"] == prompt_tokens
    markdown = path.with_suffix(".md").read_text()
    assert "| routed |" in markdown and f"The prompt: {prompt_words}" in markdown


def test_overhead_bench_sends_the_asked_number_of_ids():
    prompt = json.loads(request_body(131_072))["prompt"]
    assert len(prompt) == 131_072 and all(isinstance(t, int) and 0 <= t < 150_000 for t in prompt)
    assert json.loads(request_body(0))["prompt"] == "hello"
