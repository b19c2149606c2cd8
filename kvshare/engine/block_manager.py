"""KV block allocation with a local automatic prefix cache: refcounted blocks, full-block hash chain, LRU reuse.

A full block's hash is kvshare.keys.block_hash: xxh3-64(parent block's hash ‖ its token ids as little-endian uint32),
seedless, identical in every process. A hit is confirmed by comparing the stored token ids, so a hash collision
cannot serve wrong K/V.
Free blocks keep their contents and hash until reused, in least-recently-freed order, so a recently finished
request's prefix can still be hit. Blocks are freed in reverse table order: a prefix's tail is evicted before its
head, which other requests are more likely to share.

A hybrid model's blocks hold only its full-attention layers' K/V; the linear layers' state at a block boundary is
not kept, so a local hit would load attention K/V without the state (wrong answers): its engine builds the block
manager with prefix_caching=False, and repeats are served by the pool, which stores a state with every chunk.

Refcount = number of holders: sequences whose table contains the block, and pending pool stores reading it
(hold()/release()), so a block is never reused while a store still reads it (I4).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from kvshare.engine.sequence import Sequence
from kvshare.keys import block_chain_root, block_hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # oldest first

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _cached_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Block ids holding the longest verified cached prefix of seq's tokens, at most max_tokens tokens. The
        chain is hashed only as far as the hits reach (doubling): a 128k prompt that misses at its first block hashes
        16 blocks here, not 8,192, before its first token (the rest when its blocks are registered, after it)."""
        hits, bs = [], self.block_size
        n = max_tokens // bs if self.prefix_caching else 0
        reach = min(n, 16)
        while len(hits) < n:
            chain = self._chain(seq, reach)
            for i in range(len(hits), reach):
                block_id = self.hash_to_block.get(chain[i])
                if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                    return hits
                hits.append(block_id)
            reach = min(n, 2 * reach)
        return hits

    def _chain(self, seq: Sequence, n: int) -> list[int]:
        """The hashes of seq's first n full blocks (kvshare.keys.block_hash, chained from its salt's root), computed
        once per sequence and extended as it grows: a block's hash depends only on the tokens up to its end, which
        never change (tokens are only appended). Admitting a 128k-token prompt looked its 8,192 blocks up twice and
        registered them once, each time hashing block by block in Python (~0.2 s on this build machine)."""
        known, bs = seq.block_hashes, self.block_size
        if len(known) < n:
            parent = known[-1] if known else block_chain_root(seq.salt)
            known += block_hashes(parent, seq.token_ids[len(known) * bs : n * bs], bs)
        return known[:n]

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether allocate(seq) would succeed now (cached blocks still in use by others cost no free block)."""
        hits = self._cached_prefix(seq, seq.num_tokens - 1)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_for(seq.num_tokens) - in_use <= self.num_free

    def allocate(self, seq: Sequence) -> int:
        """Give seq blocks for all its tokens, reusing the cached prefix (always leaving >= 1 token to compute).
        Returns the number of tokens whose K/V is already there. Call can_allocate() first."""
        assert not seq.block_table, f"{seq} already has blocks"
        hits = self._cached_prefix(seq, seq.num_tokens - 1)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else block_chain_root(seq.salt)
        return len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) >= self.blocks_for(seq.num_tokens) or self.num_free > 0

    def may_append(self, seq: Sequence) -> None:
        """Make the table cover all of seq's tokens (at most one new block per decode step)."""
        while len(seq.block_table) < self.blocks_for(seq.num_tokens):
            seq.block_table.append(self._take_free())

    def register_computed(self, seq: Sequence) -> None:
        """Enter seq's full blocks whose K/V is now computed into the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        chain = self._chain(seq, seq.num_computed // bs)
        for i in range(seq.num_hashed_blocks, seq.num_computed // bs):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.hash = chain[i]
            self.hash_to_block[block.hash] = block.block_id  # the newest copy wins; older copies stay valid
            seq.last_block_hash = block.hash
            seq.num_hashed_blocks = i + 1

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks (tail first, see the module docstring) and clear its table."""
        self.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_hashed_blocks, seq.last_block_hash = 0, block_chain_root(seq.salt)

    def hold(self, block_ids: Iterable[int]) -> None:
        """An extra holder (a pending store) for blocks that are in use now."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"hold of free block {block_id}"
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released more often than held"
            if block.ref_count == 0:
                self.free[block_id] = None  # most recently freed: reused last

    def check_integrity(self) -> None:
        """free + used == total; free blocks have no holders; every cache entry names a block with that hash."""
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + len(self.free) == len(self.blocks), (used, len(self.free), len(self.blocks))
        assert all(self.blocks[i].ref_count == 0 for i in self.free)
        assert all(self.blocks[i].hash == h for h, i in self.hash_to_block.items())

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV block: call can_allocate()/can_append() first")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id
