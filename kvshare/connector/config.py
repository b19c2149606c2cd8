"""ConnectorConfig: where the pool is and how the connector uses it (one field per option of kvshare serve or of vLLM's
kv_connector_extra_config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectorConfig:
    address: str  # pool socket path, "unix:PATH" or "tcp://HOST:PORT"
    chunk_tokens: int = 256
    timeout: float = 5.0  # per pool call
    verify_checksums: bool = True  # hash each loaded chunk's bytes and compare with the writer's checksum (I1)
    checksums_on: str = "device"  # CUDA replicas: "device" hashes staging on the GPU; "host" hashes the arena on
    # host threads (the design before issue 17, kept to compare its cost); CPU replicas always hash on the host
    retry_interval: float = 2.0  # after a connection failure, leave the pool alone this long before reconnecting
