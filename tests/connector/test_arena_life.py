"""A pool life ends in order (kvshare.connector.arena_life): no copy starts after it is retired, the arena is
unregistered only after the last copy through it and before its mapping goes, and a replica whose pool died holds
none of the dead arena's memory (it used to keep it mapped, and on a GPU registered, until it reconnected)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from kvshare.connector.arena_life import ArenaLife
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout, hostmem, make_transfer
from kvshare.transfer.shm import shm_pages
from tests.connector.test_shared_pool import attach, prompt_of, run
from tests.transfer.test_register_pieces import Recorder


class Events:
    """A stand-in transfer and client that log their close, in order."""

    def __init__(self):
        self.log: list[str] = []
        self.transfer, self.client = _Closer(self.log, "transfer"), _Closer(self.log, "client")


class _Closer:
    def __init__(self, log: list[str], name: str):
        self._log, self._name = log, name

    def close(self) -> None:
        self._log.append(self._name)


def test_a_retired_life_closes_after_its_last_copy_unregistering_before_unmapping():
    events = Events()
    life = ArenaLife("pool:1", events.transfer, events.client)
    assert life.acquire() and life.acquire()  # a load and a store in flight
    life.retire()
    assert not life.acquire(), "no copy may start on a retired arena"
    life.release()
    assert events.log == [] and not life.closed, "closed while a copy still ran through it"
    life.release()
    assert events.log == ["transfer", "client"] and life.closed  # unregister, then unmap
    life.retire()
    assert events.log == ["transfer", "client"], "closed twice"


def test_an_idle_life_closes_when_retired_and_a_racing_copy_either_runs_or_is_refused():
    events = Events()
    life = ArenaLife("pool:1", events.transfer, events.client)
    outcomes: list[bool] = []

    def copy():
        if life.acquire():
            outcomes.append(life.closed)  # must be False: the life cannot close under an acquired use
            life.release()

    threads = [threading.Thread(target=copy) for _ in range(32)]
    for t in threads[:16]:
        t.start()
    life.retire()
    for t in threads[16:]:
        t.start()
    for t in threads:
        t.join()
    assert not any(outcomes) and life.closed and events.log == ["transfer", "client"]


def test_closing_a_transfer_unregisters_the_pieces_of_its_arena():
    layout = KVLayout(2, 8, 16, 2, 32, torch.float16)  # layers, blocks, block size, KV heads, head size
    kv = [torch.zeros(layout.tensor_shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    with shm_pages(8, 64 << 10) as pages:
        recorder = Recorder()
        key = (pages.data_ptr(), pages.numel())
        registration = hostmem.Registration(pages.data_ptr(), hostmem.Pieces(8, 64 << 10, 4), 1, recorder.register,
                                            recorder.unregister)
        hostmem._registrations[key] = registration  # as a CUDA transfer over these pages would have left it
        registration.ensure(range(8))
        make_transfer(layout, kv, pages).close()
        assert sorted(recorder.unregistered) == [pages.data_ptr(), pages.data_ptr() + 4 * (64 << 10)]
        assert key not in hostmem._registrations


def mapped(path: str) -> int:
    """How many mappings of `path` this process holds (a removed file shows as 'path (deleted)')."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if path in line)


@pytest.mark.parametrize("verify", [True, False], ids=["verifying", "not verifying"])
def test_a_replica_whose_pool_died_maps_none_of_its_arena(engines, tmp_path, verify):
    """Also with checksum verification off: nothing of the dead pool's life is loaded after the restart, so every
    answer equals cache OFF without a checksum to catch it."""
    off, a, b = engines
    socket_path = str(tmp_path / "pool.sock")
    first, second = str(tmp_path / "first.arena"), str(tmp_path / "second.arena")
    prompt = prompt_of(100, seed=21)
    with start_pool("64MiB", page_size="64KiB", socket=socket_path, arena=first) as (address, process):
        attach(a, address, retry_interval=0.2, verify_checksums=verify)
        attach(b, address, retry_interval=0.2, verify_checksums=verify)
        assert run(a, prompt)[0] == run(off, prompt)[0]
        a.connector.core.flush()
        tokens, usage = run(b, prompt)
        assert usage.pool_hit_tokens == 96 and tokens == run(off, prompt)[0]
        assert mapped(first) == 2  # one mapping per connector
        process.send_signal(signal.SIGKILL)
        process.wait()
        for engine in (a, b):  # each finds the pool gone on its next request
            run(engine, prompt_of(100, seed=22), rid=f"down-{id(engine)}")
        assert mapped(first) == 0, "a dead pool's arena is still mapped: its memory cannot be freed"
    with start_pool("64MiB", page_size="64KiB", socket=socket_path, arena=second) as (address, _):
        threading.Event().wait(0.3)  # past retry_interval
        tokens, usage = run(b, prompt, rid="after-restart")
        assert usage.pool_hit_tokens == 0 and tokens == run(off, prompt)[0]
        assert run(a, prompt, rid="after-restart")[0] == run(off, prompt)[0]
        # Each engine's prefix cache still holds the prompt, so its LOOKUP is skipped and the new pool is first
        # reached by its store, on the storer thread: wait for those (the check raced them on a loaded machine).
        for engine in (a, b):
            engine.connector.core.flush()
        assert mapped(second) == 2 and mapped(first) == 0
    assert not os.path.exists(first)
