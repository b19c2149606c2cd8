"""Throw-away redis-server processes on free loopback ports (standalone, or a cluster of several masters) for the L2
tests and benchmarks, always stopped and their files removed on exit; and a bandwidth-limited proxy in front of one."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Iterator

REDIS_MISSING = "redis-server is not installed (apt-get install -y redis-server): the L2 tier needs a real Redis"


def redis_available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_port(also_plus: int = 0) -> int:
    """A loopback port that is free (and, with also_plus, so is port + also_plus: a cluster's bus port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also_plus or port + also_plus > 65535:
            if not also_plus:
                return port
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + also_plus))
                return port
            except OSError:
                continue
    raise RuntimeError("no free loopback port pair found")


class RedisProcess:
    """One redis-server: `port`, `stop()` (SIGKILL: a crash) and `start()` again on the same port."""

    def __init__(self, directory: str, port: int, extra: list[str]) -> None:
        self.directory, self.port, self.extra = directory, port, extra
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                   "no", "--dir", self.directory, *self.extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.cli("ping").strip() == "PONG":
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def cli(self, *args: str) -> str:
        done = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=10)
        return done.stdout


@contextlib.contextmanager
def start_redis(*extra: str) -> Iterator[RedisProcess]:
    """A standalone redis-server; yields it (url: redis://127.0.0.1:PORT)."""
    with tempfile.TemporaryDirectory(prefix="kvshare-redis-") as tmp:
        server = RedisProcess(tmp, free_port(), list(extra))
        try:
            server.start()
            yield server
        finally:
            server.kill()


@contextlib.contextmanager
def start_redis_cluster(masters: int = 3) -> Iterator[list[RedisProcess]]:
    """`masters` cluster-enabled redis-servers joined by `redis-cli --cluster create`, waited on until every node
    reports cluster_state:ok."""
    with tempfile.TemporaryDirectory(prefix="kvshare-redis-cluster-") as tmp:
        servers = []
        try:
            for _ in range(masters):
                port = free_port(also_plus=10000)
                servers.append(RedisProcess(tmp, port, ["--cluster-enabled", "yes", "--cluster-config-file",
                                                        f"nodes-{port}.conf", "--cluster-node-timeout", "2000"]))
                servers[-1].start()
            subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                            "--cluster-yes"], capture_output=True, text=True, timeout=60, check=True)
            deadline = time.monotonic() + 30
            while not all("cluster_state:ok" in s.cli("cluster", "info") for s in servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok in 30 s")
                time.sleep(0.1)
            yield servers
        finally:
            for server in servers:
                server.kill()


def url_of(servers: RedisProcess | list[RedisProcess]) -> str:
    servers = servers if isinstance(servers, list) else [servers]
    return "redis://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


class _Bucket:
    """A token bucket shared by every connection of a throttle: at most `rate` bytes a second pass in all, with a
    burst of one piece. The lock guards the two fields; sleeps happen outside it."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()  # when the link is free again

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


@contextlib.contextmanager
def throttled(port: int, bytes_per_s: float) -> Iterator[int]:
    """A loopback TCP proxy in front of 127.0.0.1:`port` whose replies (server -> client) share a link of
    `bytes_per_s` (requests pass at full speed): a slow network to L2 on one machine. Yields the proxy's port. For a
    standalone Redis only (a cluster's redirections name the real ports). Threads, stopped on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    bucket, stop, sockets = _Bucket(bytes_per_s), threading.Event(), []

    def pump(src: socket.socket, dst: socket.socket, limited: bool) -> None:
        try:
            while not stop.is_set():
                data = src.recv(64 << 10)
                if not data:
                    break
                if limited:
                    bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
                server = socket.create_connection(("127.0.0.1", port))
            except OSError:
                continue
            sockets.extend((client, server))
            threading.Thread(target=pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=pump, args=(server, client, True), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
