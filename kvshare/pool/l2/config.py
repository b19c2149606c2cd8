"""L2Config: the `kvshare pool serve --l2*` flags, one field each, and the parsing of the --l2 node list."""

from __future__ import annotations

from dataclasses import dataclass

FETCH_PATHS = ("striped", "redis-py")


@dataclass(frozen=True)
class L2Config:
    url: str  # redis://host:port[,host:port,...]: one node -> standalone, several -> cluster (any master each)
    ttl: float = 0.0  # seconds a chunk lives in L2 (0: until Redis evicts it; see docs/architecture.md "L2 tier")
    queue: int = 256  # write-behind queue length in chunks; a full queue drops the write-behind (counted)
    timeout: float = 0.5  # seconds for every Redis connect, read and write
    promote_timeout: float = 1.0  # seconds a LOOKUP waits for promotion; keep well below the clients' timeout (5 s)
    retry_after: float = 2.0  # seconds the circuit breaker stays open before one trial call
    failures: int = 3  # consecutive failed Redis calls that open the breaker
    batch_bytes: int = 64 << 20  # bytes per pipelined SET batch, and bytes in flight per promotion (its window)
    fetch: str = "striped"  # promotion's read path: "striped" (lanes, see lanes.py) or "redis-py" (one pipeline)
    connections: int = 4  # striped: connections (lanes) per node
    verify_threads: int = 2  # striped: threads that verify fetched values while the lanes fetch the next ones
    receive_buffer: int = 0  # striped: SO_RCVBUF of each lane's socket in bytes (0: the kernel's autotuning)
    piece_bytes: int = 1 << 20  # striped: values of a known length come in GETRANGE pieces of this size (0: GET)

    def __post_init__(self):
        _ = self.nodes  # validates the URL
        if self.ttl < 0:
            raise ValueError(f"--l2-ttl must be >= 0 seconds (0: no expiry), got {self.ttl}")
        if self.queue < 1:
            raise ValueError(f"--l2-queue must be at least 1 chunk, got {self.queue}")
        if self.timeout <= 0 or self.promote_timeout <= 0 or self.retry_after <= 0 or self.failures < 1:
            raise ValueError("--l2-timeout, --l2-promote-timeout and --l2-retry-after must be positive")
        if self.fetch not in FETCH_PATHS:
            raise ValueError(f"--l2-fetch must be one of {', '.join(FETCH_PATHS)}, got {self.fetch!r}")
        if self.connections < 1 or self.verify_threads < 1:
            raise ValueError("--l2-connections and --l2-verify-threads must be at least 1")
        if self.batch_bytes < 1 or self.receive_buffer < 0 or self.piece_bytes < 0:
            raise ValueError("--l2-batch must be positive, --l2-receive-buffer and --l2-piece >= 0")

    @property
    def nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node in the URL."""
        if not self.url.startswith("redis://"):
            raise ValueError(f"--l2 must look like redis://host:port[,host:port,...], got {self.url!r}")
        nodes = []
        for part in self.url.removeprefix("redis://").rstrip("/").split(","):
            host, sep, port = part.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--l2 node {part!r} is not host:port (in {self.url!r})")
            nodes.append((host, int(port)))
        return nodes

    @property
    def cluster(self) -> bool:
        return len(self.nodes) > 1
