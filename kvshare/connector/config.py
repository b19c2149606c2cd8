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
    l2_promotion: str = "decide"  # a pool with L2: "decide" promotes a prefix from L2 only where the cost model says
    # it beats recompute (kvshare.connector.promotion); "always" lets every LOOKUP promote (the decision off)
    register_piece: int = 16 << 30  # CUDA replicas register the arena for DMA in pieces of at most this many bytes,
    register_threads: int = 4  # on this many background threads (a transfer waits only for its own pieces),
    register_ahead: bool = True  # all pieces from the start; False: only pieces a transfer touches (hostmem.py)
