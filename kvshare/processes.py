"""Starting and stopping the processes kvshare runs for itself (replicas, routers, pools, stub servers): the one place
tests, the router benchmark, the harness and the soak start a process, wait until it serves, and stop it.

Invariants: every child runs in its own process group (so Ctrl-C in a terminal reaches only the parent, which stops
its children itself, in order) and writes its output to a file, never a pipe (a chatty child can never block on a
full pipe); `stop()` ends the whole group, SIGTERM first, SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

STOP_GRACE_S = 10.0


class NotReady(RuntimeError):
    """A process exited, or did not serve in time, while it was being started; the message has its log's tail."""


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: their servers may not have bound them yet


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that this process was not given before. A port handed
    out stays free until its server binds it, seconds later for a vLLM replica, so the OS may offer it again
    meanwhile; two servers started together must not be given one port (CI once saw a replica's requests answered
    by another replica)."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no TCP port on 127.0.0.1 that this process was not given before")


def kvshare_argv(*args: str) -> list[str]:
    """The command line of `kvshare ARGS` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "kvshare.cli", *args]


class ManagedProcess:
    """A child process in its own process group, with its output in a log file (a temporary one if none is given)."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None = None, env: dict[str, str] | None = None):
        if log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"kvshare-{name}-", suffix=".log")
            os.close(fd)
            log_path = Path(path)
        self.name, self.argv, self.log_path = name, argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log_file:
            self.popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(STOP_GRACE_S)

    def kill(self) -> None:
        """SIGKILL the whole group at once, like a crash (no cleanup runs in it)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(STOP_GRACE_S)


def wait_http_ready(url: str, process: ManagedProcess, timeout_s: float, any_status: bool = False) -> None:
    """Poll GET /health until it answers 200 (with any_status: anything at all, e.g. a router whose replicas are
    down answers 503); fail early, with the log's tail, when the process dies."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code
            if any_status or status == 200:
                return
        except httpx.HTTPError:
            pass
        _check_starting(process, deadline, url)
        time.sleep(0.1)


def wait_socket_ready(path: str, process: ManagedProcess, timeout_s: float) -> None:
    """Poll until the server accepts on the Unix socket at `path`; fail early, with the log's tail, when it dies."""
    deadline = time.monotonic() + timeout_s
    while not socket_accepts(path):
        _check_starting(process, deadline, f"socket {path}")
        time.sleep(0.05)


def socket_accepts(path: str) -> bool:
    """True once a server accepts connections on the Unix socket at `path`."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
            return True
        except OSError:
            return False


def _check_starting(process: ManagedProcess, deadline: float, what: str) -> None:
    if not process.alive():
        raise NotReady(f"{process.name} exited with code {process.popen.returncode} before {what} was ready; "
                       f"its log ({process.log_path}) ends with:\n{process.log_tail()}")
    if time.monotonic() > deadline:
        raise NotReady(f"{process.name} did not get ready ({what}) in time; its log ({process.log_path}) ends "
                       f"with:\n{process.log_tail()}")


class ServerProcess:
    """A command that serves HTTP on 127.0.0.1:port. Use as a context manager, or call start() and stop()."""

    def __init__(self, argv: list[str], port: int, name: str = "server") -> None:
        self.argv, self.port, self.name = argv, port, name
        self.managed: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def process(self) -> subprocess.Popen:
        return self.managed.popen

    def start(self, ready_timeout_s: float = 60.0) -> "ServerProcess":
        """Start it and wait until /health answers at all (a router without healthy replicas answers 503)."""
        self.managed = ManagedProcess(self.name, self.argv)
        try:
            wait_http_ready(self.url, self.managed, ready_timeout_s, any_status=True)
        except NotReady:
            self.stop()
            raise
        return self

    def log_text(self) -> str:
        return self.managed.log_text() if self.managed else ""

    def output(self) -> str:
        return self.log_text()[-4000:]

    def stop(self) -> None:
        if self.managed is not None:
            self.managed.stop()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt for the duration, so `finally` blocks stop everything we started."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
