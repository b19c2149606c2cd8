"""A circuit breaker for the L2 connection: after `failures` consecutive errors, fail fast for `retry_after` seconds,
then let one trial call through; its success closes the breaker again.

Why: with Redis down every call would wait its full timeout; with the breaker open, write-behinds drop and lookups
skip L2 at once, so a dead L2 costs L1 nothing. Used from the write-behind thread and the promotion threads, hence
the lock (it guards only these few fields, never a Redis call).
"""

from __future__ import annotations

import threading
import time


class Breaker:
    def __init__(self, failures: int, retry_after: float, clock=time.monotonic) -> None:
        self.failures = failures
        self.retry_after = retry_after
        self.clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until = 0.0  # 0: closed
        self._trial = False  # a half-open trial call is in flight

    def allow(self) -> bool:
        """May a Redis call be made now? In the half-open state only one caller gets True until it reports back."""
        with self._lock:
            if not self._open_until:
                return True
            if self.clock() < self._open_until or self._trial:
                return False
            self._trial = True
            return True

    def may_try(self) -> bool:
        """Would allow() possibly say yes? (Closed, or the retry time has come.) Takes no trial slot."""
        with self._lock:
            return not self._open_until or self.clock() >= self._open_until

    def succeeded(self) -> None:
        with self._lock:
            self._consecutive, self._open_until, self._trial = 0, 0.0, False

    def failed(self) -> None:
        with self._lock:
            self._consecutive += 1
            self._trial = False
            if self._consecutive >= self.failures:
                self._open_until = self.clock() + self.retry_after

    @property
    def state(self) -> str:
        with self._lock:
            return "closed" if not self._open_until else "open"
