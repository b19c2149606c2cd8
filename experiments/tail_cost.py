"""What a prompt's tail costs the control plane (issue 24): LOOKUP keys, pool chunks and pages per prompt, and the
time of ConnectorCore.find() and store() against a real pool, with whole chunks only vs full chunks plus one tail.

The KV layout is deliberately small (2 layers, 2 KV heads of 32, fp32, 16-token blocks, 256-token chunks) so that a
256k-token prompt fits a 512 MiB arena on the 2-core machine: the figures are the per-prompt bookkeeping (keys,
hashing, LOOKUP/RESERVE/COMMIT round trips, page counts), not copy bandwidth. Each prompt is fresh; each figure is
the median of `--repeats` prompts.

    .venv/bin/python experiments/tail_cost.py --out docs/results/connectors-cpu/tail-cost
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from kvshare.connector import ConnectorConfig, ConnectorCore
from kvshare.keys import Namespace
from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout

BLOCK, CHUNK = 16, 256
LENGTHS = (1000, 8100, 32100, 256100)  # each leaves a tail of whole blocks after its full chunks


def make_core(address: str, layout: KVLayout, kv: list[torch.Tensor], tails: bool) -> ConnectorCore:
    namespace = Namespace("tail-cost", "float32", layout.layout_id(), CHUNK, salt="tails" if tails else "chunks")
    core = ConnectorCore(ConnectorConfig(address=address, chunk_tokens=CHUNK), namespace,
                         BLOCK if tails else None)
    core.attach(layout, kv)
    return core


def measure(core: ConnectorCore, address: str, length: int, rng: random.Random) -> dict:
    """Store a fresh prompt, then find it: keys asked, chunks and pages added, seconds of each call."""
    prompt = [rng.randrange(3, 30000) for _ in range(length)]
    blocks = list(range(-(-length // BLOCK)))
    before = read_stats(address)
    started = time.perf_counter()
    handle = core.store(prompt, blocks, 0, tail=True)
    while handle is not None and not handle.done():
        time.sleep(0.0005)
    stored = time.perf_counter() - started
    core.flush()
    after = read_stats(address)
    started = time.perf_counter()
    hit = core.find(prompt, 0)
    found = time.perf_counter() - started
    core.release_hit(hit)
    keys = len(core.prompt_plan(prompt, tail=core.block_tokens < CHUNK)[1])
    return {"length": length, "keys": keys, "chunks": after.chunks - before.chunks,
            "pages": after.pages_used - before.pages_used, "hit_tokens": hit.end if hit else 0,
            "store_s": stored, "find_s": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layout = KVLayout(num_layers=2, num_blocks=max(LENGTHS) // BLOCK + 1, block_size=BLOCK, num_kv_heads=2,
                      head_size=32, dtype=torch.float32)
    kv = [torch.randn(layout.tensor_shape) for _ in range(layout.num_layers)]
    rng = random.Random(0)
    rows = []
    with start_pool("1GiB", page_size="256KiB", check_integrity=False) as (address, _):
        cores = {tails: make_core(address, layout, kv, tails) for tails in (False, True)}
        for length in LENGTHS:
            for _ in range(args.repeats):
                for tails in (False, True):  # interleaved
                    rows.append({"tails": tails, **measure(cores[tails], address, length, rng)})
        for core in cores.values():
            core.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    lines = ["# A prompt's tail: LOOKUP and store cost", "", f"Command: `python experiments/tail_cost.py --out "
             f"{args.out} --repeats {args.repeats}`; {args.repeats} fresh prompts per cell, medians; 16-token blocks, "
             "256-token chunks, 256 KiB pages.", "",
             "| prompt tokens | arm | LOOKUP keys | chunks stored | pages | tokens found | store ms | find ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for length in LENGTHS:
        for tails in (False, True):
            cell = [r for r in rows if r["length"] == length and r["tails"] == tails]
            med = {k: statistics.median(r[k] for r in cell) for k in ("store_s", "find_s")}
            r = cell[0]
            lines.append(f"| {length} | {'chunks + tail' if tails else 'whole chunks'} | {r['keys']} | {r['chunks']} "
                         f"| {r['pages']} | {r['hit_tokens']} | {1000 * med['store_s']:.1f} | "
                         f"{1000 * med['find_s']:.1f} |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
