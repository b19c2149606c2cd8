"""A request abandoned by its client gives back everything it held in the pool too, at once: replica B loads a prefix
replica A stored (a read lease), computes and stores the chunks of its longer prompt (write leases) and decodes on,
and its client stops reading. Once B has dropped the stream (--write-timeout) the pool holds no lease of B's, fenced
or not, and B's engine no request and no KV block."""

from __future__ import annotations

import json
import random

import pytest

from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool
from kvshare.validate import raw_http

from .conftest import complete, kvshare_serve, running
from .http_watch import log_text, metric, wait_until

pytestmark = pytest.mark.slow  # ~20 s: two replicas, one long stream
SHORT = ("--write-timeout", "1", "--send-buffer", "16KiB")
PROMPT = 200  # A's: six 32-token chunks
LONGER = 300  # B's: A's prompt and 100 tokens more, nine chunks


def test_an_abandoned_request_leaves_no_lease_in_the_pool(tiny_model):
    longer = [random.Random(7).randrange(3, 1000) for _ in range(LONGER)]
    prompt = longer[:PROMPT]
    with start_pool("64MiB", page_size="64KiB") as (address, _):
        with running(kvshare_serve(tiny_model, address, *SHORT), kvshare_serve(tiny_model, address, *SHORT)) as (a, b):
            complete(a.url, prompt)
            wait_until(lambda: read_stats(address).chunks >= PROMPT // 32, what="A's chunks to be committed")
            mark = len(log_text(b))
            body = {"prompt": longer, "max_tokens": 3000, "ignore_eos": True, "temperature": 0.0, "stream": True}
            sock = raw_http.connect(b.url, receive_buffer=4096)
            try:
                sock.sendall(raw_http.post_json("/v1/completions", b.url, json.dumps(body).encode()))
                wait_until(lambda: (metric(b.url, "kvshare_pool_loads_total") or 0) > 0,
                           what="B to load the prefix from the pool")
                wait_until(lambda: read_stats(address).chunks >= LONGER // 32,
                           what="B to store the chunks of its longer prompt")
                wait_until(lambda: "client gone); aborting" in log_text(b)[mark:], timeout_s=30,
                           what="B to abort the request of the client that does not read")
            finally:
                sock.close()
            wait_until(lambda: metric(b.url, "kvshare_engine_requests") == 0, what="B's engine to let it go")
            assert metric(b.url, "kvshare_kv_blocks_used") == 0  # so every store of it has finished its copies

            def leases():
                stats = read_stats(address)
                return stats.read_leases, stats.write_leases, stats.fenced_leases

            wait_until(lambda: leases() == (0, 0, 0), timeout_s=5, what="the pool to hold no lease of B's")
            assert metric(b.url, "kvshare_pool_load_bytes_total") > 0
