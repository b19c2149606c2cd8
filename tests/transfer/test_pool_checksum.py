"""One checksum from replica to pool to L2 and back: a chunk a replica's transfer stored in pages with tails (a
block that does not divide the page) is accepted by the pool's write-behind (which hashes whole pages), promoted by
another pool from L2 with the checksum in its value, and verified by the loading replica against that checksum."""

import time

import numpy as np
import pytest
import torch

from kvshare.pool.client import PoolClient
from kvshare.pool.l2.testing import REDIS_MISSING, redis_available, start_redis, url_of
from kvshare.pool.testing import start_pool
from kvshare.transfer import KVLayout, LoadJob, StoreJob, arena_pages, make_transfer
from tests.pool.conftest import new_chunks, prompt
from tests.transfer.conftest import make_kv, reference_chunk

PAGE = 4096
NS = b"\x17" * 16


def _wait(client: PoolClient, condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not condition(client.stats()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {client.stats()}"
        time.sleep(0.05)


@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
def test_replica_pool_and_l2_agree_on_the_checksum_of_chunks_with_page_tails():
    layout = KVLayout(2, 48, 4, 3, 8, torch.float32)  # 768-byte blocks: 5 a page, 256-byte tails, last page partial
    chunk_tokens, chunks = 4 * 8, 3
    keys, tokens = prompt(chunks, chunk_tokens=chunk_tokens, seed=5, ns=NS)
    nbytes = layout.chunk_nbytes(chunk_tokens, PAGE)
    with start_redis() as redis_server, \
            start_pool("4MiB", page_size=PAGE, l2=url_of(redis_server)) as (first, _), \
            start_pool("4MiB", page_size=PAGE, l2=url_of(redis_server)) as (second, _):
        with PoolClient.connect(first) as a, PoolClient.connect(second) as b:
            a.hello(NS, "writer")
            b.hello(NS, "reader")
            a.pages[:] = 0xEE  # old bytes everywhere, page tails included
            kv_a = make_kv(layout, seed=1)
            writer = make_transfer(layout, kv_a, arena_pages(a))
            reservation = a.reserve(NS, new_chunks(keys, tokens, nbytes, first_parent=NS))
            blocks = [list(range(c * 8, (c + 1) * 8)) for c in range(chunks)]
            handle = writer.store([StoreJob(blocks[c], ref.pages) for c, ref in enumerate(reservation.chunks)])
            handle.wait()
            a.commit(reservation.lease, handle.checksums())
            _wait(a, lambda s: s.l2_writes == chunks, "every chunk written behind (none dropped)")

            kv_b = make_kv(layout, seed=2)
            reader = make_transfer(layout, kv_b, arena_pages(b))
            found = b.lookup(NS, keys, tokens)  # an L1 miss: promoted from L2 with the value's checksum
            try:
                assert len(found.chunks) == chunks and b.stats().l2_promotions == chunks
                targets = [[16 + 8 * c + j for j in range(8)] for c in range(chunks)]
                loaded = reader.load([LoadJob(ref.pages, targets[c]) for c, ref in enumerate(found.chunks)],
                                     checksums=True)
                assert loaded.checksums() == [ref.checksum for ref in found.chunks] == handle.checksums()
            finally:
                b.release(found.lease)
            for c in range(chunks):
                assert np.array_equal(reference_chunk(layout, kv_b, targets[c]),
                                      reference_chunk(layout, kv_a, blocks[c]))
