"""The pool server's configuration: one frozen dataclass whose fields map one to one onto `kvshare pool serve` flags."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvshare.pool.l2.config import L2Config

MiB = 1 << 20
DEFAULT_PAGE_SIZE = 2 * MiB
# Limits that keep one client from hurting the others (docs/security.md lists them). Sizes of honest requests: a
# 256k-token LOOKUP or RESERVE of 256-token chunks is ~1.1 MiB and 1,024 keys; 1M tokens ~4.5 MiB, 4,096 keys.
DEFAULT_MAX_FRAME = 16 * MiB
DEFAULT_MAX_BUFFERED = 32 * MiB  # all connections' frames being received, together
DEFAULT_MAX_KEYS = 16384  # per LOOKUP/RESERVE/COMMIT/DISCARD: ~45 ms of RESERVE on the 2-core build machine


@dataclass(frozen=True)
class PoolConfig:
    size: int  # arena bytes; rounded down to whole pages
    socket: str
    arena: str = ""  # "" -> /dev/shm/kvshare-<pid>.arena (or /dev/hugepages/... with hugetlb)
    page_size: int = DEFAULT_PAGE_SIZE
    hugetlb: bool = False
    tcp: str = ""  # "HOST:PORT" or ""
    token: str = ""  # shared secret required over TCP
    lease_timeout: float = 30.0
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    keep: bool = False  # keep socket and arena files at shutdown
    max_frame: int = DEFAULT_MAX_FRAME  # bytes of one frame; a larger header closes the connection unread
    max_buffered: int = DEFAULT_MAX_BUFFERED  # frames beyond it wait (reading paused) until others are handled
    frame_timeout: float = 10.0  # seconds from a frame's header to its last byte; slower connections are closed
    max_connections: int = 4096  # more are answered `busy` and closed
    auth_timeout: float = 5.0  # TCP: seconds to send ATTACH with the token before the connection is closed
    max_auth_frame: int = 4096  # TCP: bytes of a frame before authentication; a larger header closes the connection
    max_keys: int = DEFAULT_MAX_KEYS  # keys (chunks, checksums) in one request
    max_description: int = 1024  # bytes of a HELLO description
    max_namespaces: int = 1024  # namespaces in use (by a connection or a chunk); unused ones are reclaimed
    check_integrity: bool = False  # debug: run check_integrity() after every request that changes state
    prepare_threads: int | None = None  # None: min(os.cpu_count(), 16)
    fault_in: bool = True  # preparation faults every page in (tmpfs zeroes a page on first touch: paid here, once)
    l2: L2Config | None = None  # --l2 and the --l2-* flags; None: no L2 tier
    max_leased_pages_per_client: int | None = None  # None: half the arena; 0: no limit
    group: str = ""  # group that owns the socket and arena (both mode 0660); "" -> the user's primary group
    metrics_port: int = 0  # Prometheus text on http://metrics_host:metrics_port/metrics; 0: off
    metrics_host: str = "127.0.0.1"
    metrics_max_connections: int = 8  # scrapes open at once; more are closed unanswered

    def __post_init__(self):
        if self.page_size <= 0 or self.page_size % 4096:
            raise ValueError(f"page size must be a positive multiple of 4096 bytes, got {self.page_size}")
        if self.size < self.page_size:
            raise ValueError(f"pool size {self.size} is smaller than one page ({self.page_size} bytes): raise --size")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1, got low={self.low_watermark} high={self.high_watermark}"
            )
        if self.lease_timeout <= 0:
            raise ValueError(f"lease timeout must be positive, got {self.lease_timeout}")
        if self.hugetlb and self.page_size % (2 * MiB):
            raise ValueError(f"--hugetlb needs a page size that is a multiple of 2MiB, got {self.page_size}")
        if self.max_leased_pages_per_client is not None and self.max_leased_pages_per_client < 0:
            raise ValueError("--max-leased-pages-per-client must be a page count (0: no limit; default: half the "
                             f"arena), got {self.max_leased_pages_per_client}")
        for name in ("max_frame", "max_buffered", "max_connections", "max_auth_frame", "max_keys", "max_description",
                     "max_namespaces"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be a TCP port (0: no metrics endpoint), got {self.metrics_port}")
        if self.metrics_max_connections <= 0:
            raise ValueError(f"--metrics-max-connections must be positive, got {self.metrics_max_connections}")
        if self.frame_timeout <= 0 or self.auth_timeout <= 0:
            raise ValueError("--frame-timeout and --auth-timeout must be positive")
        if self.max_buffered < self.max_frame:
            raise ValueError(f"--max-buffered ({self.max_buffered}) must hold at least one frame of --max-frame "
                             f"({self.max_frame})")
        if self.tcp and not self.token:
            raise ValueError(
                "--tcp needs a shared token: pass --token-file FILE (clients send it in their first message)")

    @property
    def num_pages(self) -> int:
        return self.size // self.page_size

    @property
    def lease_limit(self) -> int:
        """Pages one client connection may hold under leases at once (0: unlimited)."""
        if self.max_leased_pages_per_client is None:
            return max(1, self.num_pages // 2)
        return self.max_leased_pages_per_client

    @property
    def arena_path(self) -> str:
        if self.arena:
            return self.arena
        directory = "/dev/hugepages" if self.hugetlb else "/dev/shm"
        return os.path.join(directory, f"kvshare-{os.getpid()}.arena")

    @property
    def threads(self) -> int:
        return self.prepare_threads or min(os.cpu_count() or 1, 16)
