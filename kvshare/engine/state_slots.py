"""A hybrid model's per-sequence linear-attention state: one slot per running sequence in every linear layer's state
tensors, and the packed copies of it (kvshare.transfer.state) that the pool stores and loads.

Invariants:
- A sequence's slot holds the state after its first `num_computed` tokens whenever the engine is between steps: a
  prefill from 0 clears it first, a pool load fills it with the state at the hit's end, and every forward leaves the
  state after its last token.
- A slot belongs to one sequence at a time; slots of sequences that left the engine (finished, aborted) are freed,
  and a slot of a preempted sequence is taken back for a running one when none is free (it recomputes from 0).
"""

from __future__ import annotations

import torch

from kvshare.engine.hybrid import RecurrentState
from kvshare.engine.sequence import Sequence, Status
from kvshare.hf.config import ModelConfig
from kvshare.transfer.state import StateLayout


class StateSlots:
    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype):
        lin = config.linear
        layers = len(lin.linear_layers)
        self.layout = StateLayout.of_model(config, torch.float32, dtype)
        self.recurrent = torch.zeros(layers, num_slots, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim,
                                     dtype=torch.float32, device=device)
        self.conv = torch.zeros(layers, num_slots, lin.conv_dim, lin.conv_kernel - 1, dtype=dtype, device=device)
        self._slot_of: dict[Sequence, int] = {}
        self._free = list(range(num_slots))

    def slot(self, seq: Sequence) -> int:
        """seq's slot, assigned on first use; with none free, a preempted (waiting) sequence's is taken back."""
        if seq in self._slot_of:
            return self._slot_of[seq]
        if not self._free:
            idle = next((s for s in self._slot_of if s.status is not Status.RUNNING and s is not seq), None)
            if idle is None:
                raise RuntimeError("no free recurrent-state slot: more running sequences than --max-num-seqs")
            self.release(idle)
        self._slot_of[seq] = slot = self._free.pop()
        return slot

    def release(self, seq: Sequence) -> None:
        """seq left the engine (or was preempted and must recompute): its slot is free."""
        slot = self._slot_of.pop(seq, None)
        if slot is not None:
            self._free.append(slot)

    def views(self, slot: int) -> list[RecurrentState]:
        """Per linear layer, batch-of-one views of the slot (a prefill updates them in place)."""
        return [RecurrentState(r[slot : slot + 1], c[slot : slot + 1]) for r, c in zip(self.recurrent, self.conv)]

    def clear(self, slot: int) -> None:
        self.recurrent[:, slot].zero_()
        self.conv[:, slot].zero_()

    def gather(self, slots: list[int]) -> list[RecurrentState]:
        """Per linear layer, copies of the slots' states (a decode batch)."""
        index = torch.tensor(slots, device=self.recurrent.device)
        return [RecurrentState(r.index_select(0, index), c.index_select(0, index))
                for r, c in zip(self.recurrent, self.conv)]

    def scatter(self, slots: list[int], states: list[RecurrentState]) -> None:
        index = torch.tensor(slots, device=self.recurrent.device)
        for r, c, new in zip(self.recurrent, self.conv, states):
            r.index_copy_(0, index, new.recurrent)
            c.index_copy_(0, index, new.conv.to(c.dtype))

    def pack(self, states: list[RecurrentState]) -> torch.Tensor:
        """A packed copy (batch of one) of per-layer states in host memory (pinned beside a GPU): what the pool stores
        for a chunk boundary. On the host because a long prompt passes many boundaries (64 states of 147 MiB at 256k
        in 4096-token chunks for the Qwen3.5-27B shape) and the store copies them into the arena anyway."""
        packed = self.layout.new_buffer(pin_memory=self.recurrent.device.type == "cuda")  # every part filled below
        for view, tensor in zip(self.layout.views(packed), (t for s in states for t in (s.recurrent[0], s.conv[0]))):
            view.copy_(tensor)  # device -> host: synchronous, so the slot may change right after
        return packed

    def unpack(self, slot: int, packed: torch.Tensor) -> None:
        """Fill the slot from a packed state (a pool load's)."""
        views = self.layout.views(packed)
        for j in range(self.recurrent.shape[0]):
            self.recurrent[j, slot].copy_(views[2 * j])
            self.conv[j, slot].copy_(views[2 * j + 1])
