"""The model on its device and the paged KV cache it reads and writes: sizes the cache, runs prefill/decode steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from kvshare.engine import fla_rule, paged_attention
from kvshare.engine.attention import decode_step
from kvshare.engine.config import EngineConfig
from kvshare.engine.cuda_graphs import DecodeGraphs, capture_sizes
from kvshare.engine.hybrid import RecurrentState
from kvshare.engine.model import Rotary
from kvshare.engine.sequence import Sequence
from kvshare.engine.state_slots import StateSlots
from kvshare.engine.weights import load_model
from kvshare.hf.config import ModelConfig
from kvshare.units import format_size

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2 << 30  # at most; the default is 4 max-length sequences' worth, capped here


@dataclass(frozen=True)
class StagedInputs:
    """A prefill's inputs on the device (ModelRunner.stage): tokens [start, num_tokens) and the block table as they
    were when staged. Valid for the same engine step only (nothing allocates blocks between staging and the forward)."""

    start: int
    num_tokens: int
    num_blocks: int
    tokens: torch.Tensor
    table: torch.Tensor

    def covers(self, seq: Sequence) -> bool:
        """Whether seq's forward can take its inputs from here: same tokens and table, computed no further back."""
        return (self.num_tokens == seq.num_tokens and self.num_blocks == len(seq.block_table)
                and self.start <= seq.num_computed < self.num_tokens)


class ModelRunner:
    """Owns the weights and `kv_caches`: per layer one tensor [num_blocks, 2, block_size, num_kv_heads, head_dim],
    allocated once; blocks are addressed only through the block manager's ids.

    All layers are slices of one allocation, a whole number of block strides apart: the transfer layer then addresses
    a block of every layer through one view (one gather/scatter kernel per staging slot instead of one per layer:
    at 256k tokens that is ~1k kernel launches per load instead of ~65k, which made the load launch-bound)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.torch_kv_dtype  # the model's dtype, or fp8 (kv_quant.py)
        loaded = load_model(config.model, config.load_format, self.device, self.dtype, config.seed, config.model_id)
        self.model, self.model_fingerprint = loaded.model, loaded.fingerprint
        self.rotary = Rotary(model_config, self.device, self.dtype)
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, 2, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        whole = torch.zeros((len(model_config.attention_layers), *shape), device=self.device, dtype=self.kv_dtype)
        self.kv_caches = list(whole.unbind(0))  # the full-attention layers' (all layers of a dense model)
        log.info("KV cache: %d blocks of %d tokens (%s) on %s", self.num_blocks, config.block_size,
                 format_size(self.num_blocks * self.block_bytes), self.device)
        # A hybrid model's linear layers keep a state per sequence instead (kvshare.engine.state_slots); the engine
        # snapshots it at every multiple of `snapshot_every` tokens (the pool's chunk) for the pool to store.
        self.states = None if model_config.linear is None else StateSlots(model_config, config.max_num_seqs + 1,
                                                                          self.device, self.dtype)
        self.snapshot_every = 0
        # Attention reads the cache in place (the Triton kernels) unless told not to or unable (EngineConfig has
        # refused "triton" where they cannot run); the hybrid model runs the torch forms.
        self.paged = (config.attention_backend != "torch" and paged_attention.available(self.device)
                      and self.states is None)
        use_graphs = self.paged and self.device.type == "cuda" and not config.enforce_eager and self.num_blocks > 1
        self.usable_blocks = self.num_blocks - 1 if use_graphs else self.num_blocks  # the last: the graphs' scratch
        self.max_model_len = min(config.max_model_len or model_config.max_position,
                                 self.usable_blocks * config.block_size)
        self.decode_partition = paged_attention.decode_partition(self.max_model_len)
        self.graphs: DecodeGraphs | None = None
        if self.states is not None and config.linear_attention_backend != "torch" and fla_rule.available(self.device):
            self.model.use_fla()
        if self.paged:
            self._prepare_kernels(use_graphs)

    def _prepare_kernels(self, use_graphs: bool) -> None:
        """Fused per-token kernels on, every kernel variant compiled, and decode captured as CUDA graphs, all before
        the first request."""
        self.model.use_fused_ops()
        paged_attention.warm_up(self.kv_caches[0], self.model_config.num_heads, self.dtype)
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.rotary,
                                       sizes=capture_sizes(self.config.max_num_seqs),
                                       max_model_len=self.max_model_len, block_size=self.config.block_size,
                                       scratch_block=self.num_blocks - 1, partition=self.decode_partition,
                                       device=self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        m = self.model_config
        return (self.config.block_size * len(m.attention_layers) * 2 * m.num_kv_heads * m.head_dim
                * self.kv_dtype.itemsize)

    def _num_blocks(self) -> int:
        c, m = self.config, self.model_config
        if c.num_blocks is not None:
            return c.num_blocks
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] - self._activation_reserve()
        else:
            max_len = c.max_model_len or m.max_position
            budget = min(CPU_DEFAULT_KV_BYTES, 4 * max_len * self.block_bytes // c.block_size)
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"no room for a KV cache ({format_size(budget)}): pass --num-blocks or --kv-cache-memory")
        return int(num_blocks)

    def _activation_reserve(self) -> int:
        """Device memory to leave free for a max-length prefill: hidden states and q/attention output over the
        whole sequence, one chunk's MLP, the expanded K/V of one attention group, plus 2 GiB of slack."""
        c, m, e = self.config, self.model_config, self.dtype.itemsize
        length = c.max_model_len or m.max_position
        sequence = length * (m.hidden_size + m.num_heads * m.head_dim) * e
        chunk = c.prefill_chunk * (3 * m.intermediate_size + 2 * m.hidden_size) * e
        return sequence + chunk + (1 << 30) + (2 << 30)

    def stage(self, seq: Sequence, start: int) -> StagedInputs:
        """Queue the upload of a prefill's inputs (its tokens from `start` on, and its block table) now: `start` is
        where the forward will begin if the pool load about to start succeeds (a failed one starts it earlier and
        uploads its own).

        Why before a pool load: a GPU runs the host->device copies of all streams through one copy queue, in the
        order they were queued. The forward's inputs uploaded after a load's copies were queued wait for every one
        of them (H200 run 27: the tail's first kernel of a 128k hit in 2 layer waves started after the last copy,
        ~0.27 s after wave 0 had landed); uploaded first, they arrive at once and the forward runs each layer as soon
        as its wave has landed."""
        return StagedInputs(start, seq.num_tokens, len(seq.block_table),
                            self._to_device(seq.token_ids[start:]), self._to_device(seq.block_table))

    @property
    def state_layout(self):
        """A hybrid model's packed state (kvshare.transfer.state.StateLayout), or None."""
        return None if self.states is None else self.states.layout

    def prefill(self, seq: Sequence, before_attention: Callable[[int], None] | None = None,
                staged: StagedInputs | None = None) -> torch.Tensor:
        """Compute K/V of seq's tokens [num_computed, num_tokens); logits of the last one (1, vocab).
        before_attention(i) runs before layer i's attention reads the cache (a pool load in waves); `staged`: inputs
        stage() uploaded earlier in this step (a pool load since then only moved num_computed forward)."""
        if staged is not None and staged.covers(seq):
            tokens, table = staged.tokens[seq.num_computed - staged.start :], staged.table  # a view: no copy
        else:
            tokens = self._to_device(seq.token_ids[seq.num_computed :])
            table = self._to_device(seq.block_table)
        if self.states is not None:
            return self._prefill_hybrid(seq, tokens, table, before_attention)
        return self.model.prefill(tokens, seq.num_computed, self.kv_caches, table, self.rotary,
                                  self.config.prefill_chunk, in_place=self.paged, before_attention=before_attention)

    def _prefill_hybrid(self, seq: Sequence, tokens, table, before_attention) -> torch.Tensor:
        """A hybrid prefill from seq's state slot: cleared for a prefill from 0; after a pool load, holding the
        loaded state (seq.loaded_state, unpacked here, before any layer runs). Packed states at the chunk
        boundaries it passes are kept in seq.state_snapshots for the pool's store."""
        start, slot = seq.num_computed, self.states.slot(seq)
        if start == 0:
            self.states.clear(slot)
        elif seq.loaded_state is not None:
            self.states.unpack(slot, seq.loaded_state)
        seq.loaded_state = None
        every = self.snapshot_every
        boundaries = [p for p in range(start + every, seq.num_tokens + 1, every)] if every else []
        logits, snapshots = self.model.prefill(tokens, start, self.kv_caches, table, self.rotary,
                                               self.config.prefill_chunk, self.states.views(slot), boundaries,
                                               before_attention)
        for p in boundaries:
            seq.state_snapshots[p] = self.states.pack([layer[p] for layer in snapshots])
        return logits

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 device tensor of `values` whose copy does not make the host wait: from pinned memory, queued on
        the current stream. That stream may be waiting for a pool load (its last event, or a layer's): a blocking
        copy would hold the host there until the load is over and only then let it queue the forward's ~3,900
        kernels, ~0.1 s of a 128k hit's TTFT after the copy on an H200 (runs 22, 25). The pinned buffer is kept by
        torch's caching host allocator until the copy has run."""
        host = torch.tensor(values, dtype=torch.int64)
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One step for each sequence's newest token; logits (B, vocab)."""
        tokens = [s.token_ids[-1] for s in seqs]
        positions = [s.num_tokens - 1 for s in seqs]
        if self.states is not None:
            return self._decode_hybrid(seqs, tokens, positions)
        if self.graphs and self.graphs.fits(len(seqs)):
            return self.graphs.run(tokens, positions, [s.block_table for s in seqs])
        self.rotary.ensure(max(positions) + 1)
        tables = [torch.tensor(s.block_table, device=self.device) for s in seqs]
        step = decode_step(tables, positions, self.config.block_size, self.decode_partition if self.paged else None)
        return self.model.decode(torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device),
                                 self.kv_caches, step, self.rotary)

    def _decode_hybrid(self, seqs: list[Sequence], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """A decode step of a hybrid model: the slots' states gathered, advanced one token, written back; a sequence
        whose state now covers a multiple of snapshot_every tokens keeps a packed copy for the pool's store."""
        slots = [self.states.slot(s) for s in seqs]
        self.rotary.ensure(max(positions) + 1)
        tables = [torch.tensor(s.block_table, device=self.device) for s in seqs]
        step = decode_step(tables, positions, self.config.block_size, None)
        logits, states = self.model.decode(torch.tensor(tokens, device=self.device),
                                           torch.tensor(positions, device=self.device), self.kv_caches, step,
                                           self.rotary, self.states.gather(slots))
        self.states.scatter(slots, states)
        every = self.snapshot_every
        for i, seq in enumerate(seqs):
            if every and seq.num_tokens % every == 0:
                seq.state_snapshots[seq.num_tokens] = self.states.pack(
                    [RecurrentState(s.recurrent[i : i + 1], s.conv[i : i + 1]) for s in states])
        return logits
