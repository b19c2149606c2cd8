"""Stub replicas and routers as local processes on loopback (kvshare.processes.ServerProcess), for the router
benchmark and tests."""

from __future__ import annotations

import sys

from kvshare.processes import ServerProcess, free_port, kvshare_argv


def stub_replica(name: str, first_token_delay_ms: float = 0.0, token_interval_ms: float = 0.0) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "kvshare.router.stub", "--name", name, "--port", str(port),
            "--first-token-delay-ms", str(first_token_delay_ms), "--token-interval-ms", str(token_interval_ms)]
    return ServerProcess(argv, port, f"stub-{name}")


def router(replica_urls: list[str], policy: str = "round-robin", *extra: str) -> ServerProcess:
    port = free_port()
    argv = kvshare_argv("route", "--port", str(port), "--policy", policy, *extra)
    for url in replica_urls:
        argv += ["--replica", url]
    return ServerProcess(argv, port, "router")
