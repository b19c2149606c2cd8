"""The arena's DMA registration in pieces (kvshare.transfer.hostmem) and copy plans that never cross a piece: the
bookkeeping with a recording register function (no GPU needed), and a copy plan whose chunk spans two pieces,
executed with plain host copies, byte-exact. The CUDA round trip across piece boundaries is in
test_transfer_cuda.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvshare.transfer import KVLayout, StoreJob
from kvshare.transfer.blocks import build_block_space
from kvshare.transfer.cuda import SlotItem, page_runs
from kvshare.transfer.hostmem import Pieces, Registration
from kvshare.transfer.jobs import plan
from tests.transfer.conftest import make_kv, reference_chunk

PAGE = 4096
BASE = 1 << 40  # a made-up address: the recording register function never touches memory


class Recorder:
    """register/unregister that record what they were asked; `slow` pieces take a while, `broken` ones fail."""

    def __init__(self, slow: float = 0.0, broken: frozenset[int] = frozenset()):
        self.slow, self.broken = slow, broken
        self.calls: list[tuple[int, int]] = []
        self.finished: set[int] = set()  # addresses whose registration has returned
        self.unregistered: list[int] = []
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self.calls.append((ptr, nbytes))
        time.sleep(self.slow)
        if (ptr - BASE) // PAGE in self.broken:
            raise RuntimeError(f"cannot pin {ptr:#x}")
        with self._lock:
            self.finished.add(ptr)

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def registration(num_pages: int, pages_per_piece: int, recorder: Recorder, threads: int = 3) -> Registration:
    return Registration(BASE, Pieces(num_pages, PAGE, pages_per_piece), threads, recorder.register,
                        recorder.unregister)


def test_pieces_cut_the_arena_into_whole_pages():
    pieces = Pieces.of(10, PAGE, 3 * PAGE + 100)  # a piece size that is not a whole number of pages rounds down
    assert pieces.pages_per_piece == 3 and pieces.count == 4
    assert [pieces.pages(i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert pieces.containing([8, 2, 9, 6]) == [0, 2, 3]
    assert Pieces.of(10, PAGE, 1).pages_per_piece == 1  # never less than one page
    with pytest.raises(ValueError, match="positive"):
        Pieces.of(10, PAGE, 0)


def test_background_registration_covers_the_arena_once():
    recorder = Recorder()
    reg = registration(10, 3, recorder).start()
    reg.wait_all()
    spans = sorted(recorder.calls)
    assert spans == [(BASE, 3 * PAGE), (BASE + 3 * PAGE, 3 * PAGE), (BASE + 6 * PAGE, 3 * PAGE),
                     (BASE + 9 * PAGE, PAGE)]  # contiguous, disjoint, the last piece shorter, each exactly once
    assert reg.registered() == 4
    reg.close()
    assert sorted(recorder.unregistered) == [ptr for ptr, _ in spans]


def test_without_ahead_only_the_pieces_a_transfer_touches_are_registered():
    recorder = Recorder()
    reg = registration(12, 4, recorder)
    reg.ensure([5, 6])
    assert recorder.calls == [(BASE + 4 * PAGE, 4 * PAGE)]
    reg.ensure([4, 7, 5])  # already registered: no second call
    assert len(recorder.calls) == 1 and reg.registered() == 1


def test_ensure_returns_only_after_its_pieces_are_registered():
    """Many threads ask for overlapping pieces while the background workers run: every piece is registered once,
    and each ensure() returns only when its pieces' registrations have returned."""
    recorder = Recorder(slow=0.02)
    reg = registration(40, 2, recorder, threads=2).start()
    problems = []

    def use(pages):
        reg.ensure(pages)
        missing = [p for p in pages if BASE + (p // 2) * 2 * PAGE not in recorder.finished]
        if missing:
            problems.append(missing)

    workers = [threading.Thread(target=use, args=([39 - i, 20 + i % 7],)) for i in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    reg.wait_all()
    assert problems == []
    assert len(recorder.calls) == len(set(recorder.calls)) == 20


def test_a_failed_piece_raises_in_every_transfer_that_needs_it():
    recorder = Recorder(broken=frozenset({4}))  # the piece starting at page 4
    reg = registration(8, 4, recorder)
    reg.ensure([0, 3])
    for _ in range(2):  # the same error again: the piece is not retried behind the caller's back
        with pytest.raises(RuntimeError, match="cannot pin"):
            reg.ensure([1, 5])
    assert recorder.calls.count((BASE + 4 * PAGE, 4 * PAGE)) == 1
    reg.close()
    assert recorder.unregistered == [BASE]  # only what was registered is unregistered


def test_the_arena_is_logged_registered_once_and_only_when_every_piece_is(caplog):
    """The replica's log says when loads stop waiting for registration: one line, after the last piece (many
    threads finish pieces), and none where a piece failed."""
    caplog.set_level("INFO", logger="kvshare.transfer")
    reg = registration(40, 2, Recorder(slow=0.005), threads=4).start()
    reg.wait_all()
    told = [r.message for r in caplog.records if "arena registered" in r.message]
    assert len(told) == 1 and "in 20 pieces" in told[0] and f"{40 * PAGE / 2**30:.1f} GiB" in told[0]
    reg.wait_all()  # nothing more to register: no second line
    assert len([r for r in caplog.records if "arena registered" in r.message]) == 1
    reg.close()

    caplog.clear()
    broken = registration(8, 4, Recorder(broken=frozenset({4})))
    with pytest.raises(RuntimeError, match="cannot pin"):
        broken.wait_all()
    assert not [r for r in caplog.records if "arena registered" in r.message]
    broken.close()


def test_a_copy_plan_never_crosses_a_piece_and_is_byte_exact():
    """A chunk of 4 adjacent, fully used pages [3, 7) in an arena cut into pieces of 2 pages: its copies are cut at
    pages 4 and 6, and carrying them out (staging -> arena, as a store's DMA does) writes exactly the packed chunk."""
    layout = KVLayout(4, 32, 16, 2, 8, torch.float32)  # 2 KiB blocks: 2 units a 4 KiB page, no page tail
    layers = make_kv(layout)
    space = build_block_space(layout, layers)
    arena = np.zeros((12, PAGE), dtype=np.uint8)
    blocks = [5, 9]  # 2 blocks x 4 layers = 8 units = 4 pages
    (chunk,) = plan(space, [StoreJob(blocks, [3, 4, 5, 6])], PAGE, 12, loading=False)
    pieces = Pieces(12, PAGE, 2)
    runs = page_runs(SlotItem(chunk, 0, 0, 4), PAGE, layout.block_bytes, pieces)
    assert [(page, nbytes // PAGE) for _, page, nbytes in runs] == [(3, 1), (4, 2), (6, 1)]
    for _, page, nbytes in runs:  # no run ends in another piece than it starts in
        assert pieces.containing([page]) == pieces.containing([page + nbytes // PAGE - 1])
    staging = reference_chunk(layout, layers, blocks)  # what the gather leaves in the slot: the packed chunk
    for k0, page, nbytes in runs:
        arena.reshape(-1)[page * PAGE : page * PAGE + nbytes] = staging[k0 * PAGE : k0 * PAGE + nbytes]
    assert np.array_equal(arena[3:7].reshape(-1), staging)
    assert not arena[:3].any() and not arena[7:].any()
    whole = page_runs(SlotItem(chunk, 0, 0, 4), PAGE, layout.block_bytes, Pieces(12, PAGE, 12))
    assert [(page, nbytes // PAGE) for _, page, nbytes in whole] == [(3, 4)]  # one piece: one merged copy
