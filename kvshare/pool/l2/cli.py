"""The `--l2*` flags of `kvshare pool serve` (added by kvshare.pool.cli; the L2 benchmark is `kvshare bench l2`).

Imports nothing heavy: `kvshare --help` loads this module.
"""

from __future__ import annotations

import argparse

MEMORY_POLICY = ("configure Redis with maxmemory and maxmemory-policy allkeys-lru: L2 is a cache of values that can "
                 "all be recomputed, so the least recently used chunk should make room (with noeviction a full Redis "
                 "refuses every write-behind)")


def add_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("L2 tier (Valkey/Redis shared by several hosts' pools)", MEMORY_POLICY)
    g.add_argument("--l2", default="", metavar="redis://HOST:PORT[,HOST:PORT,...]", help="write committed chunks "
                   "behind to Redis and promote L2 hits into this pool on LOOKUP; several nodes: a Redis cluster")
    g.add_argument("--l2-ttl", type=float, default=0.0, metavar="SECONDS", help="expiry of chunks in L2 (default 0: "
                   "none, Redis evicts by its maxmemory-policy)")
    g.add_argument("--l2-queue", type=int, default=256, metavar="N", help="write-behind queue length in chunks; when "
                   "full, write-behinds are dropped and counted (default 256)")
    g.add_argument("--l2-timeout", type=float, default=0.5, metavar="SECONDS", help="timeout of every Redis call "
                   "(default 0.5)")
    g.add_argument("--l2-promote-timeout", type=float, default=1.0, metavar="SECONDS", help="how long a LOOKUP waits "
                   "for L2 promotion before answering with L1 only (default 1; keep below the clients' timeout)")
    g.add_argument("--l2-retry-after", type=float, default=2.0, metavar="SECONDS", help="after 3 failed Redis calls, "
                   "skip L2 for this long, then try again (default 2)")
    g.add_argument("--l2-fetch", choices=("striped", "redis-py"), default="striped", help="promotion's read path: "
                   "striped (several connections per node, pipelined, verification overlapping the fetches) or "
                   "redis-py (the original one-pipeline path, kept for comparison) (default striped)")
    g.add_argument("--l2-connections", type=int, default=4, metavar="N", help="striped: connections per Redis node "
                   "(default 4)")
    g.add_argument("--l2-verify-threads", type=int, default=2, metavar="N", help="striped: threads verifying fetched "
                   "values (default 2)")
    g.add_argument("--l2-batch", default="64MiB", metavar="BYTES", help="bytes per write-behind SET batch and bytes "
                   "in flight per promotion (default 64MiB)")
    g.add_argument("--l2-receive-buffer", default="0", metavar="BYTES", help="striped: SO_RCVBUF of each connection "
                   "(default 0: the kernel's autotuning)")
    g.add_argument("--l2-piece", default="1MiB", metavar="BYTES", help="striped: fetch values of a known length in "
                   "GETRANGE pieces of this size, which spares Redis a fresh reply buffer per value (default 1MiB; "
                   "0: whole-value GETs)")


def config_from(args: argparse.Namespace):
    """The L2Config the flags describe, or None without --l2."""
    if not args.l2:
        return None
    from kvshare.pool.l2.config import L2Config
    from kvshare.units import parse_size

    return L2Config(url=args.l2, ttl=args.l2_ttl, queue=args.l2_queue, timeout=args.l2_timeout,
                    promote_timeout=args.l2_promote_timeout, retry_after=args.l2_retry_after, fetch=args.l2_fetch,
                    connections=args.l2_connections, verify_threads=args.l2_verify_threads,
                    batch_bytes=parse_size(args.l2_batch), receive_buffer=parse_size(args.l2_receive_buffer),
                    piece_bytes=parse_size(args.l2_piece))
