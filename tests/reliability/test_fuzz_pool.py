"""Hostile input to the pool: hypothesis drives (1) PoolState with random sequences of valid-shaped and malformed
requests from two clients, with time passing, and (2) the server's frame handler with random and near-valid
msgpack bodies. After every step the full integrity check must pass and no request may crash a handler.
(tests/pool/test_faults.py fuzzes frames over a socket; this goes wider, in process.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import xxhash
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from kvshare.pool.leases import WRITE
from kvshare.pool.protocol import ErrorCode, NewChunk
from kvshare.pool.state import PoolState, RequestError
from tests.pool.conftest import Clock

from .pool_harness import NAMESPACE, Harness, encode

KEYS = [xxhash.xxh3_128_digest(f"key-{i}".encode()) for i in range(8)]
OTHER_NS = xxhash.xxh3_128_digest(b"other")
TOKENS = [bytes([i]) * 4 * (i + 1) for i in range(8)]

keys = st.one_of(st.sampled_from(KEYS), st.binary(max_size=20))  # mostly real keys, sometimes malformed
namespaces = st.one_of(st.just(NAMESPACE), st.just(OTHER_NS), st.binary(max_size=20))
new_chunk = st.builds(
    lambda i, parent, key, tokens, nbytes: NewChunk(key if key is not None else KEYS[i],
                                                    parent if parent is not None else (KEYS[i - 1] if i else NAMESPACE),
                                                    tokens if tokens is not None else TOKENS[i], nbytes),
    st.integers(0, 7), st.none() | keys, st.none() | keys, st.none() | st.binary(max_size=9),
    st.integers(-5, 5 * 4096) | st.integers(-(2**63), 2**63 - 1),
)
# Well-formed chains, often: one malformed chunk refuses a whole RESERVE, so with malformed chunks alone almost no
# RESERVE succeeded and no lease ever existed (test_the_fuzz_reaches_leases_and_committed_chunks guards this).
valid_chain = st.builds(
    lambda first, n, nbytes: [NewChunk(KEYS[i], KEYS[i - 1] if i else NAMESPACE, TOKENS[i], nbytes)
                              for i in range(first, min(8, first + n))],
    st.just(0) | st.integers(0, 7), st.integers(1, 4), st.integers(1, 3 * 4096))  # from chunk 0: LOOKUP can hit
chunk_lists = valid_chain | st.lists(new_chunk, max_size=6)
lease_ids = st.integers(1, 4) | st.integers(0, 12) | st.integers(-(2**63), 2**64 - 1)  # leases are numbered from 1
checksum_lists = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4) | st.lists(st.integers(), max_size=7)
clients = st.integers(1, 2)
mostly_known = st.just(NAMESPACE) | namespaces
ops = st.one_of(
    st.tuples(st.just("hello"), namespaces),
    st.tuples(st.just("lookup"), clients, mostly_known, st.integers(0, 8), st.booleans()),
    st.tuples(st.just("reserve"), clients, mostly_known, chunk_lists),
    st.tuples(st.just("commit"), clients, lease_ids, checksum_lists),
    # What well-behaved replicas send (RESERVE then COMMIT; LOOKUP of a prompt from its first chunk), so that leases
    # and committed chunks are common enough for the checks below to mean something.
    st.tuples(st.just("store"), clients, valid_chain, st.integers(0, 2**64 - 1)),
    st.tuples(st.just("lookup known"), clients, st.integers(1, 8)),
    st.tuples(st.just("commit newest"), clients, st.integers(0, 2**64 - 1)),
    st.tuples(st.just("release newest"), clients),
    st.tuples(st.just("release"), clients, lease_ids),
    st.tuples(st.just("time"), st.floats(0, 20)),
    st.tuples(st.just("drop"), clients, st.booleans()),
    st.tuples(st.just("gone"), clients),
    st.tuples(st.just("discard"), mostly_known, st.lists(keys, max_size=4)),
    st.tuples(st.just("prepare"), st.integers(0, 16)),
    st.tuples(st.just("clear")),
)


def apply(state: PoolState, clock: Clock, op: tuple) -> None:
    match op:
        case ("hello", ns):
            state.hello(ns, "fuzz")
        case ("lookup", client, ns, n, corrupt):
            tokens = [t + b"x" if corrupt and i == n - 1 else t for i, t in enumerate(TOKENS[:n])]
            state.lookup(client, ns, KEYS[:n], tokens)
        case ("reserve", client, ns, chunks):
            state.reserve(client, ns, chunks)
        case ("commit", client, lease, checksums):
            state.commit(client, lease, checksums)
        case ("release", client, lease):
            state.release(client, lease)
        case ("store", client, chain, checksum):
            reply = state.reserve(client, NAMESPACE, chain)
            if reply.lease:
                state.commit(client, reply.lease, [checksum] * sum(ref is not None for ref in reply.chunks))
        case ("lookup known", client, n):
            state.lookup(client, NAMESPACE, KEYS[:n], TOKENS[:n])
        case ("commit newest", client, checksum):
            writes = [lease for lease in state.leases if lease.client == client and lease.kind == WRITE]
            if writes:
                state.commit(client, writes[-1].id, [checksum] * len(writes[-1].keys))
        case ("release newest", client):
            if held := [lease for lease in state.leases if lease.client == client]:
                state.release(client, held[-1].id)
        case ("time", dt):
            clock.now += dt
            state.expire()
        case ("drop", client, watched):
            state.drop_client(client, watched)
        case ("gone", client):
            state.client_gone(client)
        case ("discard", ns, chosen):
            state.discard(ns, chosen)
        case ("prepare", upto):
            state.allocator.add_prepared(max(upto, state.allocator.prepared))
        case ("clear",):
            state.clear()


def reached(sequence: list) -> set[str]:
    """What a sequence gets the pool to hold at some point: "write lease", "read lease", "committed chunk"."""
    clock, seen = Clock(), set()
    state = PoolState(12, 4096, prepared=6, lease_timeout=5.0, clock=clock)
    state.hello(NAMESPACE, "fuzz")
    for op in sequence:
        try:
            apply(state, clock, op)
        except RequestError:
            pass
        seen |= {f"{lease.kind} lease" for lease in state.leases}
        seen |= {"committed chunk"} if state.index.committed else set()
    return seen


def test_the_fuzz_reaches_leases_and_committed_chunks():
    """The consistency fuzz below checks lease accounting only if its sequences create leases at all."""
    for goal in ("write lease", "read lease", "committed chunk"):
        try:
            find(st.lists(ops, min_size=1, max_size=40), lambda sequence, goal=goal: goal in reached(sequence),
                 settings=settings(max_examples=2000, database=None, derandomize=True,
                                   suppress_health_check=list(HealthCheck)))
        except NoSuchExample:
            pytest.fail(f"2000 random sequences never made the pool hold a {goal}: the fuzz cannot check it")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=40), st.integers(0, 6))
def test_random_request_sequences_keep_pool_state_consistent(sequence, lease_limit):
    clock = Clock()
    state = PoolState(12, 4096, prepared=6, lease_timeout=5.0, clock=clock, max_leased_pages_per_client=lease_limit)
    state.hello(NAMESPACE, "fuzz")
    for op in sequence:
        pages_before = state.allocator.free_count
        try:
            apply(state, clock, op)
        except RequestError as error:
            assert error.message and error.code
            # a refused request allocates nothing; only a RESERVE refused for space may have evicted to try, and a
            # COMMIT of a fenced lease frees its quarantined pages
            if error.code in (ErrorCode.NO_SPACE, ErrorCode.LEASE_EXPIRED):
                assert state.allocator.free_count >= pages_before
            else:
                assert state.allocator.free_count == pages_before
        state.check_integrity()
        if lease_limit:
            assert all(n <= lease_limit for n in state.leases.pages_by_client().values())
    for client in (1, 2):
        state.drop_client(client)
        state.check_integrity()
        state.client_gone(client)
    state.check_integrity()
    stats = state.stats()
    # nothing outlives its clients (I8)
    assert stats.pages_reserved == stats.pages_quarantined == len(state.leases) == 0


# ---- the server's handler: bytes in, exactly one reply out -------------------------------------------------------

TYPES = ["Attach", "Hello", "Lookup", "Reserve", "Commit", "Release", "Stats", "Clear", "Health", "Nope", 5]
values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)
                      | st.text(max_size=10) | st.sampled_from(KEYS + [NAMESPACE]),
                      lambda inner: (st.lists(inner, max_size=5)
                                     | st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=20)
FIELDS = ["namespace", "keys", "tokens", "token_lengths", "chunks", "lease", "checksums", "deep", "token", "pid"]
near_valid = st.builds(lambda t, fields: encode({"type": t, **fields}), st.sampled_from(TYPES),
                       st.dictionaries(st.sampled_from(FIELDS), values, max_size=5))


@pytest.fixture(scope="module")
def harness():
    h = Harness()
    yield h
    h.close()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(st.tuples(near_valid | st.binary(max_size=64), clients), min_size=1, max_size=10))
def test_handler_answers_any_body_with_one_reply(harness, bodies):
    for body, client in bodies:
        harness.handle(body, client)
    harness.drop(1)
    harness.drop(2)


def test_atheris_fuzzes_the_handler():
    pytest.importorskip("atheris")
    out = subprocess.run([sys.executable, "-m", "tests.reliability.fuzz_pool_atheris", "-runs=20000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
