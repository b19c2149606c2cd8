"""Bad input and faults: fuzzed and oversized frames, a full arena under leases; the server stays up and correct."""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import msgspec
import pytest

from kvshare.pool import protocol as p
from kvshare.pool.client import PoolClient, PoolError
from kvshare.pool.testing import start_pool
from tests.pool.conftest import NS, PAGE, new_chunks, prompt


def raw(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(address)
    return s


def send_body(s: socket.socket, body: bytes) -> p.Reply:
    s.sendall(struct.pack("<I", len(body)) + body)
    (length,) = struct.unpack("<I", recv_exactly(s, 4))
    return p.reply_decoder.decode(recv_exactly(s, length))


def recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def fuzz_bodies(rng: random.Random) -> list[bytes]:
    encode = msgspec.msgpack.encode
    valid = encode(p.Lookup.of(NS, [b"k" * 16], [b"t" * 4]))
    bodies = [b"", b"\xc1", encode({"type": "Nope"}), encode([1, 2, 3]), encode({"type": "Lookup"}),
              encode({"type": "Lookup", "namespace": 5, "keys": [], "tokens": b"", "token_lengths": []}),
              encode({"type": "Lookup", "namespace": NS, "keys": [b"k" * 16], "tokens": b"x", "token_lengths": [9]}),
              encode({"type": "Reserve", "namespace": NS, "chunks": [[b"k", b"p", b"", -1]]}),
              encode({"type": "Commit", "lease": 2**64 - 1, "checksums": []}),
              encode({"type": "Release", "lease": -1}), valid[:-3]]
    for _ in range(150):
        mutated = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        bodies.append(bytes(mutated))
        bodies.append(os.urandom(rng.randint(1, 64)))
    return bodies


def test_fuzzed_frames_get_error_replies_and_the_server_stays_correct(pool_server):
    with PoolClient.connect(pool_server) as good:
        good.hello(NS)
        keys, tokens = prompt(2)
        good.commit(good.reserve(NS, new_chunks(keys, tokens, 100)).lease, [5, 6])
        s = raw(pool_server)
        errors = 0
        for body in fuzz_bodies(random.Random(0)):
            reply = send_body(s, body)  # every frame gets exactly one reply on the same connection
            errors += isinstance(reply, p.Error)
        assert errors > 250
        s.close()
        found = good.lookup(NS, keys, tokens)  # the honest client is unaffected, the index intact
        assert [c.checksum for c in found.chunks] == [5, 6]
        good.release(found.lease)
        assert good.health(deep=True)


def test_oversized_frame_closes_only_that_connection(pool_server):
    with PoolClient.connect(pool_server) as good:
        s = raw(pool_server)
        s.sendall(struct.pack("<I", 2**31))
        (length,) = struct.unpack("<I", recv_exactly(s, 4))
        reply = p.reply_decoder.decode(recv_exactly(s, length))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_LARGE
        with pytest.raises(EOFError):
            recv_exactly(s, 1)  # the server closed it
        s.close()
        truncated = raw(pool_server)
        truncated.sendall(struct.pack("<I", 100) + b"abc")  # then vanishes mid-frame
        truncated.close()
        assert good.health(deep=True)


def test_full_arena_with_everything_leased_answers_no_space_at_once():
    # No per-client lease limit here: this test is about one client pinning the whole arena.
    with start_pool("8MiB", page_size=PAGE, max_leased_pages_per_client=0) as (address, _process):
        with PoolClient.connect(address) as holder, PoolClient.connect(address) as other:
            holder.hello(NS)
            keys, tokens = prompt(8)
            r = holder.reserve(NS, new_chunks(keys[:4], tokens[:4], PAGE))
            holder.commit(r.lease, [0] * 4)
            read_lease = holder.lookup(NS, keys[:4], tokens[:4]).lease  # 4 pages pinned by a read lease
            write = holder.reserve(NS, new_chunks(keys[4:], tokens[4:], PAGE, keys[3]))  # 4 pages being written
            assert write.lease and read_lease
            more, more_tokens = prompt(1, seed=7)
            started = time.monotonic()
            with pytest.raises(PoolError) as error:
                other.reserve(NS, new_chunks(more, more_tokens, PAGE))
            assert error.value.code == p.ErrorCode.NO_SPACE and "no space" in str(error.value)
            assert time.monotonic() - started < 5  # answered, not blocked until a lease ends (30 s)
            stats = other.stats()
            assert stats.no_space == 1 and stats.evictions == 0 and stats.pages_used == 8
            holder.release(read_lease)
            other.reserve(NS, new_chunks(more, more_tokens, PAGE))  # now an unleased chunk can be evicted
            assert other.stats().evictions >= 1 and other.health(deep=True)


def read_reply(s: socket.socket) -> p.Reply:
    (length,) = struct.unpack("<I", recv_exactly(s, 4))
    return p.reply_decoder.decode(recv_exactly(s, length))


def test_split_and_pipelined_frames_get_one_reply_each_in_order(pool_server):
    s = raw(pool_server)
    hello, health = bytes(p.frame(p.Hello(NS))), bytes(p.frame(p.Health()))
    s.sendall(hello + bytes(p.frame(p.Stats())) + health)  # three frames in one send
    assert [type(read_reply(s)) for _ in range(3)] == [p.Ok, p.StatsReply, p.HealthReply]
    for byte in health:  # one frame in pieces
        s.sendall(bytes([byte]))
        time.sleep(0.001)
    assert isinstance(read_reply(s), p.HealthReply)
    # A client that sends 2,000 requests before reading any reply (~1.3 MB of replies): the server stops reading
    # while its replies are not taken, then answers every one, in order.
    s.sendall(bytes(p.frame(p.Stats())) * 1999 + health)
    time.sleep(0.2)
    replies = [read_reply(s) for _ in range(2000)]
    assert all(isinstance(r, p.StatsReply) for r in replies[:-1]) and isinstance(replies[-1], p.HealthReply)
    s.close()


def test_another_protocol_version_is_refused_at_attach(pool_server):
    s = raw(pool_server)
    s.sendall(bytes(p.frame(p.Attach(pid=os.getpid(), version=1))))  # a client from before flat LOOKUP replies
    reply = read_reply(s)
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.VERSION and "same kvshare version" in reply.message
    s.close()
    with PoolClient.connect(pool_server) as good:  # the current version attaches
        assert good.health(deep=True)
