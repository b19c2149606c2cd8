"""Loads in layer waves: the plan moves every page once, wave by wave, and names for each layer the wave after which
it is whole; on a CPU the load returns while its pages move and wait_layer(l) returns once layer l is in."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.transfer import KVLayout, LoadJob, StoreJob, make_transfer
from kvshare.transfer.jobs import ChunkPlan
from kvshare.transfer.waves import plan_waves, wave_starts
from tests.transfer.conftest import block_bytes_of, make_kv


def test_waves_halve_towards_the_end():
    assert wave_starts(64, 1) == (0,)
    assert wave_starts(64, 4) == (0, 32, 48, 56)  # 32, 16, 8 and 8 layers: little compute after the last copy
    assert wave_starts(4, 8) == (0, 2, 3)  # never an empty wave
    assert wave_starts(1, 4) == (0,)
    with pytest.raises(ValueError, match="at least one wave"):
        wave_starts(8, 0)


def test_wave_starts_move_to_page_boundaries():
    """The CPU case of docs/results/cpu-load-waves: 12 layers of 16 blocks, 128 units a page (layers 0-7, 8-11).
    Waves starting at 0 and 6 would put both pages in the second wave; aligned, page 0 is the first wave."""
    chunk = ChunkPlan(np.arange(12 * 16), np.arange(2), 16, 128)
    plan = plan_waves([chunk, chunk], 12, 2)
    assert [(item.j0, item.j1, item.wave) for item in plan.items] == [(0, 1, 0), (0, 1, 0), (1, 2, 1), (1, 2, 1)]
    assert plan.ready.tolist() == [0] * 8 + [1] * 4
    assert plan_waves([chunk], 12, 4).ready.tolist() == [0] * 8 + [1] * 4  # 6, 9, 11 -> 8: two waves at most
    qwen_bf16 = ChunkPlan(np.arange(64 * 16), np.arange(32), 16, 32)  # 2 layers a page: the halving starts stay
    assert len(plan_waves([qwen_bf16], 64, 4).waves) == 4 and plan_waves([qwen_bf16], 64, 4).ready[47] == 1


@st.composite
def batches(draw):
    layers = draw(st.integers(1, 12))
    upp = draw(st.integers(1, 9))
    chunks = [draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 4)))]  # blocks per chunk (tails differ)
    return layers, upp, chunks, draw(st.integers(1, 6)), draw(st.one_of(st.none(), st.integers(1, 4)))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_every_page_moves_once_in_wave_order_and_ready_is_exact(batch):
    layers, upp, chunks, waves, max_pages = batch
    plans = [ChunkPlan(np.arange(layers * bpc), np.arange(-(-layers * bpc // upp)), bpc, upp) for bpc in chunks]
    plan = plan_waves(plans, layers, waves, max_pages)
    moved = [(item.chunk, j) for item in plan.items for j in range(item.j0, item.j1)]
    assert sorted(moved) == [(c, j) for c, chunk in enumerate(plans) for j in range(len(chunk.pages))]
    assert [item.wave for item in plan.items] == sorted(item.wave for item in plan.items)
    assert all(item.j1 - item.j0 <= (max_pages or 10**9) for item in plan.items)
    wave_of = {(item.chunk, j): item.wave for item in plan.items for j in range(item.j0, item.j1)}
    for layer in range(layers):  # ready[l]: the latest wave of any page holding a unit of layer l, no later
        holding = [wave_of[c, u // upp] for c, bpc in enumerate(chunks) for u in range(layer * bpc, (layer + 1) * bpc)]
        assert plan.ready[layer] == max(holding)


def _stored_transfer(arena):
    layout = KVLayout(4, 32, 4, 2, 8, torch.float32)  # 512-byte units, 2 a page: each page one layer's 2 blocks
    layers = make_kv(layout)
    pages = arena(16, 2 * layout.block_bytes)
    transfer = make_transfer(layout, layers, pages)
    sources, targets = [0, 1, 2, 3], [20, 21, 22, 23]
    transfer.store([StoreJob(sources[:2], [0, 1, 2, 3]), StoreJob(sources[2:], [4, 5, 6, 7])]).wait()
    jobs = [LoadJob([0, 1, 2, 3], targets[:2]), LoadJob([4, 5, 6, 7], targets[2:])]
    return layout, layers, transfer, jobs, sources, targets


def _loaded(layout, layers, layer, sources, targets):
    return all(np.array_equal(block_bytes_of(layout, layers[layer], t), block_bytes_of(layout, layers[layer], s))
               for s, t in zip(sources, targets))


def test_a_cpu_load_in_waves_returns_at_once_and_each_layer_is_in_when_its_wait_returns(arena, monkeypatch):
    layout, layers, transfer, jobs, sources, targets = _stored_transfer(arena)
    gate, copy = threading.Semaphore(0), transfer._load_pages

    def gated(*args):  # the loader thread moves one item per release
        assert gate.acquire(timeout=30)
        copy(*args)

    monkeypatch.setattr(transfer, "_load_pages", gated)
    handle = transfer.load(jobs, waves=3)  # layers 0-1, then 2, then 3: two items (one per chunk) each
    assert not any(_loaded(layout, layers, layer, sources, targets) for layer in range(4))  # returned, nothing moved
    gate.release(2)
    handle.wait_layer(1)
    assert _loaded(layout, layers, 0, sources, targets) and _loaded(layout, layers, 1, sources, targets)
    assert not _loaded(layout, layers, 2, sources, targets) and not handle.done()
    gate.release(4)
    handle.wait_layer(3)
    assert all(_loaded(layout, layers, layer, sources, targets) for layer in range(4))
    handle.wait()
    assert handle.done()


def test_a_failed_copy_releases_every_waiter_and_wait_raises(arena, monkeypatch):
    layout, layers, transfer, jobs, sources, targets = _stored_transfer(arena)

    def broken(*args):
        raise OSError("arena page gone")

    monkeypatch.setattr(transfer, "_load_pages", broken)
    handle = transfer.load(jobs, waves=2)
    handle.wait_layer(3)  # returns: no reader waits forever for a wave that will never land
    with pytest.raises(OSError, match="arena page gone"):
        handle.wait()
