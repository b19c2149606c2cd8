"""What hostile-HTTP tests watch from outside a server process: its resident memory while something runs, the lines it
logged since a mark, and a metric on its /metrics."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvshare.processes import ServerProcess


class PeakRss:
    """The highest resident set size (bytes) of a process while the `with` block runs, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)  # the server may still be reading when the client's call returns
        self._stop.set()
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.before) / 2**20


def log_text(server: ServerProcess) -> str:
    """Everything the process wrote so far (stdout and stderr share one file)."""
    return server.log_text()


def new_log_lines(server: ServerProcess, mark: int, settle_s: float = 0.5, timeout_s: float = 10.0) -> list[str]:
    """The lines logged after `mark` (a len(log_text) taken earlier): waits for the first one (bounded), then for
    `settle_s` more, so a traceback's later lines are counted too."""
    deadline = time.monotonic() + timeout_s
    while len(log_text(server)) <= mark and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(settle_s)
    return log_text(server)[mark:].splitlines()


def metric(base: str, name: str) -> float | None:
    """The sum of a metric's samples on base's /metrics; None when the server does not export it."""
    text = httpx.get(f"{base}/metrics", timeout=10, trust_env=False).text
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    return sum(values) if values else None


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
