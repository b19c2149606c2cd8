"""The shared host-memory KV pool: arena, allocator, index, leases, eviction, server, client, check and bench."""

from kvshare.pool.client import ChunkRef, Lookup, NewChunk, PoolClient, PoolError, PoolUnavailable, Reservation
from kvshare.pool.stats import PoolStats

__all__ = [
    "ChunkRef", "Lookup", "NewChunk", "PoolClient", "PoolError", "PoolUnavailable", "PoolStats", "Reservation",
]
