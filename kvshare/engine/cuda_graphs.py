"""Decode steps replayed as CUDA graphs: one graph per batch size in a short list, captured when the replica starts,
so a step costs one graph launch instead of ~3,500 kernel launches from Python (a 64-layer model: ~45 ms a token on
an H200 whatever the context, while its weights take ~14 ms to read; docs/results/h200, run 14). Served decode of the
32B shape at 32k context: 49.1 -> 22.3 ms a token with the paged and fused kernels (run 20).

A batch of B sequences runs the smallest captured size >= B; the extra rows are padding that decode token 0 at
position 0 into the scratch block, a KV-cache block the block manager never hands out (ModelRunner reserves it), so
padding writes no sequence's K/V and no sequence reads padding's. Attention goes through the paged kernel with the
server's fixed decode partition (kvshare.engine.paged_attention): a row's attention does not depend on the batch
around it. The matrix products' rounding may depend on the (padded) batch size, as it depends on the batch size in
any engine; that is the same with the pool ON or OFF.

Invariants: every input lives in a static buffer the graphs read; run() overwrites all of them (every row, padding
included) before each replay, on the stream the graphs replay on, so the copies land before the replay reads them.
The rotary tables cover max_model_len before the first capture and never grow afterwards (Rotary.ensure).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvshare.engine.attention import DecodeStep
from kvshare.engine.paged_attention import PagedBatch

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, and max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Captured decode steps of `model` over `kv_caches`, for batch sizes `sizes`."""

    def __init__(self, model, kv_caches, rotary, *, sizes: list[int], max_model_len: int, block_size: int,
                 scratch_block: int, partition: int, device: torch.device):
        self.sizes = sorted(sizes)
        self.max_blocks = -(-max_model_len // block_size)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_blocks = torch.zeros(n, **i64)
        self.slot_offsets = torch.zeros(n, **i64)
        self.tables = torch.zeros(n, self.max_blocks, **i32)
        self.kv_len = torch.ones(n, **i32)
        self.q_pos = torch.zeros(n, **i32)
        self.q_start = torch.arange(n, **i32)
        self.q_len = torch.ones(n, **i32)
        self._fill([], n)  # padding everywhere: what warm-up and capture run
        rotary.ensure(max_model_len)  # before any capture: the graphs read these tables' memory
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        started, pool = time.perf_counter(), None
        for size in reversed(self.sizes):  # largest first: the others reuse its memory pool
            step = self._step(size, partition)

            def run(size=size, step=step):
                return model.decode(self.tokens[:size], self.positions[:size], kv_caches, step, rotary)

            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up off the capture: kernel compilation, library handles
                run()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the pool connector's threads may use CUDA while this thread captures.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.logits[size] = run()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info("decode captured as CUDA graphs for batch sizes %s in %.1f s", self.sizes,
                 time.perf_counter() - started)

    def _step(self, size: int, partition: int) -> DecodeStep:
        batch = PagedBatch(tables=self.tables[:size], q_start=self.q_start[:size], q_len=self.q_len[:size],
                           kv_len=self.kv_len[:size], q_pos=self.q_pos[:size], max_q_len=1,
                           max_kv_len=self.max_model_len)
        return DecodeStep(slots=(self.slot_blocks[:size], self.slot_offsets[:size]), paged=batch, partition=partition)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits (B, vocab) of one step: sequence i's newest token tokens[i] at positions[i], its blocks tables[i]."""
        size = next(s for s in self.sizes if s >= len(tokens))
        self._fill(list(zip(tokens, positions, tables)), size)
        self.graphs[size].replay()
        return self.logits[size][: len(tokens)].clone()  # the next replay overwrites the graph's output

    def _fill(self, rows: list[tuple[int, int, list[int]]], size: int) -> None:
        """Write rows [0, size) of every input: the given sequences, then padding (token 0 at position 0, whose K/V
        go to the scratch block and whose table is all scratch)."""
        tables = np.full((size, self.max_blocks), self.scratch_block, dtype=np.int32)
        scalars = np.zeros((5, size), dtype=np.int64)  # token, position, slot block, slot offset, kv length
        scalars[2], scalars[4] = self.scratch_block, 1
        for i, (token, position, table) in enumerate(rows):
            tables[i, : len(table)] = table
            scalars[:, i] = (token, position, table[position // self.block_size], position % self.block_size,
                             position + 1)
        host = torch.from_numpy(scalars)
        self.tables[:size].copy_(torch.from_numpy(tables))
        for target, values in zip((self.tokens, self.positions, self.slot_blocks, self.slot_offsets), host[:4]):
            target[:size].copy_(values)
        self.kv_len[:size].copy_(host[4])
        self.q_pos[:size].copy_(host[1])
