"""`kvshare pool serve|stats|check`: flags map one to one onto PoolConfig; handlers import lazily."""

from __future__ import annotations

import argparse
import sys

from kvshare.pool.config import PoolConfig
from kvshare.pool.l2 import cli as l2_cli
from kvshare.units import format_size

SERVE_HELP = """Run the shared host-memory KV pool: create the arena file, prepare its memory in the background
(the pool serves at once; usable capacity grows until a "ready" line is printed), and answer the control protocol
on a Unix socket. SIGTERM or SIGINT shut it down and remove the socket and arena (unless --keep)."""


def register(cli) -> None:
    serve = cli.command("serve", "run the pool server", group="pool")
    serve.description = SERVE_HELP
    serve.add_argument("--size", required=True, help="arena size, e.g. 16GiB; must fit in free RAM and in the arena's "
                       "file system (checked at start)")
    serve.add_argument("--socket", required=True, help="Unix socket path clients connect to (mode 0660)")
    serve.add_argument("--arena", default="", help="arena file (default /dev/shm/kvshare-<pid>.arena, or "
                       "/dev/hugepages/... with --hugetlb); created with mode 0660, must not exist")
    serve.add_argument("--page-size", default="2MiB", help="allocation unit (default 2MiB); a chunk spans "
                       "ceil(nbytes / page size) pages, not necessarily adjacent")
    serve.add_argument("--hugetlb", action="store_true", help="put the arena on hugetlbfs (/dev/hugepages): 512x "
                       "fewer page faults; page size must be a multiple of the huge page size")
    serve.add_argument("--tcp", default="", metavar="HOST:PORT", help="also listen on TCP (needs --token-file)")
    serve.add_argument("--token-file", default="", help="file holding the shared token TCP clients must send first")
    serve.add_argument("--lease-timeout", type=float, default=30.0, help="seconds after which a lease loses its "
                       "rights if its client never releases it; its pages stay fenced until the client finishes or "
                       "exits (default 30)")
    serve.add_argument("--high-watermark", type=float, default=0.95, help="used fraction above which RESERVE evicts "
                       "least recently used unleased chunks (default 0.95)")
    serve.add_argument("--low-watermark", type=float, default=0.90, help="used fraction eviction brings the pool "
                       "down to (default 0.90)")
    serve.add_argument("--group", default="", help="group that owns the socket and arena (mode 0660): the users "
                       "replicas run as must be in it (default: the pool user's primary group)")
    serve.add_argument("--max-leased-pages-per-client", type=int, default=None, metavar="PAGES", help="pages one "
                       "connection may hold under leases at once; beyond it LOOKUP returns a shorter prefix and "
                       "RESERVE answers lease_limit (default: half the arena; 0: no limit)")
    limits = serve.add_argument_group("limits (one client cannot hurt the others; docs/security.md)")
    d = PoolConfig.__dataclass_fields__  # the defaults live in PoolConfig; help shows them
    limits.add_argument("--max-frame", default=format_size(d["max_frame"].default), help="largest request frame; a "
                        "larger header closes the connection unread (default %(default)s)")
    limits.add_argument("--max-buffered", default=format_size(d["max_buffered"].default), help="frames being received, "
                        "all connections together; more wait until others are handled (default %(default)s)")
    limits.add_argument("--frame-timeout", type=float, default=d["frame_timeout"].default, metavar="S",
                        help="seconds from a frame's header to its last byte (default %(default)s)")
    limits.add_argument("--max-connections", type=int, default=d["max_connections"].default, help="connections at "
                        "once; more are answered busy and closed (default %(default)s)")
    limits.add_argument("--auth-timeout", type=float, default=d["auth_timeout"].default, metavar="S", help="TCP: "
                        "seconds to send ATTACH with the token (default %(default)s)")
    limits.add_argument("--max-auth-frame", type=int, default=d["max_auth_frame"].default, metavar="BYTES",
                        help="TCP: largest frame before authentication (default %(default)s)")
    limits.add_argument("--max-keys", type=int, default=d["max_keys"].default, help="keys (chunks, checksums) in one "
                        "request (default %(default)s)")
    limits.add_argument("--max-description", type=int, default=d["max_description"].default, metavar="BYTES",
                        help="bytes of a HELLO description (default %(default)s)")
    limits.add_argument("--max-namespaces", type=int, default=d["max_namespaces"].default, help="namespaces in use at "
                        "once; unused ones are reclaimed (default %(default)s)")
    metrics = serve.add_argument_group("metrics (Prometheus)")
    metrics.add_argument("--metrics-port", type=int, default=d["metrics_port"].default, metavar="PORT",
                         help="serve the pool's STATS as Prometheus text on http://HOST:PORT/metrics, from the pool's "
                              "event loop (default %(default)s: off)")
    metrics.add_argument("--metrics-host", default=d["metrics_host"].default, metavar="HOST",
                         help="address the metrics endpoint listens on (default %(default)s; 0.0.0.0 lets another "
                              "host scrape it: it shows pool sizes and counters, never keys or data)")
    metrics.add_argument("--metrics-max-connections", type=int, default=d["metrics_max_connections"].default,
                         metavar="N", help="scrapes open at once; more are closed unanswered; each has "
                         "--frame-timeout seconds (default %(default)s)")
    serve.add_argument("--no-fault-in", dest="fault_in", action="store_false", help="prepare the arena without "
                       "faulting its pages in (a faster pool start; the first store into each page and the first GPU "
                       "replica's registration then pay the kernel's zeroing, ~0.3 s/GiB; default: fault in)")
    serve.add_argument("--keep", action="store_true", help="keep the socket and arena files at shutdown")
    serve.add_argument("--check-integrity", action="store_true", help="debug: verify the pool's bookkeeping after "
                       "every request that changes it (slow for big pools)")
    l2_cli.add_flags(serve)
    serve.set_defaults(run=_serve)

    stats = cli.command("stats", "print a running pool's statistics", group="pool")
    stats.add_argument("--socket", required=True, help="the pool's address (socket path or tcp://HOST:PORT)")
    stats.add_argument("--token-file", default="", help="token file for a TCP address")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(run=_stats)

    check = cli.command("check", "full-pool allocation check: reserve every page, write, read back, verify",
                        group="pool")
    check.add_argument("--size", default="1GiB", help="size of the pool to start for the check (default 1GiB)")
    check.add_argument("--socket", default="", help="check a running pool instead: read-only, its free pages only "
                       "(committed chunks are never touched)")
    check.add_argument("--destructive", action="store_true", help="with --socket: CLEAR the pool first (drops every "
                       "unleased chunk) so that every page is checked")
    check.add_argument("--page-size", default="2MiB", help="page size of the pool to start (default 2MiB)")
    check.set_defaults(run=_check)


def _serve(args: argparse.Namespace) -> int:
    from kvshare.pool.arena import ArenaError
    from kvshare.pool.server import serve
    from kvshare.units import parse_size

    if args.l2:
        import redis  # noqa: F401  (without the [l2] extra this fails now, before the arena exists: kvshare.cli says so)
    try:
        token = open(args.token_file).read().strip() if args.token_file else ""
        config = PoolConfig(
            size=parse_size(args.size), socket=args.socket, arena=args.arena, page_size=parse_size(args.page_size),
            hugetlb=args.hugetlb, tcp=args.tcp, token=token, lease_timeout=args.lease_timeout,
            high_watermark=args.high_watermark, low_watermark=args.low_watermark, keep=args.keep,
            check_integrity=args.check_integrity, group=args.group, fault_in=args.fault_in,
            max_leased_pages_per_client=args.max_leased_pages_per_client, l2=l2_cli.config_from(args),
            max_frame=parse_size(args.max_frame), max_buffered=parse_size(args.max_buffered),
            frame_timeout=args.frame_timeout, max_connections=args.max_connections, auth_timeout=args.auth_timeout,
            max_auth_frame=args.max_auth_frame, max_keys=args.max_keys, max_description=args.max_description,
            max_namespaces=args.max_namespaces, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
            metrics_max_connections=args.metrics_max_connections,
        )
        return serve(config)
    except (ValueError, ArenaError, RuntimeError, OSError) as error:
        print(f"kvshare pool serve: {error}", file=sys.stderr)
        return 1


def _stats(args: argparse.Namespace) -> int:
    import msgspec

    from kvshare.pool.client import PoolError, read_stats
    from kvshare.pool.report import print_stats

    token = open(args.token_file).read().strip() if args.token_file else None
    try:
        stats = read_stats(args.socket, token=token)
    except PoolError as error:
        print(f"kvshare pool stats: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(stats).decode()))
    else:
        print_stats(stats)
    return 0


def _check(args: argparse.Namespace) -> int:
    from kvshare.pool.check import run_check

    if args.destructive and not args.socket:
        print("kvshare pool check: --destructive needs --socket (a pool started for the check is checked whole)",
              file=sys.stderr)
        return 2
    return run_check(size=args.size, socket=args.socket, page_size=args.page_size, destructive=args.destructive)
