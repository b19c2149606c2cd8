"""The packed linear-attention state (kvshare.transfer.state): equal states pack to equal bytes (gaps zero, whatever
the buffer held before), and a state stored into arena pages reads back byte for byte with the checksum of what the
pages hold."""

from __future__ import annotations

import pytest
import torch

from kvshare.transfer.state import StateLayout, load_state, store_state

# Parts whose sizes are not multiples of 64 bytes, so that every part but the first follows a gap.
SHAPES = [((3, 5, 7), torch.float32), ((11, 3), torch.bfloat16)] * 2


def states(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES]


def test_equal_states_pack_to_equal_bytes_with_zero_gaps(monkeypatch):
    layout = StateLayout.of_parts(SHAPES)
    assert layout.nbytes % 64 == 0 and all(p.offset % 64 == 0 for p in layout.parts)
    # fresh buffers that hold old bytes, as memory handed back by a (pinned) caching allocator does
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(0xAB))
    a, b = layout.pack(states(0)), layout.pack(states(0))
    assert torch.equal(a, b)
    covered = torch.zeros(layout.nbytes, dtype=torch.bool)
    for p in layout.parts:
        covered[p.offset : p.offset + p.nbytes] = True
    assert not covered.all()  # the case under test: there are gaps
    assert int(a[~covered].count_nonzero()) == 0
    for view, tensor in zip(layout.views(a), states(0)):
        assert torch.equal(view, tensor)


def test_a_stored_state_reads_back_byte_for_byte_with_its_checksum():
    layout = StateLayout.of_parts(SHAPES)
    page_size = 256
    arena = torch.zeros(8, page_size, dtype=torch.uint8)
    pages = [5, 2, 7, 0, 3]  # not in order: a state's pages are wherever the pool put them
    assert len(pages) == layout.pages_for(page_size)
    packed = layout.pack(states(1))
    stored = store_state(arena, pages, packed)
    out = layout.new_buffer()
    assert load_state(arena, pages, out) == stored
    assert torch.equal(out, packed)
    arena[pages[-1], 0] ^= 1  # one bit of the last page
    assert load_state(arena, pages, layout.new_buffer()) != stored
    with pytest.raises(ValueError, match="spans"):
        store_state(arena, pages[:1], packed)
