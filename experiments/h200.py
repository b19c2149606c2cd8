"""The one runner for work on the H200 host: a call is a list of steps, each a command with its own time limit, its
output kept whole under $OUT/<step>.txt and only a filtered tail printed (the device returns the last 12,000
characters). A past run is a named recipe, so every command in docs/results/h200/NOTES.md still reproduces its run:

    python3 experiments/h200.py run29                       # the steps run 29 ran (was experiments/h200_run29.sh)
    python3 experiments/h200.py --list                      # every recipe and its steps
    python3 experiments/h200.py --step "tests 100 tests/engine/test_hybrid_cuda.py" \\
        --step "cross 470 --preset qwen3.5-27b --chunk-tokens 4096 --lengths 131072 --blocks ON1,OFF1"

A step is "KIND SECONDS ARGS...": KIND names the program (below), SECONDS bounds it, ARGS go to it (`{out}` is
replaced with the step's folder under $OUT, `{budget}` with SECONDS minus 10 for programs that end themselves).
Before the first step the carried wheels (.whl/, scripts/gather-wheels.sh) are installed beside the host's torch
and the import path set, as every run did. A step's failure or time-out is printed and the next step runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# KIND -> (the program, the regex of output lines to print, how many of them at most). Lines not printed are kept.
KINDS = {
    "tests": (["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider"], r"passed|failed|error|skipped", 8),
    "engine-tests": (["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "tests/engine"],
                     r"passed|failed|error", 3),
    "info": (["bash", "-c", "nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader; "
              "python3 -c \"import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, "
              "'triton', triton.__version__)\"; free -g | head -2; df -h /dev/shm | tail -1"], r".", 8),
    "floor": (["python3", "experiments/h200_floor.py"], r".", 12),
    "validate": (["python3", "-m", "kvshare", "validate", "transfer", "--device", "cuda"], r".", 6),
    "tail": (["python3", "experiments/h200_tail_profile.py", "run"], r"^  [AB] |^\||^pool copies|^==", 40),
    "cross": (["python3", "experiments/h200_cross_replica.py", "run"], r"TTFT|warm-up|^ +\d+ |regression|^==|pool ",
              40),
    "decode": (["python3", "experiments/h200_served_decode.py"], r"^(?!.*prompt [0-9]:)", 14),
    "breakdown": (["python3", "experiments/h200_decode_breakdown.py"], r"^(?!.*Warning)", 14),
    "paged-kernel": (["python3", "experiments/h200_paged_kernel.py"], r".", 14),
    "tail-local": (["python3", "experiments/h200_tail_local.py"], r"^(?!.*[Ww]arn)", 17),
    "run12-probe": (["python3", "experiments/h200_run12.py", "run"], r".", 30),
    # vLLM 0.26 once scripts/carry-vllm.sh brought it (docs/vllm-on-h200.md): its own import path, ahead of /tmp/site,
    # whose FastAPI is past vLLM's pin
    "vllm": (["bash", "-c", 'bash scripts/carry-vllm.sh install && PYTHONPATH=/tmp/vllm-site:. '
              'exec python3 experiments/vllm_cross_replica.py "$@"', "vllm"], r"^\||TTFT|skipped|failed|error", 30),
    "run13-probe": (["python3", "experiments/h200_run13.py", "run"], r".", 30),
    "store-load": (["python3", "experiments/h200_store_under_load.py"], r"^\||chunks", 10),
    "load-layers": (["python3", "experiments/h200_load_layers.py"], r"^\||chunks", 8),
}

TAIL128 = "--settle 14 --length 131072 --max-model-len 135168"
# Each recorded run: the steps its script ran, in order, with its limits (the scripts' defaults).
RECIPES = {
    "run12": ["info 10", "tests 100 -m 'not slow' tests/transfer tests/engine",
              "run12-probe 390 --out {out} --budget {budget}"],
    "run13": ["info 10", "tests 60 tests/transfer/test_register_via.py tests/transfer/test_register_pieces.py",
              "run13-probe 270 --out {out} --budget {budget}", "tail 210 --out {out} --budget {budget}"],
    "run18": ["info 10", "tests 120 -m 'not slow' tests/engine",
              "paged-kernel 150 --out {out}/paged_kernel.json --budget 120",
              "decode 210 --out {out} --budget 190"],
    "run19": ["breakdown 100 --out {out}/breakdown.json", "floor 60",
              f"tail 410 --out {{out}} --budget 400 {TAIL128} --pool-size 100GiB --arms fp8,bf16 --plain"],
    "run20": ["tests 100 -m 'not slow' tests/engine", "decode 110 --out {out} --arms graphs,eager-torch --budget 100",
              "floor 60",
              f"tail 300 --out {{out}} --budget 290 {TAIL128} --pool-size 100GiB --arms bf16,fp8 --docs 2 --plain"],
    "run21": ["tests 60 tests/engine/test_fused_ops.py tests/engine/test_paged_attention.py",
              "tail-local 100 --length 131072 --out {out}/local.json",
              f"tail 180 --out {{out}} --budget 170 {TAIL128} --pool-size 72GiB --arms fp8 --docs 2 --plain"],
    "run22": ["tests 130 -m 'not slow' tests/transfer/test_transfer_cuda.py tests/transfer/test_waves.py tests/engine",
              "validate 60 --trials 20 --json {out}/validate.json", "floor 40",
              f"tail 310 --out {{out}} --budget 300 {TAIL128} --pool-size 72GiB --arms bf16,fp8 --docs 2 --plain "
              "--waves 1,2,4,8"],
    "run23": ["floor 60", "tail 530 --out {out} --budget 520 --settle 14 --length 258048 --max-model-len 262144 "
              "--pool-size 72GiB --arms fp8,bf16 --docs 1 --plain --waves 1,2"],
    "run24": ["cross 330 --lengths 32768 --reps 3 --max-model-len 40960 --pool-size 48GiB --regression-len 0 "
              "--out {out}", "decode 110 --out {out} --arms graphs,eager-torch --budget 100"],
    "run26": ["tests 130 -m 'not slow' tests/engine",
              f"tail 390 --out {{out}} --budget 380 {TAIL128} --pool-size 72GiB --arms bf16,fp8 --docs 2 --plain "
              "--waves 1,2"],
    "run27": [f"tail 260 --out {{out}} --budget 250 {TAIL128} --pool-size 72GiB --arms bf16 --docs 2 --waves 1,2 "
              "--timeline",
              "cross 300 --lengths 32768 --reps 3 --max-model-len 40960 --pool-size 48GiB --regression-len 0 "
              "--out {out}"],
    "run28": ["engine-tests 130",
              f"tail 410 --out {{out}} --budget 400 {TAIL128} --pool-size 72GiB --arms bf16,fp8 --docs 3 "
              "--waves 1,2,3 --timeline"],
    "run29": ["engine-tests 130",
              f"tail 390 --out {{out}} --budget 380 {TAIL128} --pool-size 72GiB --arms bf16,fp8 --docs 2 "
              "--waves 1,2,3 --plain"],
    "run31": ["tests 100 -s tests/engine/test_hybrid_cuda.py tests/engine/test_hybrid_model.py",
              "cross 470 --preset qwen3.5-27b --chunk-tokens 4096 --kv-cache-memory 20GiB --pool-size 64GiB "
              "--lengths 131072,262144 --reps 1,1 --blocks ON1,OFF1 --questions 3 --warmup-len 8192 --out {out}"],
    # run 32 was planned with 262,144 tokens (over --max-model-len once the 64-token question is added) and never
    # ran; run 33 is what ran: fp8 at 131,072 and 258,048 tokens, with the GPU negative control.
    "run33": ["cross 575 --preset qwen3.5-27b --chunk-tokens 4096 --kv-cache-memory 20GiB --pool-size 64GiB "
              "--kv-cache-dtype fp8 --lengths 131072,258048 --reps 1,1 --blocks ON1,OFF1 --questions 3 "
              "--warmup-len 8192 --negative-control --out {out}"],
}


@dataclass
class Step:
    kind: str
    seconds: int
    args: list[str]

    @classmethod
    def parse(cls, text: str) -> Step:
        kind, seconds, *args = shlex.split(text)
        if kind not in KINDS:
            raise SystemExit(f"unknown step kind {kind!r}: one of {', '.join(KINDS)}")
        return cls(kind, int(seconds), args)


def setup() -> dict[str, str]:
    """The carried wheels installed into /tmp/site (beside the host's torch); the environment every step runs in."""
    wheels = sorted(Path(".whl").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *map(str, wheels)], check=False)
    return {**os.environ, "PYTHONPATH": "/tmp/site:.:experiments", "PYTHONUNBUFFERED": "1",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def run_step(index: int, step: Step, out: Path, env: dict[str, str], started: float) -> None:
    """One step under its limit (SIGTERM, then SIGKILL 10 s later), its whole output in OUT/<n>-<kind>.txt."""
    program, show, lines = KINDS[step.kind]
    folder = out / f"{index}-{step.kind}"
    args = [a.replace("{out}", str(folder)).replace("{budget}", str(max(step.seconds - 10, 1))) for a in step.args]
    folder.mkdir(parents=True, exist_ok=True)
    log = out / f"{index}-{step.kind}.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen(program + args, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=step.seconds)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            code = f"timed out ({step.seconds} s)"
    keep = re.compile(show)
    printed = [line for line in log.read_text(errors="replace").splitlines() if keep.search(line)][-lines:]
    print(f"== {index} {step.kind} {' '.join(args)[:150]}", *printed, sep="\n")
    print(f"== {index} {step.kind}: exit {code} at {time.monotonic() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", choices=sorted(RECIPES), help="a recorded run's steps")
    parser.add_argument("--step", action="append", default=[], help='"KIND SECONDS ARGS..." (after the recipe\'s)')
    parser.add_argument("--out", default=os.environ.get("OUT", "out/h200"), help="results folder (default: $OUT)")
    parser.add_argument("--list", action="store_true", help="print every recipe's steps and exit")
    ns = parser.parse_args()
    if ns.list:
        for name, steps in RECIPES.items():
            print(name, *(f"  {s}" for s in steps), sep="\n")
        return
    steps = [Step.parse(s) for s in (RECIPES[ns.recipe] if ns.recipe else []) + ns.step]
    if not steps:
        parser.error("name a recipe or give --step")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = setup()
    for index, step in enumerate(steps, start=1):
        run_step(index, step, out, env, started)


if __name__ == "__main__":
    main()
