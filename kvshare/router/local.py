"""Local server processes on loopback (stub replicas, routers) for the router benchmark and tests: start one, wait
until it answers /health, and always stop it."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A command that serves HTTP on 127.0.0.1:port. Use as a context manager, or call start() and stop()."""

    argv: list[str]
    port: int
    process: subprocess.Popen | None = None
    log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> "ServerProcess":
        self.log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server can never block on a full pipe
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{' '.join(self.argv)} exited with {self.process.returncode}:\n{self.output()}")
            try:
                httpx.get(f"{self.url}/health", timeout=1.0)  # any answer means it is serving
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{' '.join(self.argv)} did not serve within {ready_timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stub_replica(name: str, first_token_delay_ms: float = 0.0, token_interval_ms: float = 0.0) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "kvshare.router.stub", "--name", name, "--port", str(port),
            "--first-token-delay-ms", str(first_token_delay_ms), "--token-interval-ms", str(token_interval_ms)]
    return ServerProcess(argv, port)


def router(replica_urls: list[str], policy: str = "round-robin", *extra: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "kvshare.router", "--port", str(port), "--policy", policy, *extra]
    for url in replica_urls:
        argv += ["--replica", url]
    return ServerProcess(argv, port)
