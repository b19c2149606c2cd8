"""Issue 19: the host's work before a 128k cross-replica hit's first copy, on a CPU (tiny model): the scheduler's
step and the LOOKUP of B's request (median of 5, B's prefix cache forgotten before each), and planning a load of
the qwen2.5-32b shape's 512 chunks (batch at once vs job by job, median of 7).

    PYTHONPATH=.:experiments python experiments/cpu_admission_cost.py

Run from an older tree (`git worktree add /tmp/old REV`, then the same command in it, the script copied there) for
the figures before a change; the planning part needs a tree with kvshare.transfer.jobs._plan_uniform.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from h200_cross_replica import document, first_token

LENGTH = 131072


def admission() -> dict:
    from kvshare.connector import ConnectorConfig
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.make_model import make_model
    from kvshare.engine.pool_connector import PoolConnector
    from kvshare.pool.testing import start_pool

    model = str(make_model("tiny", Path(tempfile.mkdtemp()) / "tiny"))

    def engine(address):
        e = Engine(EngineConfig(model=model, load_format="dummy", device="cpu", dtype="bfloat16",
                                max_model_len=LENGTH + 4096))
        e.set_connector(PoolConnector.for_engine(e, ConnectorConfig(address=address, timeout=60.0)))
        return e

    def timed(seconds: dict, name: str, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = max(seconds.get(name, 0.0), time.perf_counter() - started)  # the admitting call
        return wrapper

    with start_pool("3GiB", page_size="2MiB", check_integrity=False, timeout=120,
                    max_leased_pages_per_client=0) as (address, _):
        a = engine(address)
        doc = document(LENGTH, 1000, 1024)
        first_token(a, "a", doc + document(64, 5, 1024))
        a.connector.core.flush(600)
        a.connector.close()
        a.shutdown()
        b = engine(address)
        b.pool.store = lambda seq, num_tokens: None  # B only loads
        first_token(b, "warm", document(300, 7, 1024))
        seconds: dict = {}
        b.scheduler.schedule = timed(seconds, "schedule", b.scheduler.schedule)
        b.connector.lookup = timed(seconds, "lookup", b.connector.lookup)
        rows = []
        for rep in range(5):
            b.block_manager.hash_to_block.clear()
            seconds.clear()
            ttft, finished = first_token(b, f"b{rep}", doc + document(64, 9 + rep, 1024))
            assert finished.usage.pool_hit_tokens == LENGTH, finished.usage
            rows.append(dict(seconds, ttft=ttft))
        b.connector.close()
        b.shutdown()
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def planning() -> dict:
    from kvshare.transfer.blocks import BlockSpace
    from kvshare.transfer.jobs import LoadJob, _plan_each, _plan_uniform
    from kvshare.transfer.layout import KVLayout

    layers, blocks = 64, 8200
    layout = KVLayout(num_layers=layers, num_blocks=blocks, block_size=16, num_kv_heads=8, head_size=128,
                      dtype=torch.bfloat16)
    space = BlockSpace(layout, (), np.arange(layers, dtype=np.int64) * blocks, (0, 32768), 32768)  # rows only
    pages = np.random.default_rng(0).permutation(20000)
    jobs = [LoadJob(pages=pages[c * 32 : (c + 1) * 32].tolist(), block_ids=list(range(c * 16, (c + 1) * 16)))
            for c in range(512)]
    result = {}
    for name, fn in (("plan_batch", _plan_uniform), ("plan_each", _plan_each)):
        times = []
        for _ in range(7):
            started = time.perf_counter()
            assert fn(space, jobs, 2 << 20, 20000, True) is not None
            times.append(time.perf_counter() - started)
        result[name] = statistics.median(times)
    return result


if __name__ == "__main__":
    for name, seconds in {**planning(), **admission()}.items():
        print(f"{name:12s} {1e3 * seconds:8.1f} ms")
