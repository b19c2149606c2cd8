"""start_pool(): run a real `kvshare pool serve` process for tests and benchmarks, and always clean it up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from kvshare.pool.client import PoolClient, PoolUnavailable
from kvshare.processes import ManagedProcess, kvshare_argv

_FLAGS = {  # start_pool keyword -> serve flag
    "page_size": "--page-size", "lease_timeout": "--lease-timeout", "high_watermark": "--high-watermark",
    "low_watermark": "--low-watermark", "tcp": "--tcp", "token_file": "--token-file", "arena": "--arena",
    "max_leased_pages_per_client": "--max-leased-pages-per-client", "group": "--group",
    "l2": "--l2", "l2_ttl": "--l2-ttl", "l2_queue": "--l2-queue", "l2_timeout": "--l2-timeout",
    "l2_promote_timeout": "--l2-promote-timeout", "l2_retry_after": "--l2-retry-after", "l2_fetch": "--l2-fetch",
    "l2_connections": "--l2-connections", "l2_verify_threads": "--l2-verify-threads", "l2_batch": "--l2-batch",
    "l2_piece": "--l2-piece",
    "max_frame": "--max-frame", "max_buffered": "--max-buffered", "frame_timeout": "--frame-timeout",
    "max_connections": "--max-connections", "auth_timeout": "--auth-timeout", "max_auth_frame": "--max-auth-frame",
    "max_keys": "--max-keys", "max_description": "--max-description", "max_namespaces": "--max-namespaces",
    "metrics_port": "--metrics-port", "metrics_max_connections": "--metrics-max-connections",
}


@contextlib.contextmanager
def start_pool(
    size: int | str = "64MiB", *, wait_ready: bool = True, timeout: float = 60.0, check_integrity: bool = True,
    env: dict[str, str] | None = None, **opts,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `python -m kvshare.cli pool serve` on a fresh socket in a temp dir; yield (socket address, process).

    Waits until the pool answers (and, with wait_ready, until every page is prepared). On exit: SIGTERM, wait,
    SIGKILL if needed, and remove the arena file even if the server was killed. `opts` are serve flags by name
    (page_size=, lease_timeout=, high_watermark=, low_watermark=, tcp=, token_file=, arena=,
    max_leased_pages_per_client=, group=).
    `check_integrity` makes the server verify its bookkeeping after every request (tests want that).
    """
    with tempfile.TemporaryDirectory(prefix="kvshare-pool-") as tmp:
        address = opts.pop("socket", None) or os.path.join(tmp, "pool.sock")  # a fixed path lets a test restart a pool
        arena = opts.pop("arena", None) or f"/dev/shm/kvshare-test-{os.getpid()}-{os.path.basename(tmp)}.arena"
        command = kvshare_argv("pool", "serve", "--size", str(size), "--socket", address, "--arena", arena)
        for name, value in opts.items():
            command += [_FLAGS[name], str(value)]
        if check_integrity:
            command.append("--check-integrity")
        managed = ManagedProcess("pool", command, Path(tmp) / "serve.log", env)
        try:
            _wait_serving(address, managed, timeout, wait_ready)
            yield address, managed.popen
        finally:
            managed.stop()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(arena)


def _wait_serving(address: str, process: ManagedProcess, timeout: float, wait_ready: bool) -> None:
    """Until the pool answers (with wait_ready: until every page is prepared); its log's tail if it dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"pool exited with {process.popen.returncode} before serving:\n{process.log_tail(30)}")
        try:
            with PoolClient.connect(address, timeout=2.0, map_arena=False) as client:
                if not wait_ready or client.stats().ready:
                    return
        except PoolUnavailable:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"pool did not become {'ready' if wait_ready else 'reachable'} in {timeout} s:\n"
                       f"{process.log_tail(30)}")
