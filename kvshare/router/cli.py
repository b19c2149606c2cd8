"""Registers `kvshare route` (the router) and `kvshare bench router-overhead` (its TTFT overhead benchmark)."""

from __future__ import annotations

import argparse
import sys

from kvshare.httpguard.limits import add_flags as add_http_limit_flags
from kvshare.router.config import RouterConfig

POLICY_NAMES = ("round-robin", "alternate", "fixed", "least-loaded", "cache-aware")  # kvshare.router.policies.POLICIES


def register(cli) -> None:
    route = cli.command("route", help="OpenAI-compatible router with placement policies in front of replicas")
    route.add_argument("--replica", action="append", default=[], metavar="URL",
                       help="replica base URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    route.add_argument("--replicas-file", metavar="FILE", help="file with one replica URL per line")
    route.add_argument("--policy", default=RouterConfig.policy, choices=POLICY_NAMES, help="placement of each request")
    route.add_argument("--host", default=RouterConfig.host, help="address to listen on")
    route.add_argument("--port", type=int, default=RouterConfig.port,
                       help="port to listen on (default: %(default)s, which is also `kvshare serve`'s and vLLM's: run "
                            "the replicas on other ports, e.g. 8001 and 8002)")
    route.add_argument("--health-interval", type=float, default=RouterConfig.health_interval_s, metavar="S",
                       help="seconds between health probes of every replica")
    route.add_argument("--health-timeout", type=float, default=RouterConfig.health_timeout_s, metavar="S",
                       help="seconds a health probe may take")
    route.add_argument("--read-timeout", type=float, default=RouterConfig.read_timeout_s, metavar="S",
                       help="longest silence from a replica while it answers (a long prefill sends nothing for a "
                            "while)")
    route.add_argument("--prefix-chunk-tokens", type=int, default=RouterConfig.prefix_chunk_tokens,
                       help="cache-aware: chunk size over token-id prompts (match the replicas' --chunk-tokens)")
    route.add_argument("--prefix-chunk-bytes", type=int, default=RouterConfig.prefix_chunk_bytes,
                       help="cache-aware: piece size over text prompts, in bytes")
    route.add_argument("--load-weight", type=float, default=RouterConfig.load_weight,
                       help="cache-aware: score = uncached fraction + LOAD_WEIGHT * in-flight requests")
    route.add_argument("--admin-token-file", metavar="FILE", default=None,
                       help="POST /admin/policy (switch policy at run time) needs 'Authorization: Bearer TOKEN' with "
                            "this file's token; without this flag it is refused for everyone (default: off)")
    add_http_limit_flags(route)
    route.set_defaults(run=_route)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    from kvshare.httpguard.limits import from_args as http_limits_from_args
    from kvshare.router.config import read_replicas_file

    urls = [url.rstrip("/") for url in args.replica]
    if args.replicas_file:
        urls += read_replicas_file(args.replicas_file)
    return RouterConfig(
        replicas=tuple(urls), policy=args.policy, host=args.host, port=args.port,
        health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
        read_timeout_s=args.read_timeout, prefix_chunk_tokens=args.prefix_chunk_tokens,
        prefix_chunk_bytes=args.prefix_chunk_bytes, load_weight=args.load_weight,
        admin_token_file=args.admin_token_file, http=http_limits_from_args(args),
    )


def quiet_http_client_logs() -> None:
    """httpx logs every upstream request at INFO: on the router's hot path that is a log line per request."""
    import logging

    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _route(args: argparse.Namespace) -> int:
    from kvshare.httpguard.serve import reserve_port, serve
    from kvshare.router.app import create_app

    try:
        config = config_from_args(args)
        app = create_app(config)
        sock = reserve_port(config.host, config.port)  # a busy port fails here, in one line
    except (ValueError, OSError) as error:
        print(f"kvshare route: {error}", file=sys.stderr)
        return 2
    quiet_http_client_logs()
    serve(app, config.host, config.port, config.http, sock=sock)
    return 0
