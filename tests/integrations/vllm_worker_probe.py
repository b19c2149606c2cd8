"""Run by tests/integrations/test_vllm_failed_load.py in a vLLM interpreter, with a pool's address: drives the vLLM
connector's worker half (WorkerSide, CPU tensors, a real pool) through steps in which request r1 loads a hit, and
prints as JSON which of the steps' stores reached the pool.

    python tests/integrations/vllm_worker_probe.py ADDRESS corrupt|intact

Step 1: r1 loads a stored prompt into blocks 8-16 (its checksums flipped if `corrupt`) and stores its own prompt;
r2 stores a chunk from blocks 9 (one of r1's) and 20-22; r3 stores a chunk from blocks 24-27. Step 2: r2 and r4
store new chunks from blocks of their own. Then vLLM finishes every request, and step 3 stores a chunk under r2's
id again.
"""

from __future__ import annotations

import json
import logging
import random
import sys

import msgspec
import torch

from kvshare.connector import ConnectorConfig, ConnectorCore
from kvshare.integrations.vllm.metadata import KVShareMetadata, LoadSpec, StoreSpec
from kvshare.integrations.vllm.worker import WorkerSide
from kvshare.keys import Namespace
from kvshare.transfer import KVLayout

MARKER = "KVSHARE-PROBE "  # the result line's prefix (vLLM may log on stdout)
BLOCK, CHUNK = 16, 64


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    address, mode = sys.argv[1], sys.argv[2]
    warnings = Warnings()
    logging.getLogger("vllm.kvshare").addHandler(warnings)
    layout = KVLayout(2, 64, BLOCK, 2, 32, torch.float32)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(layout.tensor_shape) for i in range(layout.num_layers)}
    namespace = Namespace(f"worker-probe-{mode}", "float32", layout.layout_id(), CHUNK)
    core = ConnectorCore(ConnectorConfig(address=address, chunk_tokens=CHUNK, load_waves=1), namespace, BLOCK)
    worker = WorkerSide(core, layout)
    worker.register(kv)
    rng = random.Random(mode)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(n)]

    def step(meta: KVShareMetadata) -> set[int]:
        worker.load(meta)  # start_load_kv; the forward would run here
        worker.save(meta)  # wait_for_save
        invalid = worker.take_invalid()  # get_block_ids_with_load_errors
        core.flush()
        return invalid

    def held(prompt: list[int]) -> bool:
        """Whether the pool holds the prompt's first chunk (then released: the probe loads nothing more)."""
        hit = core.find(prompt + [1], 0)
        if hit is not None:
            core.release_hit(hit)
        return hit is not None

    stored = tokens(2 * CHUNK)
    core.store(stored, list(range(8)), 0, tail=True)
    core.flush()
    hit = core.find(stored + [1], 0)
    if mode == "corrupt":
        hit = msgspec.structs.replace(hit, checksums=[c ^ 1 for c in hit.checksums])
    r2, r3 = tokens(CHUNK), tokens(CHUNK)
    invalid = step(KVShareMetadata(
        loads=[LoadSpec("r1", hit, list(range(8, 17)), 0, 2 * CHUNK)],
        stores=[StoreSpec("r1", stored, list(range(8, 16)), 0, tail=True),
                StoreSpec("r2", r2, [9, 20, 21, 22], 0), StoreSpec("r3", r3, [24, 25, 26, 27], 0)]))
    core.release_hit(hit)  # the scheduler half's part, once the worker reported the load
    r2_later, r4 = tokens(CHUNK), tokens(CHUNK)
    step(KVShareMetadata(stores=[StoreSpec("r2", r2_later, [30, 31, 32, 33], 0),
                                 StoreSpec("r4", r4, [34, 35, 36, 37], 0)]))
    finished = worker.finished({"r1", "r2", "r3", "r4"})
    r2_again = tokens(CHUNK)
    step(KVShareMetadata(stores=[StoreSpec("r2", r2_again, [40, 41, 42, 43], 0)]))
    result = {"invalid": sorted(invalid), "r1_held": held(stored), "r2_held": held(r2), "r3_held": held(r3),
              "r2_later_held": held(r2_later), "r4_held": held(r4), "finished": sorted(finished),
              "r2_again_held": held(r2_again), "warnings": warnings.lines}
    core.close()
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
