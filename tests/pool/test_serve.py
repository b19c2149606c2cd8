"""`kvshare pool serve` as a process: readiness, permissions, clean shutdown, refusal of impossible sizes, and
`kvshare pool check` (the full-pool allocation check)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from kvshare.pool.check import check_pool
from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.testing import start_pool
from tests.pool.conftest import NS, PAGE, new_chunks, prompt, random_bytes

SERVE = [sys.executable, "-m", "kvshare.cli", "pool", "serve"]


def test_full_pool_check_on_a_small_pool():
    with start_pool("64MiB", page_size=PAGE, max_leased_pages_per_client=0) as (address, _process):
        with PoolClient.connect(address) as client:
            result = check_pool(client)
            assert result.ok and result.pages == 64 and result.bytes_checked == 64 * PAGE
            assert client.stats().pages_free == 64 and client.health(deep=True)


def test_check_finds_a_corrupted_page():
    """The check can fail: one byte flipped between write and verify is reported, with its page."""
    with start_pool("8MiB", page_size=PAGE, max_leased_pages_per_client=0) as (address, _process):
        with PoolClient.connect(address) as client:

            def flip_one_byte(pages):
                pages[3, 12345] ^= 0xAB

            result = check_pool(client, corrupt=flip_one_byte)
            assert not result.ok and result.bad_pages == [3]


def test_check_command_reports_success():
    out = subprocess.run([sys.executable, "-m", "kvshare.cli", "pool", "check", "--size", "32MiB"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bad pages: 0" in out.stdout and "GiB/s" in out.stdout


def test_check_of_a_live_pool_leaves_its_chunks_intact():
    """`pool check --socket` checks free pages only: every committed chunk keeps its bytes and stays found; only
    --destructive clears the pool first (and says so)."""
    keys, tokens = prompt(4)
    data = [random_bytes(PAGE + 100, seed=i) for i in range(4)]
    check = [sys.executable, "-m", "kvshare.cli", "pool", "check"]
    with start_pool("32MiB", page_size=PAGE) as (address, _process), PoolClient.connect(address) as client:
        client.hello(NS)
        r = client.reserve(NS, new_chunks(keys, tokens, PAGE + 100))
        for ref, chunk in zip(r.chunks, data):
            client.write(ref, chunk)
        client.commit(r.lease, [checksum(d) for d in data])
        out = subprocess.run(check + ["--socket", address], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "read-only" in out.stdout and "4 before, 4 after" in out.stdout and "bad pages: 0" in out.stdout
        found = client.lookup(NS, keys, tokens)
        assert [client.read(ref).tobytes() for ref in found.chunks] == data
        client.release(found.lease)
        assert client.stats().chunks == 4 and client.health(deep=True)
        out = subprocess.run(check + ["--socket", address, "--destructive"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "destructive" in out.stdout, out.stdout + out.stderr
        assert client.stats().chunks == 0


def test_a_pool_removes_the_arena_a_killed_pool_left_and_says_so(tmp_path):
    """SIGKILL leaves kvshare-<pid>.arena in /dev/shm holding its memory; the next pool of this user removes it, and
    never the arena of a live pool."""
    def serve(name: str) -> subprocess.Popen:
        return subprocess.Popen(SERVE + ["--size", "8MiB", "--page-size", "1MiB", "--socket", str(tmp_path / name)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ready(process: subprocess.Popen) -> list[str]:
        lines = []
        while not (lines and "ready" in lines[-1]):
            lines.append(process.stdout.readline())
            assert lines[-1], "".join(lines)
        return lines

    dead, live = serve("dead.sock"), serve("live.sock")
    ready(dead), ready(live)
    dead_arena, live_arena = f"/dev/shm/kvshare-{dead.pid}.arena", f"/dev/shm/kvshare-{live.pid}.arena"
    dead.kill()
    dead.wait()
    assert os.path.exists(dead_arena)
    fresh = serve("fresh.sock")
    try:
        said = "".join(ready(fresh))
        assert f"removed {dead_arena}" in said and not os.path.exists(dead_arena)
        assert live_arena not in said and os.path.exists(live_arena)
    finally:
        for process in (live, fresh):
            process.terminate()
            process.wait(30)
        if os.path.exists(dead_arena):
            os.unlink(dead_arena)


def test_serve_refuses_a_size_larger_than_memory(tmp_path):
    started = time.monotonic()
    out = subprocess.run(SERVE + ["--size", "100TiB", "--socket", str(tmp_path / "s.sock")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "exceeds" in out.stderr and "lower --size" in out.stderr
    assert time.monotonic() - started < 30  # at once, not after trying to prepare
    assert not (tmp_path / "s.sock").exists()


def test_sigterm_removes_socket_and_arena_and_files_are_private(tmp_path):
    arena = f"/dev/shm/kvshare-test-{os.getpid()}-perm.arena"
    with start_pool("8MiB", page_size=PAGE, arena=arena) as (address, process):
        for path in (address, arena):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        assert not os.path.exists(address) and not os.path.exists(arena)


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_keep_keeps_files_and_sigint_stops(tmp_path, sig):
    arena = f"/dev/shm/kvshare-test-{os.getpid()}-keep.arena"
    sock = str(tmp_path / "keep.sock")
    process = subprocess.Popen(SERVE + ["--size", "8MiB", "--socket", sock, "--arena", arena, "--keep"],
                               stdout=subprocess.PIPE, text=True)
    try:
        lines = [process.stdout.readline() for _ in range(2)]
        assert "serving on" in lines[0] and "ready:" in lines[1] and "GiB/s" in lines[1]
        process.send_signal(sig)
        assert process.wait(20) == 0
        assert os.path.exists(arena) and os.path.exists(sock)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for path in (arena, sock):
            if os.path.exists(path):
                os.unlink(path)
