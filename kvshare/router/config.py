"""Router configuration: one frozen dataclass whose fields map one to one onto `kvshare route` flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvshare.httpguard.limits import HttpLimits


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]  # base URLs, e.g. "http://127.0.0.1:8001"; the URL is the replica's name
    policy: str = "round-robin"
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval_s: float = 2.0  # every replica, healthy or not, is probed this often
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 900.0  # a 256k-token prefill takes ~90 s before the first byte; never cut it short
    prefix_chunk_tokens: int = 256  # cache-aware: chunk size over token-id prompts (match the replicas' chunk)
    prefix_chunk_bytes: int = 1024  # cache-aware: piece size over text prompts (~256 tokens of English)
    prefix_keys_per_replica: int = 65536  # cache-aware: LRU bound on remembered chunk keys per replica
    load_weight: float = 0.5  # cache-aware: one in-flight request costs as much as half the prompt uncached
    sessions_remembered: int = 65536  # alternate: LRU bound on remembered sessions
    admin_token_file: str | None = None  # POST /admin/policy needs this file's token; None: refused for everyone
    http: HttpLimits = field(default_factory=HttpLimits)  # limits on the router's own clients (kvshare.httpguard)

    def __post_init__(self):
        if not self.replicas:
            raise ValueError("no replicas: pass --replica URL (repeatable) or --replicas-file FILE")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica {url!r} is not an http(s) URL: write it like http://127.0.0.1:8001")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"a replica is listed twice in {list(self.replicas)}: list each once")


def read_replicas_file(path: str | Path) -> list[str]:
    """One URL per line; blank lines and lines starting with '#' are ignored."""
    lines = Path(path).read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.lstrip().startswith("#")]
