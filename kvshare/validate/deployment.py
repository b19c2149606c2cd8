"""The soak's processes: a pool, replicas A and B (pool ON; A verifies loaded chunks' checksums, B does not, as in the
H200 runs), a reference replica R (pool OFF) and a router in front of A and B; each can be killed (SIGKILL, like a
crash) and restarted on the same address.

Invariant: every process runs in its own process group and `close()` stops all of them and removes every arena
file a pool life created, also after a crash of the soak itself.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvshare.processes import ManagedProcess, free_port, kvshare_argv, wait_http_ready, wait_socket_ready

READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class DeployConfig:
    model_dir: Path
    log_dir: Path
    pool_size: str = "8MiB"  # small, so that filling the arena and eviction happen within minutes
    page_size: str = "64KiB"
    lease_timeout_s: float = 4.0
    chunk_tokens: int = 32
    threads: int = 1
    trusting: tuple[str, ...] = ("b",)  # replicas started with --no-verify-checksums: only the fences protect them


class SoakDeployment:
    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-soak-")
        self.pool_socket = str(Path(self._tmp.name) / "pool.sock")
        self.pool: ManagedProcess | None = None
        self._arenas: list[Path] = []
        self.ports = {name: free_port() for name in ("a", "b", "ref", "router")}
        self.processes: dict[str, ManagedProcess] = {}

    @property
    def pool_lives(self) -> int:
        return len(self._arenas)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    # ---- start ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.start_pool()
        for name in ("a", "b", "ref"):
            self.start_replica(name)
        argv = kvshare_argv("route", "--host", "127.0.0.1", "--port", str(self.ports["router"]), "--policy",
                            "round-robin", "--health-interval", "0.5", "--replica", self.url("a"), "--replica",
                            self.url("b"))
        self.processes["router"] = ManagedProcess("router", argv, self.config.log_dir / "router.log")
        wait_http_ready(self.url("router"), self.processes["router"], READY_TIMEOUT_S)

    def start_pool(self) -> None:
        """A new pool life on the same socket, with a fresh arena file (a killed pool leaves its old one behind)."""
        arena = Path("/dev/shm") / f"{Path(self._tmp.name).name}-{self.pool_lives + 1}.arena"
        self._arenas.append(arena)
        c = self.config
        argv = kvshare_argv("pool", "serve", "--size", c.pool_size, "--page-size", c.page_size, "--socket",
                            self.pool_socket, "--arena", str(arena), "--lease-timeout", str(c.lease_timeout_s),
                            "--check-integrity")
        self.pool = ManagedProcess("pool", argv, c.log_dir / f"pool-{self.pool_lives}.log")
        wait_socket_ready(self.pool_socket, self.pool, READY_TIMEOUT_S)

    def start_replica(self, name: str) -> None:
        c = self.config
        argv = kvshare_argv("serve", "--model", str(c.model_dir), "--host", "127.0.0.1", "--port",
                            str(self.ports[name]), "--threads", str(c.threads), "--chunk-tokens", str(c.chunk_tokens),
                            "--pool", "none" if name == "ref" else self.pool_socket)
        if name in c.trusting:
            argv.append("--no-verify-checksums")
        self.processes[name] = ManagedProcess(f"replica-{name}", argv, c.log_dir / f"replica-{name}.log")
        wait_http_ready(self.url(name), self.processes[name], READY_TIMEOUT_S)

    # ---- faults --------------------------------------------------------------------------------------------------

    def kill_pool(self) -> None:
        """SIGKILL the pool (no cleanup runs, like a crash) and remove its arena file."""
        if self.pool is not None:
            self.pool.kill()
        self._arenas[-1].unlink(missing_ok=True)

    def kill_replica(self, name: str) -> None:
        self.processes[name].kill()

    # ---- stop ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        for name in ("router", "a", "b", "ref"):
            if name in self.processes:
                self.processes[name].stop()
        if self.pool:
            self.pool.stop()
        for arena in self._arenas:
            arena.unlink(missing_ok=True)
        self._tmp.cleanup()

    def __enter__(self) -> "SoakDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
