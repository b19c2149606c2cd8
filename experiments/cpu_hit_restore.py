"""What a 128k pool hit's own store cost a vLLM worker before the scheduler half stopped sending it: B's prompt is the
one the pool holds, and its store hashed the whole prompt's chunk keys and sent a RESERVE of 512 chunks that the pool
answered were held, synchronously in wait_for_save on a GPU (after the forward, before the first token). Now the
scheduler half counts the hit's chunks as stored, and no StoreSpec is sent.

Measured against a real pool on this machine's CPU: ConnectorCore._store (what the GPU worker runs) of a prompt the
pool holds whole, and for scale the LOOKUP that found it (ConnectorCore.find). The KV layout is small (2 layers,
fp32), since neither call copies KV: the figures are keys, frames and the pool's work. Medians of `--repeats`.

    .venv/bin/python experiments/cpu_hit_restore.py --out docs/results/connectors-cpu/hit-restore
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from kvshare.connector import ConnectorConfig, ConnectorCore
from kvshare.keys import Namespace
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout

BLOCK, CHUNK, TOKENS = 16, 256, 131072  # vLLM's CUDA block, the connector's chunk, a 128k prompt


def timed(call, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    ms = sorted(1000 * s for s in seconds)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "n": len(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    layout = KVLayout(num_layers=2, num_blocks=TOKENS // BLOCK + 1, block_size=BLOCK, num_kv_heads=2, head_size=32,
                      dtype=torch.float32)
    kv = [torch.randn(layout.tensor_shape) for _ in range(layout.num_layers)]
    prompt = [random.Random(0).randrange(3, 150000) for _ in range(TOKENS)]
    blocks = list(range(TOKENS // BLOCK))
    with start_pool("1GiB", page_size="256KiB", check_integrity=False) as (address, _):
        core = ConnectorCore(ConnectorConfig(address=address, chunk_tokens=CHUNK),
                             Namespace("hit-restore", "float32", layout.layout_id(), CHUNK), BLOCK)
        core.attach(layout, kv)
        core.store(prompt, blocks, 0, tail=True)
        core.flush()
        skipped = core.stats.store_skipped_chunks
        restore = timed(lambda: core._store(prompt, blocks, 0, "", True), args.repeats)
        skipped = (core.stats.store_skipped_chunks - skipped) // args.repeats

        def find():
            core.release_hit(core.find(prompt, 0))

        lookup = timed(find, args.repeats)
        core.close()
    result = {"tokens": TOKENS, "chunks_reserved_and_skipped": skipped, "hit_store_before": restore,
              "lookup": lookup, "cpus": os.cpu_count(), "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
