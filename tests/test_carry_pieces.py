"""scripts/carry_vllm.py's packing: every device call carries at most its budget, the calls number no more than the
pieces' bytes need (a call more costs device time and, on a machine released after ~30 s idle, a chance to lose the
pieces carried so far), and a split wheel's parts put back in order are the wheel, byte for byte."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def carry_module(repo: Path):
    spec = importlib.util.spec_from_file_location("carry_vllm_under_test", ROOT / "scripts" / "carry_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.REPO = repo  # its pieces and wheels go under tmp_path, never into the checkout
    return module


def wheel(path: Path, size: int, rng: random.Random) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rng.randbytes(size))
    return path


def test_pieces_fill_the_calls_and_reassemble_exactly(tmp_path):
    carry, rng, budget = carry_module(tmp_path), random.Random(0), 1 * MIB
    wheels_dir = tmp_path / carry.WHEELS
    # vLLM's wheel is 5.25 budgets, as 289.6 MiB is of 55.2 MiB; beside it one large and a few small dependencies.
    vllm = wheel(wheels_dir / "vllm.whl", 5 * budget + budget // 4, rng)
    deps = [wheel(wheels_dir / f"dep{i}.whl", size, rng)
            for i, size in enumerate([budget - 10 * 1024, 60 * 1024, 40 * 1024, 30 * 1024])]
    listed = [{"file": d.name, "size": d.stat().st_size} for d in deps]
    pieces = carry.plan_pieces(vllm, listed, budget)
    calls = carry.plan_calls(pieces, budget)
    by_n = {p["n"]: p for p in pieces}
    assert all(sum(by_n[n]["size"] for n in call) <= budget for call in calls)
    assert sorted(n for call in calls for n in call) == sorted(by_n)
    assert len(calls) == math.ceil(sum(p["size"] for p in pieces) / budget) == 7  # equal parts took 8
    parts = sorted((p for p in pieces if p["kind"] == "part" and p["of"] == vllm.name), key=lambda p: p["index"])
    joined = b"".join((tmp_path / carry.PIECES / p["file"]).read_bytes() for p in parts)
    assert joined == vllm.read_bytes()
