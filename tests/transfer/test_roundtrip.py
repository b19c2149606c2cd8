"""CPU byte-exact store/load round trips for every kind, bad input refused before any copy, checksums."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare import checksum
from kvshare.transfer import KINDS, SKIP, KVLayout, LoadJob, StoreJob, make_transfer
from tests.transfer.conftest import block_bytes_of, make_kv, reference_chunk

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def cases(draw):
    layout = KVLayout(
        num_layers=draw(st.integers(1, 4)), num_blocks=draw(st.integers(4, 24)),
        block_size=draw(st.sampled_from([1, 2, 4])),
        num_kv_heads=draw(st.integers(1, 3)), head_size=draw(st.sampled_from([2, 4, 8])),
        dtype=draw(st.sampled_from(DTYPES)), kind=draw(st.sampled_from(list(KINDS))),
    )
    blocks_per_chunk = draw(st.integers(1, max(1, layout.num_blocks // 4)))
    page_size = layout.block_bytes * draw(st.integers(1, 5)) + draw(st.sampled_from([0, 1, 7]))
    chunks = draw(st.integers(1, 2))
    ids = draw(st.permutations(range(layout.num_blocks)))[: 2 * chunks * blocks_per_chunk]
    waves = draw(st.integers(1, 3))  # a load in layer waves moves the same bytes (on the loader thread)
    return layout, blocks_per_chunk, page_size, chunks, ids, draw(st.booleans()), draw(st.booleans()), waves


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_round_trip_is_byte_exact(arena, case):
    layout, bpc, page_size, chunks, ids, fused, skip_first, waves = case
    layers = make_kv(layout, fused=fused)
    need = layout.pages_needed(bpc * layout.block_size, page_size)
    pages = arena(need * chunks + 1, page_size)
    pages.fill_(0xEE)  # pages reused from earlier chunks: their tails hold old bytes
    transfer = make_transfer(layout, layers, pages)
    page_ids = np.random.default_rng(0).permutation(need * chunks + 1)[: need * chunks].reshape(chunks, need)
    sources = [ids[c * bpc : (c + 1) * bpc] for c in range(chunks)]
    targets = [ids[(chunks + c) * bpc : (chunks + c + 1) * bpc] for c in range(chunks)]
    stored_sums = transfer.store([StoreJob(sources[c], page_ids[c].tolist()) for c in range(chunks)]).checksums()

    nbytes = layout.chunk_nbytes(bpc * layout.block_size, page_size)
    used = layout.units_per_page(page_size) * layout.block_bytes
    for c in range(chunks):
        stored = np.concatenate([pages[p, : min(used, nbytes - k * page_size)].numpy()
                                 for k, p in enumerate(page_ids[c])])
        expected = reference_chunk(layout, layers, sources[c])
        assert np.array_equal(stored, expected)
        # The pool's view: the whole extent, page tails included, which the store zeroed.
        assert stored_sums[c] == checksum.checksum(with_zero_tails(expected, page_size, used))
        assert transfer.checksum(page_ids[c].tolist(), nbytes) == stored_sums[c]

    before = {(l, b): block_bytes_of(layout, layers[l], b)
              for l in range(layout.num_layers) for b in range(layout.num_blocks)}
    loads = [[SKIP if (skip_first and i == 0) else b for i, b in enumerate(t)] for t in targets]
    loaded = transfer.load([LoadJob(page_ids[c].tolist(), loads[c]) for c in range(chunks)], checksums=True,
                           waves=waves)
    loaded.wait()
    assert loaded.checksums() == stored_sums
    written = {b: s for c in range(chunks) for b, s in zip(loads[c], sources[c]) if b != SKIP}
    for l in range(layout.num_layers):
        for b in range(layout.num_blocks):
            want = before[(l, written[b])] if b in written else before[(l, b)]  # untouched unless loaded
            assert np.array_equal(block_bytes_of(layout, layers[l], b), want), (l, b)


def with_zero_tails(units: np.ndarray, page_size: int, used: int) -> np.ndarray:
    """A chunk's extent built from its packed units: each page's units, then zeros to the page's end (not after the
    last page's units)."""
    pieces = [units[k : k + used] for k in range(0, len(units), used)]
    return np.concatenate([np.pad(p, (0, page_size - len(p))) for p in pieces[:-1]] + pieces[-1:])


def test_load_checksums_see_a_flipped_byte(arena):
    layout = KVLayout(2, 8, 4, 2, 8, torch.bfloat16)
    pages = arena(4, 512)  # 2 units a page: the chunk spans 2 pages
    transfer = make_transfer(layout, make_kv(layout), pages)
    stored = transfer.store([StoreJob([1, 2], [0, 2]), StoreJob([3, 4], [1, 3])]).checksums()
    nbytes = layout.chunk_nbytes(8, 512)
    assert transfer.checksum([0, 2], nbytes) == stored[0]
    pages[2, 5] ^= 0x10
    assert transfer.checksum([0, 2], nbytes) != stored[0]
    loaded = transfer.load([LoadJob([0, 2], [5, 6]), LoadJob([1, 3], [6 + 1, 0])], checksums=True).checksums()
    assert loaded[0] != stored[0] and loaded[1] == stored[1]
    with pytest.raises(ValueError, match="no checksums"):
        transfer.load([LoadJob([1, 3], [5, 6])]).checksums()


@pytest.mark.parametrize(
    "job, loading, message",
    [
        (StoreJob([0, 8], [0]), False, "out of range"),
        (StoreJob([0, -1], [0]), False, "out of range"),  # SKIP is for loads only
        (StoreJob([0, 1], [0, 1]), False, "need 1 pages"),
        (StoreJob([0, 1], [9]), False, "page ids must be in"),
        (LoadJob([0], [3, 3]), True, "written twice"),
        (LoadJob([0], [0, 9]), True, "out of range"),
        (LoadJob([0], []), True, "no block ids"),
    ],
)
def test_bad_jobs_are_refused_before_any_copy(arena, job, loading, message):
    layout = KVLayout(2, 8, 4, 2, 8, torch.bfloat16)
    layers = make_kv(layout)
    pages = arena(4, 1024)  # 4 units a page: a 2-block chunk fills exactly one page
    transfer = make_transfer(layout, layers, pages)
    good = StoreJob([4, 5], [3]) if not loading else LoadJob([3], [6, 7])
    snapshot = [t.clone() for t in layers], pages.clone()
    with pytest.raises(ValueError, match=message):
        (transfer.load if loading else transfer.store)([good, job])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(snapshot[0], layers))
    assert torch.equal(snapshot[1], pages)


def test_bad_setup_is_refused(arena):
    layout = KVLayout(2, 8, 4, 2, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="page size of at least"):
        make_transfer(layout, make_kv(layout), arena(2, 128))
    with pytest.raises(ValueError, match="not a positive multiple"):
        layout.pages_needed(6, 1024)
    with pytest.raises(ValueError, match="layers"):
        make_transfer(layout, make_kv(layout)[:1], arena(2, 1024))


def test_round_trip_through_a_real_pool():
    from kvshare.validate.transfer import ValidateConfig, run

    report = run(ValidateConfig(device="cpu", trials=4))  # trials 1 and 3 load in layer waves
    assert report.passed and report.modes[0].trials == 4, report
