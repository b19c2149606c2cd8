"""`kvshare advise` as a user runs it: a report from given rates, the same report again from its saved inputs, a
calibration against a real replica, and one-line errors for missing or malformed inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshare.processes import ServerProcess, free_port, kvshare_argv

H200 = ["--prefill", "8k:1.031,32k:4.932,128k:35.540,255k:114.509", "--kv-bytes-per-token", "262144",
        "--load-gb-s", "55.2", "--l2-gb-s", "0.5", "--pool-fixed-ms", "60"]


def _advise(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshare.cli", "advise", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_report_from_given_rates_and_again_from_its_saved_inputs(tmp_path):
    done = _advise(*H200, "--sessions", "32k:6:256:32:3,128k:6:256:32", "--out", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "a" / "advise.json").read_text())
    (point,) = report["break_even_l2"]  # at 0.5 GB/s L2 pays only for very long prompts
    assert 200_000 < point < 1_000_000
    assert report["lengths"][-1]["best"] == "pool" and report["mix_gain"]["fixed"] == pytest.approx(0, abs=1e-9)
    assert report["mix_gain"]["alternate"] > 0.1
    assert "L2 hit vs recompute" in done.stdout and (tmp_path / "a" / "advise.png").stat().st_size > 0

    again = _advise("--inputs", str(tmp_path / "a" / "advise-inputs.json"), "--sessions",
                    "32k:6:256:32:3,128k:6:256:32", "--out", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr
    second = json.loads((tmp_path / "b" / "advise.json").read_text())
    assert second["lengths"] == report["lengths"] and second["break_even_l2"] == report["break_even_l2"]

    faster_l2 = _advise("--inputs", str(tmp_path / "a" / "advise-inputs.json"), "--l2-gb-s", "5", "--out",
                        str(tmp_path / "c"))
    assert faster_l2.returncode == 0, faster_l2.stderr
    third = json.loads((tmp_path / "c" / "advise.json").read_text())
    assert third["inputs"]["sources"]["l2_gb_s"] == "--l2-gb-s"  # a flag overrides the saved value
    assert not third["break_even_l2"] or third["break_even_l2"][0] < point


@pytest.mark.parametrize("args, message", [
    (["--kv-bytes-per-token", "1000", "--load-gb-s", "1"], "missing inputs"),
    ([*H200, "--prefill", "8k-1.0"], "--prefill item"),
    ([*H200, "--sessions", "32k:six:256:32"], "--sessions item"),
    ([*H200, "--policies", "random"], "--policies"),
])
def test_bad_inputs_get_one_line_and_no_traceback(args, message):
    done = _advise(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_calibration_against_a_real_replica(tmp_path, tiny_model):
    port = free_port()
    with ServerProcess(kvshare_argv("serve", "--model", str(tiny_model), "--port", str(port), "--threads", "1"),
                       port, "replica") as replica:
        done = _advise("--replica", replica.url, "--calibrate-lengths", "64,512", "--calibrate-repeats", "2",
                       "--model-dir", str(tiny_model), "--load-gb-s", "2", "--l2-gb-s", "0.5", "--out",
                       str(tmp_path / "out"), timeout=300)
    assert done.returncode == 0, done.stderr
    inputs = json.loads((tmp_path / "out" / "advise-inputs.json").read_text())
    assert [n for n, _, _ in inputs["prefill"]] == [64, 512]
    assert all(seconds > 0 for _, _, seconds in inputs["prefill"])
    assert replica.url in inputs["sources"]["prefill"]
    assert inputs["kv_bytes_per_token"] == 2 * 2 * 32 * 2 * 4  # tiny: 2 layers, 2 KV heads of 32, float32
