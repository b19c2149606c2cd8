"""Round trips against a real `kvshare pool serve` process: every message, every error reply, TCP with a token."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvshare.pool import protocol as p
from kvshare.pool.client import PoolClient, PoolError, PoolUnavailable, checksum
from kvshare.pool.protocol import ErrorCode
from kvshare.pool.testing import start_pool
from kvshare.transfer import arena_pages
from tests.pool.conftest import NS, PAGE, new_chunks, prompt, random_bytes


def test_store_then_lookup_round_trip_is_byte_exact(client, ns):  # I1, I2
    keys, tokens = prompt(3, ns=ns)
    data = [random_bytes(PAGE * 2 + 123, seed=i) for i in range(3)]  # spans 3 pages each
    reservation = client.reserve(ns, new_chunks(keys, tokens, len(data[0]), ns))
    assert all(len(ref.pages) == 3 for ref in reservation.chunks)
    for ref, chunk in zip(reservation.chunks, data):
        client.write(ref, chunk)
    assert client.lookup(ns, keys, tokens).lease == 0  # written but not committed: invisible
    client.commit(reservation.lease, [checksum(d) for d in data])
    found = client.lookup(ns, keys, tokens)
    assert found.lease and len(found.chunks) == 3
    for ref, chunk in zip(found.chunks, data):
        assert ref.checksum == checksum(chunk)
        assert client.read(ref).tobytes() == chunk
    client.release(found.lease)
    assert client.health(deep=True)


def test_torch_and_numpy_views_share_the_arena(client, ns):
    keys, tokens = prompt(1, ns=ns)
    ref = client.reserve(ns, new_chunks(keys, tokens, 64, ns)).chunks[0]
    arena_pages(client)[ref.pages[0], :64] = 9
    assert (client.pages[ref.pages[0], :64] == 9).all()


def test_stats_count_hits_misses_tokens_and_requests(pool_server):
    client = PoolClient.connect(pool_server)
    client.hello(NS)
    keys, tokens = prompt(4)
    r = client.reserve(NS, new_chunks(keys[:2], tokens[:2], 100))
    client.commit(r.lease, [0, 0])
    client.release(client.lookup(NS, keys, tokens).lease)
    stats = client.stats()
    assert (stats.hit_chunks, stats.miss_chunks, stats.hit_tokens, stats.miss_tokens) == (2, 2, 32, 32)
    assert stats.chunks == 2 and stats.bytes_stored == 200 and stats.pages_used == 2
    assert stats.requests["lookup"].count == 1 and stats.clients == 1 and stats.ready
    assert stats.pages_free + stats.pages_used == stats.num_pages == 64
    client.close()


def test_error_replies_keep_the_connection(client, ns):
    keys, tokens = prompt(2, ns=ns)
    cases = [
        (lambda: client.lookup(b"x" * 16, keys, tokens), ErrorCode.UNKNOWN_NAMESPACE),
        (lambda: client.release(12345), ErrorCode.UNKNOWN_LEASE),
        (lambda: client.lookup(ns, keys, tokens[:1]), ErrorCode.BAD_REQUEST),
        (lambda: client.reserve(ns, new_chunks(keys, tokens, 0, ns)), ErrorCode.BAD_REQUEST),
    ]
    for call, code in cases:
        with pytest.raises(PoolError) as error:
            call()
        assert error.value.code == code, error.value
    r = client.reserve(ns, new_chunks(keys, tokens, 10, ns))
    client.commit(r.lease, [1, 2])
    with pytest.raises(PoolError) as error:
        client.commit(r.lease, [1, 2])  # double commit
    assert error.value.code == ErrorCode.UNKNOWN_LEASE and "already ended" in str(error.value)
    assert client.health(deep=True)


def test_leases_are_per_connection(shared_pool, client, ns):
    keys, tokens = prompt(1, ns=ns)
    r = client.reserve(ns, new_chunks(keys, tokens, 10, ns))
    with PoolClient.connect(shared_pool) as other:
        with pytest.raises(PoolError):
            other.commit(r.lease, [0])
    client.commit(r.lease, [0])


def test_clear_keeps_leased_chunks(pool_server, ns):
    client = PoolClient.connect(pool_server)  # a pool of its own: CLEAR is global
    client.hello(ns)
    a, a_tokens = prompt(1, seed=1, ns=ns)
    b, b_tokens = prompt(1, seed=2, ns=ns)
    for keys, tokens in ((a, a_tokens), (b, b_tokens)):
        client.commit(client.reserve(ns, new_chunks(keys, tokens, 10, ns)).lease, [0])
    lease = client.lookup(ns, a, a_tokens).lease
    assert client.clear() == 1
    assert client.lookup(ns, a, a_tokens).chunks and not client.lookup(ns, b, b_tokens).chunks
    client.release(lease)
    client.close()


def test_missing_socket_says_what_to_do(tmp_path):
    with pytest.raises(PoolUnavailable, match="kvshare pool serve --socket"):
        PoolClient.connect(str(tmp_path / "none.sock"))


def test_tcp_requires_the_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with start_pool("16MiB", page_size=PAGE, tcp=f"127.0.0.1:{port}", token_file=token_file) as (_, _process):
        address = f"tcp://127.0.0.1:{port}"
        with pytest.raises(PoolError) as error:
            PoolClient.connect(address, token="wrong")
        assert error.value.code == ErrorCode.AUTH
        with PoolClient.connect(address, token="s3cret") as client:
            client.hello(NS)
            assert client.health() and client.pages.shape == (16, PAGE)


def test_stats_cli_prints_json_and_table(shared_pool):
    command = [sys.executable, "-m", "kvshare.cli", "pool", "stats", "--socket", shared_pool]
    out = subprocess.run(command + ["--json"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["num_pages"] == 64
    table = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "capacity" in table and "64.0 MiB" in table


def test_numpy_write_rejects_wrong_size(client, ns):
    keys, tokens = prompt(1, ns=ns)
    ref = client.reserve(ns, new_chunks(keys, tokens, 10, ns)).chunks[0]
    with pytest.raises(ValueError):
        client.write(ref, np.zeros(11, dtype=np.uint8))


def test_one_client_is_safe_to_share_between_threads(client, ns):
    from concurrent.futures import ThreadPoolExecutor

    keys, tokens = prompt(4, ns=ns)
    client.commit(client.reserve(ns, new_chunks(keys, tokens, 10, ns)).lease, [1, 2, 3, 4])

    def work(i: int) -> list[int]:
        found = client.lookup(ns, keys[: 1 + i % 4], tokens[: 1 + i % 4])
        client.release(found.lease)
        return [c.checksum for c in found.chunks]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(200)))
    assert results == [[1, 2, 3, 4][: 1 + i % 4] for i in range(200)]  # every reply went to its own request


def test_lookup_reply_arrays_turn_back_into_chunk_refs():
    """Flat LOOKUP replies (PROTOCOL_VERSION 2): uneven page counts, and arrays that do not fit together refused."""
    keys = [bytes([i]) * 16 for i in range(4)]
    chunks = [(keys[0], [7], 100, 1), (keys[1], [3, 9, 2], 5000, 2**64 - 1), (keys[2], [], 0, 0)]
    records = b"".join(p.CHUNK_RECORD.pack(nbytes, checksum, len(pages)) for _, pages, nbytes, checksum in chunks)
    pages = struct.pack("<4I", 7, 3, 9, 2)
    reply = p.reply_decoder.decode(p.frame(p.LookupReply(5, records, pages))[p.HEADER.size :])
    assert reply.num_chunks == 3
    assert [(c.key, c.pages, c.nbytes, c.checksum) for c in reply.refs(keys)] == chunks
    assert p.LookupReply(0).refs(keys) == []
    for bad in (p.LookupReply(5, records, pages[:-4]), p.LookupReply(5, records + b"x", pages),
                p.LookupReply(5, records * 2, pages)):  # a page short, a torn record, more chunks than keys
        with pytest.raises(ValueError):
            bad.refs(keys)
