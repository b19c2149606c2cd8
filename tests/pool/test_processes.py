"""Several client processes on one pool: byte-exact sharing, and leases of a client killed mid-write (I8)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from kvshare.pool.client import PoolClient, PoolError
from kvshare.pool.testing import start_pool
from tests.pool.conftest import NS, PAGE, new_chunks, prompt

# A child process: `python -c CHILD <address> <mode>`; it speaks only through the pool and its exit code/stdout.
CHILD = textwrap.dedent("""
    import sys, time
    from kvshare.pool.client import PoolClient, checksum
    from tests.pool.conftest import NS, PAGE, new_chunks, prompt, random_bytes
    address, mode = sys.argv[1], sys.argv[2]
    keys, tokens = prompt(3, seed=42)
    data = [random_bytes(PAGE + 777, seed=i) for i in range(3)]
    with PoolClient.connect(address) as client:
        client.hello(NS, "child")
        if mode == "write":
            r = client.reserve(NS, new_chunks(keys, tokens, PAGE + 777))
            for ref, chunk in zip(r.chunks, data):
                client.write(ref, chunk)
            client.commit(r.lease, [checksum(d) for d in data])
            print("committed", flush=True)
        elif mode == "read":
            found = client.lookup(NS, keys, tokens)
            assert len(found.chunks) == 3, found
            for ref, chunk in zip(found.chunks, data):
                got = client.read(ref)
                assert got.tobytes() == chunk and checksum(got) == ref.checksum
            client.release(found.lease)
            print("verified", flush=True)
        elif mode == "hang-mid-write":
            r = client.reserve(NS, new_chunks(keys, tokens, PAGE + 777))
            client.write(r.chunks[0], data[0])  # then never commits
            print("reserved", flush=True)
            time.sleep(600)
""")


def child(address: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, address, mode], stdout=subprocess.PIPE, text=True)


def test_two_processes_share_chunks_byte_exact(pool_server):
    writer = child(pool_server, "write")
    assert writer.communicate(timeout=60)[0].strip() == "committed" and writer.returncode == 0
    reader = child(pool_server, "read")
    assert reader.communicate(timeout=60)[0].strip() == "verified" and reader.returncode == 0
    with PoolClient.connect(pool_server) as client:
        stats = client.stats()
        assert stats.hit_chunks == 3 and stats.chunks == 3 and client.health(deep=True)


def test_killed_writer_loses_its_lease_and_pages(pool_server):
    hung = child(pool_server, "hang-mid-write")
    try:
        assert hung.stdout.readline().strip() == "reserved"
        with PoolClient.connect(pool_server) as client:
            assert client.stats().write_leases == 1
            keys, tokens = prompt(3, seed=42)
            assert client.lookup(NS, keys, tokens).chunks == []  # half-written: invisible (I2)
            hung.kill()
            hung.wait(10)
            deadline = time.monotonic() + 10
            while client.stats().write_leases and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = client.stats()
            assert stats.write_leases == 0 and stats.pages_used == 0 and stats.pages_free == stats.num_pages
            assert client.health(deep=True)
            client.hello(NS)
            again = client.reserve(NS, new_chunks(keys, tokens, 10))  # the keys are free to be written again
            assert all(ref is not None for ref in again.chunks)
    finally:
        if hung.poll() is None:
            hung.kill()
            hung.wait()


def test_lease_timeout_fences_a_silent_clients_lease_until_it_finishes():  # I8, I10
    """Past its deadline a lease loses its rights, not its pages: they stay quarantined (the silent client may be
    stalled mid-copy) until its COMMIT says the copy is over; that COMMIT is refused and frees them."""
    with start_pool("16MiB", page_size=PAGE, lease_timeout=1.0) as (address, _process):
        with PoolClient.connect(address) as silent, PoolClient.connect(address) as observer:
            silent.hello(NS)
            keys, tokens = prompt(2)
            r = silent.reserve(NS, new_chunks(keys, tokens, PAGE))
            deadline = time.monotonic() + 15
            while not observer.stats().fenced_leases and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = observer.stats()
            assert stats.expired_leases == 1 and stats.pages_quarantined == stats.pages_used == 2
            try:
                silent.commit(r.lease, [0, 0])
                raise AssertionError("commit of an expired lease succeeded")
            except PoolError as error:
                assert error.code == "lease_expired" and "expired" in str(error)
            stats = observer.stats()
            assert stats.pages_used == stats.fenced_leases == stats.chunks == 0
            assert observer.health(deep=True)
