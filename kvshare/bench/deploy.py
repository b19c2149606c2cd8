"""Deployments a benchmark runs against: local processes it starts and stops (pool, two replicas, router), or
endpoint sets the user gives. Switching the arm (OFF = replicas without the pool, ON = with it) is `activate(arm)`.

Invariant: every process a LocalDeployment starts runs in its own process group and is stopped by `close()` (SIGTERM
to the group, then SIGKILL after a grace period), also when the benchmark fails or is interrupted; the pool removes
its socket and arena on SIGTERM.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from kvshare.bench.client import BenchError, EndpointUnreachable
from kvshare.processes import ManagedProcess, NotReady, free_port, kvshare_argv, wait_http_ready, wait_socket_ready

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Replica A and B base URLs, and a router in front of them when there is one."""

    replicas: tuple[str, ...]
    router: str | None = None


class Deployment(Protocol):
    def activate(self, arm: str, policy: str | None = None) -> Endpoints:
        """Make `arm` ("OFF" | "ON") live, with the router on `policy` when one is needed, and return its endpoints."""

    def settle(self) -> None:
        """Return once the stores of requests that have finished are visible to the next request, where the
        deployment can know (a request's stores are committed after its last byte). Never inside a timed window."""

    def describe(self) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LocalConfig:
    """How to run the local deployment; both arms get identical flags except --pool (and the same --threads)."""

    model_dir: Path
    log_dir: Path
    threads: int = 1
    pool_size: str = "2GiB"
    chunk_tokens: int = 256
    device: str = "cpu"
    max_model_len: int | None = None
    ready_timeout_s: float = 300.0
    load_format: str = ""  # e.g. "dummy" for the qwen2.5-32b config-only preset; empty: the server's default
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES of replica A and B (e.g. ("0", "1")); empty: inherit
    verify_checksums: bool = True  # False: replicas trust the pool's bytes (hashing 64 GiB costs seconds)

    def check_pool_holds(self, tokens: int) -> None:
        """Refuse, before anything starts, a plan whose longest prompt the local pool would share only in part: one
        connection may lease at most half the arena (the pool's default limit), so A would store and B load only
        the chunks under it, and the ON arm would recompute the rest. (A 255k run with a 72 GiB pool did that.)"""
        from kvshare.hf.config import ModelConfig, default_dtype
        from kvshare.pool.config import DEFAULT_PAGE_SIZE as PAGE
        from kvshare.pool.config import PoolConfig
        from kvshare.units import format_size, parse_size

        try:
            model = ModelConfig.from_dir(self.model_dir)
        except (OSError, ValueError, KeyError):
            return  # the replicas report a bad model folder themselves, with their own words
        tokens = min(tokens, self.max_model_len or model.max_position)  # longer ones fail on their own, later
        per_token = model.kv_bytes_per_token(default_dtype(self.device))  # the replicas' dtype (no --dtype)
        chunk_pages = -(-self.chunk_tokens * per_token // PAGE)
        needed = tokens // self.chunk_tokens * chunk_pages * PAGE
        limit = PoolConfig(size=parse_size(self.pool_size), socket="").lease_limit * PAGE  # the pool's own default
        if needed > limit:
            raise BenchError(
                f"the longest prompt ({tokens} tokens) is {format_size(needed)} of KV in the pool, "
                f"but with --pool-size {self.pool_size} one replica may lease at most {format_size(limit)} "
                f"(half the arena): only part of it would be shared. "
                f"Use --pool-size {-(-2 * needed // 2**30)}GiB or more")


class EndpointDeployment:
    """Two endpoint sets the user runs; `activate` only switches between them (and sets the router's policy)."""

    def __init__(self, off: Endpoints, on: Endpoints, admin_token: str | None = None):
        self.sets = {"OFF": off, "ON": on}
        self.admin_token = admin_token  # the routers' --admin-token-file content (--router-token-file)

    def activate(self, arm: str, policy: str | None = None) -> Endpoints:
        endpoints = self.sets[arm]
        if policy and endpoints.router:
            set_router_policy(endpoints.router, policy, self.admin_token)
        return endpoints

    def settle(self) -> None:
        pass  # the user's pool is out of reach: the harness cannot see when its stores are committed

    def describe(self) -> str:
        return "; ".join(f"{arm}: {', '.join(e.replicas)}" + (f" via {e.router}" if e.router else "")
                         for arm, e in self.sets.items())

    def close(self) -> None:
        pass


class LocalDeployment:
    """Starts a pool, two `kvshare serve` replicas per arm and a router; restarts replicas when the arm changes."""

    def __init__(self, config: LocalConfig):
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-bench-")
        self.pool_socket = str(Path(self._tmp.name) / "pool.sock")
        # An explicit arena path, so that close() can remove it even if the pool had to be SIGKILLed.
        self.pool_arena = Path("/dev/shm") / f"{Path(self._tmp.name).name}.arena"
        self.pool: ManagedProcess | None = None
        self.replicas: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        self.arm: str | None = None
        self.endpoints: Endpoints | None = None
        self._policy: str | None = None
        # The router switches policy only for its admin token (kvshare.router.admin): one per deployment, in its tmp.
        self.admin_token = secrets.token_hex(16)
        self.admin_token_file = Path(self._tmp.name) / "router-admin-token"
        self.admin_token_file.write_text(self.admin_token)
        self.admin_token_file.chmod(0o600)

    def activate(self, arm: str, policy: str | None = None) -> Endpoints:
        if arm != self.arm:
            self._stop_serving()
            if arm == "ON" and self.pool is None:
                self._start_pool()
            # Both replicas start at once (on GPUs each start maps and registers the pool's arena: tens of seconds).
            started = [self._spawn_replica(name, arm, i) for i, name in enumerate(("a", "b"))]
            for process, url in started:
                _started(wait_http_ready, url, process, self.config.ready_timeout_s)
            urls = tuple(url for _, url in started)
            self.endpoints, self.arm, self._policy = Endpoints(urls), arm, None
        if policy and policy != self._policy:
            self._ensure_router(policy)
        return self.endpoints

    def describe(self) -> str:
        c = self.config
        return (f"local: pool {c.pool_size} (ON arm only), two `kvshare serve` replicas of {c.model_dir.name} on "
                f"{c.device} with --threads {c.threads} in both arms, chunk {c.chunk_tokens} tokens"
                + ("" if c.verify_checksums else ", loaded chunks not checksummed"))

    def settle(self, timeout_s: float = 300.0) -> None:
        """Wait until the pool holds no reservation: every store issued so far is committed (or dropped)."""
        if self.arm != "ON" or self.pool is None:
            return
        from kvshare.pool.client import PoolClient, PoolError

        deadline = time.monotonic() + timeout_s
        try:
            with PoolClient.connect(self.pool_socket, map_arena=False) as client:
                while client.stats().pages_reserved:
                    if time.monotonic() > deadline:
                        log.warning("stores still uncommitted after %g s; the next request may find part of them",
                                    timeout_s)
                        return
                    time.sleep(0.02)
        except (PoolError, OSError) as error:  # a pool that is gone has nothing left to commit; replicas recompute
            log.warning("could not wait for the pool's stores (%s); going on", error)

    def close(self) -> None:
        self._stop_serving()
        if self.pool:
            self.pool.stop()
            self.pool = None
        self.pool_arena.unlink(missing_ok=True)
        self._tmp.cleanup()

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ensure_router(self, policy: str) -> None:
        if self.router is None or not self.router.alive():
            port = free_port()
            argv = kvshare_argv("route", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                "--admin-token-file", str(self.admin_token_file))
            for url in self.endpoints.replicas:
                argv += ["--replica", url]
            self.router = ManagedProcess("router", argv, self.config.log_dir / f"router-{self.arm}.log")
            url = f"http://127.0.0.1:{port}"
            _started(wait_http_ready, url, self.router, self.config.ready_timeout_s)
            self.endpoints = Endpoints(self.endpoints.replicas, url)
        else:
            set_router_policy(self.endpoints.router, policy, self.admin_token)
        self._policy = policy

    def _start_pool(self) -> None:
        argv = kvshare_argv("pool", "serve", "--size", self.config.pool_size, "--socket", self.pool_socket,
                        "--arena", str(self.pool_arena))
        self.pool = ManagedProcess("pool", argv, self.config.log_dir / "pool.log")
        _started(wait_socket_ready, self.pool_socket, self.pool, self.config.ready_timeout_s)

    def _spawn_replica(self, name: str, arm: str, index: int) -> tuple[ManagedProcess, str]:
        c, port = self.config, free_port()
        argv = kvshare_argv(
            "serve", "--model", str(c.model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", c.device,
            "--threads", str(c.threads), "--chunk-tokens", str(c.chunk_tokens),
            "--pool", self.pool_socket if arm == "ON" else "none",
        )
        if c.max_model_len:
            argv += ["--max-model-len", str(c.max_model_len)]
        if c.load_format:
            argv += ["--load-format", c.load_format]
        if not c.verify_checksums:
            argv.append("--no-verify-checksums")
        env = {"CUDA_VISIBLE_DEVICES": c.gpus[index]} if c.gpus else None
        process = ManagedProcess(f"replica-{name}", argv, c.log_dir / f"replica-{name}-{arm}.log", env)
        self.replicas.append(process)
        return process, f"http://127.0.0.1:{port}"

    def _stop_serving(self) -> None:
        # The router goes first so it never proxies to a replica that is shutting down.
        for process in ([self.router] if self.router else []) + self.replicas:
            process.stop()
        self.router, self.replicas, self.arm, self.endpoints = None, [], None, None


def set_router_policy(router_url: str, policy: str, admin_token: str | None = None) -> None:
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        response = httpx.post(f"{router_url}/admin/policy", json={"policy": policy}, headers=headers, timeout=10.0,
                              trust_env=False)
    except httpx.HTTPError as error:
        raise EndpointUnreachable(
            f"cannot reach the router at {router_url} to set policy {policy!r}: {error}") from error
    if response.status_code in (401, 403):
        raise BenchError(f"router {router_url} refused to switch its policy ({response.status_code}): pass its "
                         "--admin-token-file to the benchmark as --router-token-file")
    if response.status_code >= 400:
        raise BenchError(f"router {router_url} refused policy {policy!r}: {response.status_code} {response.text[:300]}")


def _started(wait, *args) -> None:
    """A kvshare.processes wait, failing with the harness's own error (a deployment that does not start ends the run
    with its report, not a traceback)."""
    try:
        wait(*args)
    except NotReady as error:
        raise BenchError(str(error)) from None
