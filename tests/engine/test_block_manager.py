"""Block manager: refcounts, prefix-cache hits with token verification, LRU reuse, holds; property-tested."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.engine.api import GenerationRequest
from kvshare.engine.block_manager import BlockManager
from kvshare.engine.sequence import Sequence
from kvshare.keys import block_hash, block_hashes


def seq(tokens, rid="r"):
    return Sequence(GenerationRequest(rid, tuple(tokens)), lambda event: None)


def computed(bm, s):
    """Pretend the model computed every token but the last, as after a prefill."""
    s.num_computed = s.num_tokens - 1
    bm.register_computed(s)


def test_hit_needs_equal_tokens_and_leaves_one_token():
    bm = BlockManager(16, 4)
    a = seq(range(12))
    assert bm.allocate(a) == 0
    computed(bm, a)  # blocks 0 and 1 are full and computed; block 2 holds 3 computed tokens
    b = seq(range(12), "b")  # same 12 tokens: 2 blocks hit, the third can't (it would leave nothing to compute)
    assert bm.can_allocate(b) and bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    c = seq([0, 1, 2, 3, 9, 9, 9, 9, 8], "c")
    assert bm.allocate(c) == 4
    bm.check_integrity()


def test_freed_blocks_stay_cached_and_are_reused_tail_first():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5, 6, 7])  # blocks [1,2] [3,4] [5,6] [7]
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    assert bm.num_free == 4
    assert bm.allocate(seq([1, 2, 3, 4, 5, 6, 7], "again")) == 6  # all three full blocks still cached after free
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5, 6, 7])
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    bm.allocate(seq([9], "x"))  # least recently freed first: the partial tail block ...
    bm.allocate(seq([8], "y"))  # ... then the tail's full block [5,6], while the shared head survives
    assert len(bm._cached_prefix(seq([1, 2, 3, 4, 5, 6, 7], "head"), 6)) == 2
    bm.check_integrity()


def test_hold_keeps_block_out_of_free_list():
    bm = BlockManager(2, 2)
    a = seq([1, 2, 3])
    bm.allocate(a)
    blocks = list(a.block_table)
    bm.hold(blocks)
    bm.deallocate(a)
    assert bm.num_free == 0 and not bm.can_allocate(seq([5, 6], "x"))
    bm.release(blocks)
    assert bm.num_free == 2
    bm.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "append", "free", "hold", "release"]),
                          st.lists(st.integers(0, 3), min_size=1, max_size=14)), max_size=40))
def test_random_operations_keep_integrity(ops):
    bm = BlockManager(12, 4)
    live, held = [], []
    for i, (op, tokens) in enumerate(ops):
        if op == "alloc":
            s = seq(tokens, str(i))
            if bm.can_allocate(s):
                hit = bm.allocate(s)
                assert hit % 4 == 0 and hit < s.num_tokens
                assert s.token_ids[:hit] == list(tokens[:hit])
                computed(bm, s)
                live.append(s)
        elif op == "append" and live:
            s = live[len(tokens) % len(live)]
            s.token_ids.append(tokens[0])
            if bm.can_append(s):
                bm.may_append(s)
                computed(bm, s)
            else:
                s.token_ids.pop()
        elif op == "free" and live:
            bm.deallocate(live.pop(len(tokens) % len(live)))
        elif op == "hold" and live:
            blocks = list(live[len(tokens) % len(live)].block_table)
            bm.hold(blocks)
            held.append(blocks)
        elif op == "release" and held:
            bm.release(held.pop())
        bm.check_integrity()
        for s in live:  # every cached block a live sequence points at holds that sequence's tokens
            for j, block_id in enumerate(s.block_table[: s.num_hashed_blocks]):
                assert bm.blocks[block_id].token_ids == tuple(s.token_ids[j * 4 : (j + 1) * 4])
    for s in live:
        bm.deallocate(s)
    for blocks in held:
        bm.release(blocks)
    bm.check_integrity()
    assert bm.num_free == 12


@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.sampled_from([1, 4, 16]),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)))
@settings(max_examples=60, deadline=None)
def test_block_hashes_equal_the_chain_of_block_hash(tokens, block_size, parent):
    """The one-pass chain the block manager uses gives block_hash's values, block by block (the local prefix cache's
    keys are unchanged by computing them faster)."""
    expected, previous = [], parent
    for i in range(len(tokens) // block_size):
        previous = block_hash(previous, tokens[i * block_size : (i + 1) * block_size])
        expected.append(previous)
    assert block_hashes(parent, tokens, block_size) == expected


def test_a_sequence_s_chain_is_computed_once_and_extended():
    bm = BlockManager(16, 4)
    a = seq(range(10))
    bm.allocate(a)
    computed(bm, a)  # two full blocks registered
    assert a.block_hashes == [bm.blocks[a.block_table[0]].hash, bm.blocks[a.block_table[1]].hash]
    a.token_ids += [10, 11, 12, 13, 14]
    bm.may_append(a)
    computed(bm, a)  # the chain grows to the new full blocks, continuing from the last one
    assert len(a.block_hashes) == 3 and bm.blocks[a.block_table[2]].hash == a.block_hashes[2]
    assert block_hashes(None, list(range(12)), 4) == a.block_hashes


def test_admission_hashes_a_long_prompt_only_as_far_as_its_cached_prefix_reaches():
    """Before a prompt's first token only the blocks a prefix-cache lookup needs are hashed (doubling past the
    hits): a 128k prompt that misses at once hashes 16 of its 8,192 blocks; one with a 40-block cached prefix hashes
    64; the rest are hashed when its blocks are registered, after the token. Hits are the same either way."""
    bm = BlockManager(400, 4)
    a = seq(range(161))  # 40 full blocks computed (the last token never is)
    bm.allocate(a)
    computed(bm, a)
    miss = seq([7] * 1000, "miss")  # 250 blocks, none cached
    assert bm.can_allocate(miss) and bm.allocate(miss) == 0 and len(miss.block_hashes) == 16
    bm.deallocate(miss)
    hit = seq(list(range(160)) + [5] * 840, "hit")  # the 40 cached blocks, then 210 new ones
    assert bm.allocate(hit) == 160 and hit.block_table[:40] == a.block_table[:40]
    assert len(hit.block_hashes) == 64
    hit.num_computed = hit.num_tokens - 1
    bm.register_computed(hit)
    assert hit.block_hashes == block_hashes(None, hit.token_ids[:996], 4)
    bm.check_integrity()
