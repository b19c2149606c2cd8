"""Helpers for reliability tests: `kvshare serve` replicas of the session's tiny model on a pool, always stopped."""

from __future__ import annotations

import contextlib
import sys

import httpx

from kvshare.processes import ServerProcess, free_port


def kvshare_serve(model_dir, pool: str = "none", *extra: str) -> ServerProcess:
    """A `kvshare serve` replica (one torch thread, 32-token pool chunks); start() it, or use it with `with`."""
    port = free_port()
    argv = [sys.executable, "-m", "kvshare.cli", "serve", "--model", str(model_dir), "--port", str(port), "--pool",
            pool, "--threads", "1", "--chunk-tokens", "32", *extra]
    return ServerProcess(argv, port)


def complete(base: str, ids: list[int], salt: str | None = None, max_tokens: int = 4) -> dict:
    """A greedy completion of token ids; returns the whole response body (asserts 200)."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def pool_hits(body: dict) -> int:
    return body["kvshare"]["pool_hit_tokens"]


def local_hits(body: dict) -> int:
    return body["kvshare"]["local_hit_tokens"]


def prompt_ids(seed: int, n: int = 160) -> list[int]:
    """n token ids (5 full 32-token chunks at the default n), distinct per seed."""
    return [16 + (seed * 7919 + i * 31) % 980 for i in range(n)]


@contextlib.contextmanager
def running(*servers: ServerProcess, timeout_s: float = 180.0):
    """Start every server (generous timeout: the build machine is shared) and stop all of them however it ends."""
    started = []
    try:
        for server in servers:
            started.append(server.start(ready_timeout_s=timeout_s))
        yield servers
    finally:
        for server in reversed(started):
            server.stop()
