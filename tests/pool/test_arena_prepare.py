"""Arena preparation: every byte is allocated and, unless --no-fault-in, faulted in by the pool's own threads (tmpfs
zeroes a page on its first touch; docs/results/arena-fault-in.md measures who pays it), in whole segments, and the
progress reaches the whole size."""

from __future__ import annotations

import pytest

from kvshare.cli import build
from kvshare.pool import arena as arena_module
from kvshare.pool.arena import SEGMENT, Arena


@pytest.mark.parametrize("fault_in", [True, False])
def test_preparation_faults_in_every_segment_unless_told_not_to(tmp_path, monkeypatch, fault_in):
    touched: list[tuple[int, int]] = []
    real = arena_module._fault_in

    def recording(fd, offset, length):
        touched.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(arena_module, "_fault_in", recording)
    size = 2 * SEGMENT + 4096 * 3  # a last, partial segment too
    arena = Arena.create(str(tmp_path / "a.arena"), size)
    progress: list[int] = []
    try:
        arena.prepare(2, progress.append, fault_in).join()
    finally:
        arena.close(remove=True)
    assert progress[-1] == size
    if fault_in:
        assert sorted(touched) == [(0, SEGMENT), (SEGMENT, SEGMENT), (2 * SEGMENT, 4096 * 3)]
    else:
        assert touched == []


def test_the_flag_reaches_the_config():
    parser = build().parser
    assert parser.parse_args(["pool", "serve", "--size", "1GiB", "--socket", "s"]).fault_in is True
    assert parser.parse_args(["pool", "serve", "--size", "1GiB", "--socket", "s", "--no-fault-in"]).fault_in is False
