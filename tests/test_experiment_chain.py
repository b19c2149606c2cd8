"""experiments/vllm_cross_replica.py as the H200 plan chains it (docs/results/h200-vllm/README.md): each call's
OUT/rows.jsonl is the next call's --previous. A call whose arms were all skipped must still leave a rows.jsonl (empty),
else the next call of the chain, made with no pause in between, would stop; a --previous that does not exist is one
line and exit 2, never a traceback. Runs no vLLM: a budget too small for any replica start skips every arm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments" / "vllm_cross_replica.py"


def harness():
    """The experiment as a module, for its pure parts (no vLLM, no processes)."""
    if str(EXPERIMENT.parent) not in sys.path:
        sys.path.insert(0, str(EXPERIMENT.parent))
    import vllm_cross_replica

    return vllm_cross_replica


def cpu_settings(xr, quantization: str = "none"):
    return xr.Settings("cpu", "/bin/false", Path("m"), "m", "float32", "dummy", 2048, 8, 0.9, 0, None, True, Path("w"),
                       quantization)


def experiment(*args: str) -> subprocess.CompletedProcess:
    # /bin/false as vLLM: no replica would start, and none is tried (the budget skips every start first).
    command = [sys.executable, str(EXPERIMENT), "--device", "cpu", "--vllm-python", "/bin/false", "--arms", "kvshare",
               "--lengths", "1024", "--reps", "1", "--budget", "30", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_call_whose_arms_were_all_skipped_still_chains(tmp_path):
    first = experiment("--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "first" / "rows.jsonl").read_text() == ""  # there, and empty
    assert json.loads((tmp_path / "first" / "summary.json").read_text())["skipped"]  # and it says what it skipped
    second = experiment("--previous", str(tmp_path / "first" / "rows.jsonl"), "--out", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr


def test_a_missing_previous_is_one_line(tmp_path):
    done = experiment("--previous", str(tmp_path / "nowhere.jsonl"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "nowhere.jsonl: no such file" in done.stderr.splitlines()[-1]


def test_a_bad_floor_rate_is_one_line(tmp_path):
    done = experiment("--gbps", "fast", "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--gbps 'fast'" in done.stderr.splitlines()[-1]


def test_the_report_names_the_weights_and_where_the_floor_rate_came_from(tmp_path):
    done = experiment("--quantization", "fp8", "--gbps", "50", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["quantization"], summary["gbps"], summary["gbps_source"]) == ("fp8", 50.0, "given")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "weights quantization fp8" in report and "50.0 GB/s (given)" in report


def test_answers_are_compared_only_with_a_reference_of_the_same_weights():
    """An fp8 replica's answer differs from a bf16 one's for reasons that have nothing to do with a cache: a bf16
    `none` row from an earlier call (rows before --quantization carry no field: bf16) must not be its reference."""
    xr = harness()
    bf16_ref = {"arm": "none", "role": "ref", "kind": "measured", "length": 1024, "repeat": 0, "error": ""}
    for quantization, expected in (("none", bf16_ref), ("fp8", None)):
        settings = cpu_settings(xr, quantization)
        run = xr.Run(None, settings, Path("out"), 0.0, previous=[bf16_ref])
        assert run.reference(1024, 0) is expected
    fp8_ref = {**bf16_ref, "quantization": "fp8"}
    run = xr.Run(None, settings, Path("out"), 0.0, previous=[bf16_ref, fp8_ref])
    assert run.reference(1024, 0) is fp8_ref


def test_the_auto_pool_fits_the_host_and_the_prompts_then_go_in_rounds(monkeypatch):
    """A pool larger than /dev/shm or the memory would refuse to start, losing the kvshare arm: auto takes what fits
    and pool_rounds splits the prompts (A stores a round, B loads it)."""
    xr = harness()
    gib = 1 << 30
    monkeypatch.setattr(xr, "available_memory", lambda: 40 * gib)
    monkeypatch.setattr(xr.os, "statvfs", lambda path: SimpleNamespace(f_bavail=64 * gib // 4096, f_frsize=4096))
    assert xr.auto_pool_bytes(10 * gib, 16 * gib) == int(10 * gib / 0.85) + (256 << 20)  # fits: all at once
    assert xr.auto_pool_bytes(100 * gib, 16 * gib) == 24 * gib  # memory less the replica's share
    assert xr.auto_pool_bytes(100 * gib, 40 * gib) == gib  # never below 1 GiB

    settings = cpu_settings(xr)
    args = type("Args", (), {"warmup_len": 0})()
    run = xr.Run(args, settings, Path("out"), 0.0, meta={"pool_bytes": 24 * gib, "kv_bytes_per_token": 1 << 18})
    cells = [(131072, 0), (131072, 1), (32768, 0)]  # 32, 32 and 8 GiB of K/V; 85% of 24 GiB holds 20.4 GiB
    assert xr.pool_rounds(run, cells) == [[(32768, 0)]]  # the 128k prompts cannot fit: skipped, saying why
    assert [s["what"] for s in run.skipped] == ["131072 tokens rep 0", "131072 tokens rep 1"]
    run = xr.Run(args, settings, Path("out"), 0.0, meta={"pool_bytes": 80 * gib, "kv_bytes_per_token": 1 << 18})
    assert xr.pool_rounds(run, cells) == [[(131072, 0), (131072, 1)], [(32768, 0)]]  # 85% of 80 GiB: 68 GiB
    monkeypatch.setattr(xr.os, "statvfs", lambda path: SimpleNamespace(f_bavail=10 * gib // 4096, f_frsize=4096))
    assert xr.auto_pool_bytes(100 * gib, 16 * gib) == 10 * gib  # /dev/shm's free space, when it is the smaller


def test_a_prompt_takes_whole_pages_in_the_pool():
    """The tiny model's chunk is 256 KiB of K/V but takes a 2 MiB page: sized by K/V bytes, a 1 GiB pool held one
    128k prompt of two (512 pages), and B's loads found nothing (evicted). The 32B shape's chunk is 32 whole pages."""
    xr = harness()
    mib = 1 << 20
    assert xr.pool_footprint(131072, 1024) == 513 * 2 * mib  # 512 chunks and one more, a page each
    assert xr.pool_footprint(131072, 1 << 18) == 513 * 64 * mib  # 64 MiB chunks: their K/V
    assert xr.pool_footprint(0, 1024) == 0
    settings = cpu_settings(xr)
    args = type("Args", (), {"warmup_len": 512})()
    run = xr.Run(args, settings, Path("out"), 0.0, meta={"pool_bytes": 1 << 30, "kv_bytes_per_token": 1024})
    assert xr.pool_rounds(run, [(131072, 0), (131072, 1)]) == []  # not even one fits 85% of 1 GiB: both skipped
    run = xr.Run(args, settings, Path("out"), 0.0, meta={"pool_bytes": 2 << 30, "kv_bytes_per_token": 1024})
    assert xr.pool_rounds(run, [(131072, 0), (131072, 1)]) == [[(131072, 0)], [(131072, 1)]]


def test_each_row_keeps_the_floor_of_the_machine_that_measured_it(tmp_path):
    """A chain's calls can land on different machines (a released machine comes back as a fresh one: session
    seventeen's calls measured 55.1, 55.2 and 51.4 GB/s). A row keeps its call's rate, and each cell's floor is its
    own rows' rate, not the last call's."""
    xr = harness()
    row = {"kind": "measured", "role": "B", "length": 131072, "repeat": 0, "ttft_s": 1.0, "error": "",
           "external_hit_tokens": 131056.0, "local_hit_tokens": 0.0, "exact": True, "first_token_equal": True}
    earlier = [{**row, "arm": "kvshare", "gbps": 55.2}, {**row, "arm": "none", "role": "ref", "exact": None}]
    meta = {"kv_bytes_per_token": 1 << 18, "gbps": 51.4}
    run = xr.Run(None, cpu_settings(xr), tmp_path, 0.0, previous=earlier, meta=meta)
    run.record({**row, "arm": "lmcache-mp"})
    assert json.loads((tmp_path / "rows.jsonl").read_text())["gbps"] == 51.4  # stamped with this call's rate
    floors = {c["arm"]: c["floor_s"] for c in xr.summarise(run)["cells"]}
    kv = 131072 * (1 << 18)
    assert floors == {"kvshare": kv / 55.2e9, "lmcache-mp": kv / 51.4e9, "none": kv / 51.4e9}  # none: no rate
    summary = {**meta, "gbps_source": "given", "cells": xr.summarise(run)["cells"]}
    assert xr.floor_rates(summary) == "the rate measured where each row ran (51.4, 55.2 GB/s; this call's 51.4 GB/s " \
        "(given))"
    assert xr.floor_rates({**summary, "cells": [c for c in summary["cells"] if c["arm"] != "kvshare"]}) == \
        "51.4 GB/s (given)"


def test_timed_hooks_are_read_per_request_and_summarised_per_cell(tmp_path):
    """--timed-hooks: a request's row holds the hook seconds its replica logged after the request began (summed by
    hook, earlier lines left out), and a cell takes each hook's median over its rows (a hook one row lacks counts 0)."""
    xr = harness()
    log = tmp_path / "vllm-kvshare-B.log"
    log.write_text("(EngineCore pid=7) WARNING 12-05 [timed_connector.py:33] kvshare-timing start_load_kv 9.0 pid=7\n")
    offset = xr.log_size(log)
    with open(log, "a") as f:
        f.write("(EngineCore pid=7) WARNING 12-05 [timed_connector.py:33] kvshare-timing start_load_kv 0.6800 pid=7\n"
                "(APIServer pid=5) INFO 12-05 POST /v1/completions\n"
                "(EngineCore pid=7) WARNING 12-05 [timed_connector.py:33] kvshare-timing "
                "get_num_new_matched_tokens 0.0120 pid=7\n"
                "(EngineCore pid=7) WARNING 12-05 [timed_connector.py:33] kvshare-timing start_load_kv 0.0050 pid=7\n")
    hooks = xr.hook_seconds(log, offset)
    assert hooks == {"start_load_kv": 0.685, "get_num_new_matched_tokens": 0.012}
    assert xr.hook_seconds(tmp_path / "gone.log", 0) == {}
    rows = [{"kvshare_hooks": hooks}, {"kvshare_hooks": {"start_load_kv": 0.705}}, {"other": 1}]
    assert xr.median_hooks(rows) == pytest.approx({"get_num_new_matched_tokens": 0.006, "start_load_kv": 0.695})


@pytest.mark.parametrize("variant, says", [("Waves=2", "NAME=JSON with NAME of 1-16"),
                                           ("waves2={load_waves: 2}", "its JSON does not parse"),
                                           ("waves2=[2]", "a non-empty JSON object")])
def test_a_bad_b_variant_is_one_line(tmp_path, variant, says):
    done = experiment("--b-variant", variant, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and says in done.stderr.splitlines()[-1]


def test_a_b_variant_without_the_kvshare_arm_is_one_line(tmp_path):
    done = experiment("--b-variant", "waves2={\"load_waves\": 2}", "--arms", "none", "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "add kvshare to --arms" in done.stderr.splitlines()[-1]


def test_a_b_variant_is_a_cell_of_its_own_and_a_load(tmp_path):
    """--b-variant NAME=JSON: its replica's rows (role B-NAME) make a cell of their own next to kvshare B's, are loads
    for the request estimate and the timeline table, and its replica runs B's config with the JSON merged in."""
    xr = harness()
    row = {"kind": "measured", "arm": "kvshare", "length": 131072, "repeat": 0, "error": "", "latency_s": 1.0,
           "external_hit_tokens": 131056.0, "local_hit_tokens": 0.0, "exact": True, "first_token_equal": True,
           "vllm_ttft_s": 0.9}
    rows = [{**row, "role": "B", "ttft_s": 1.0}, {**row, "role": "B-waves2", "ttft_s": 0.9, "latency_s": 1.5},
            {**row, "role": "A", "ttft_s": 30.0, "latency_s": 30.0}]
    args = SimpleNamespace(b_variant=[("waves2", {"load_waves": 2})], start_estimate=90)
    run = xr.Run(args, cpu_settings(xr), tmp_path, 0.0, previous=rows, meta={"kv_bytes_per_token": 1 << 18,
                                                                               "gbps": 55.2, "kv_transfer_config": {}})
    cells = {c["role"]: c for c in xr.summarise(run)["cells"]}
    assert [c for c in cells] == ["B", "B-waves2", "A"]  # the variant right after B
    assert (cells["B"]["median_ttft_s"], cells["B-waves2"]["median_ttft_s"]) == (1.0, 0.9)
    assert run.request_estimate(131072, True) == pytest.approx(1.8)  # the variant's load (1.5 s) is a load
    assert "B-waves2" in xr.timeline_table({"cells": list(cells.values())})
    config = {"kv_connector": "KVShareConnector", "kv_connector_extra_config": {"pool": "p", "load_waves": 1}}
    [(role, variant)] = xr.variant_configs(run, config)
    assert role == "B-waves2" and variant["kv_connector_extra_config"] == {"pool": "p", "load_waves": 2}
    assert config["kv_connector_extra_config"]["load_waves"] == 1  # B's own config untouched
