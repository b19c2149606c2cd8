"""The messages between the connector's scheduler half and its worker half, carried by vLLM every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvshare.connector import PoolHit


class LoadSpec(msgspec.Struct, frozen=True):
    """Load `hit` into the request's blocks. Tokens [num_computed, num_computed + num_tokens) are what vLLM now
    counts as computed; blocks below num_computed hold vLLM's own prefix-cache hit and are not written."""

    req_id: str
    hit: PoolHit
    block_ids: list[int]  # the request's whole block table
    num_computed: int  # block-aligned
    num_tokens: int  # what the scheduler accepted; a load is valid only if the hit covers exactly this
    # A hybrid model's hit (kvshare.integrations.vllm.hybrid): block_ids are the attention group's, and the hit's
    # state goes into these blocks, one per mamba group, at index hit.end / block_size - 1 of each group's list.
    state_blocks: list[int] = []
    salt: str = ""  # the request's cache salt: the hit must be keyed under the worker's namespace of it (I9)

    def block_range(self, block_size: int) -> list[int]:
        """The blocks this load writes: the ones to recompute if it fails."""
        first, end = self.num_computed // block_size, -(-(self.num_computed + self.num_tokens) // block_size)
        return self.block_ids[first:end]


class StoreSpec(msgspec.Struct, frozen=True):
    """Store the chunks of `token_ids` past the first `num_stored` tokens from `block_ids`: its full chunks and,
    with `tail` (the prompt's own store), the whole blocks after them as one partial chunk.

    Sent in the step whose forward computes the last of those tokens (or later), and run after that forward."""

    req_id: str
    token_ids: list[int]  # whole chunks, or with `tail` whole blocks
    block_ids: list[int]  # covering token_ids
    num_stored: int  # tokens sent to the worker in earlier steps (a chunk or, after the prompt's tail, a block edge)
    salt: str = ""
    tail: bool = False
    # A hybrid model's store: boundary (tokens) -> the blocks holding the state there, one per mamba group, which
    # vLLM offered this step (valid until its end: the worker packs them in this step's wait_for_save).
    states: dict[int, list[int]] = {}


@dataclass
class KVShareMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # their blocks are freed: finish their stores first


@dataclass
class KVShareWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose loads ended this step, successfully or not: the scheduler half ends their read leases (a pool
    lease belongs to the connection that took it, which is the scheduler's). A hybrid request whose load failed is
    recomputed by vLLM from its start and is not offered a pool hit again (the same hit would fail the same way)."""

    loaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # among `loaded`: hybrid loads that failed (no retry)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVShareWorkerMetadata)
        return KVShareWorkerMetadata(sorted(set(self.loaded) | set(other.loaded)),
                                     sorted(set(self.failed) | set(other.failed)))
