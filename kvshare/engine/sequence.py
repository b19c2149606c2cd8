"""One request's state inside the engine: its tokens, how many have KV in the cache, its block table, its hits."""

from __future__ import annotations

import enum
import os

import torch

from kvshare.engine.api import EventCallback, GenerationRequest


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Invariants: token_ids = prompt + generated; tokens [0, num_computed) have K/V in the blocks of block_table;
    while running, num_computed <= num_tokens - 1 (the newest token's K/V is computed by the next step)."""

    def __init__(self, request: GenerationRequest, callback: EventCallback):
        self.request = request
        self.request_id = request.request_id
        self.sampling = request.sampling
        self.callback = callback
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt_tokens = len(request.prompt_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading full blocks registered in the local prefix cache
        self.last_block_hash: int | None = None  # hash of block num_hashed_blocks - 1: the next block's parent
        self.block_hashes: list[int] = []  # the block_hash chain of leading full blocks, as far as computed
        self.local_hit_tokens = 0
        self.pool_hit_tokens = 0
        self.num_stored = 0  # leading tokens known to be in the pool (loaded from it or stored to it)
        # A hybrid model's linear-attention state (kvshare.engine.state_slots): packed copies at chunk boundaries
        # until the pool has stored them, and the state a pool load brought for the next prefill to start from.
        self.state_snapshots: dict[int, torch.Tensor] = {}
        self.loaded_state: torch.Tensor | None = None
        self.admitted = False  # set at first admission; hits are counted only then (a preempted request recomputes)
        self.status = Status.WAITING
        seed = self.sampling.seed if self.sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def salt(self) -> str:
        return self.request.cache_salt

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
