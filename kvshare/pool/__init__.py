"""The shared host-memory KV pool: arena, allocator, index, leases, eviction, server, client, check and bench.

`from kvshare.pool import PoolClient` works, but lazily: `kvshare --help` imports kvshare.pool.cli, which must not
pull numpy and msgspec in.
"""

_EXPORTS = {
    "ChunkRef": "client", "LookupResult": "client", "NewChunk": "client", "PoolClient": "client", "PoolError": "client",
    "PoolUnavailable": "client", "Reservation": "client", "checksum": "client", "PoolStats": "stats",
    "start_pool": "testing",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvshare.pool' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"kvshare.pool.{_EXPORTS[name]}"), name)
