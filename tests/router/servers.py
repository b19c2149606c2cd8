"""Real server processes for router tests (stub replicas, routers on loopback): see kvshare.router.local."""

from kvshare.router.local import ServerProcess, free_port, router, stub_replica

__all__ = ["ServerProcess", "free_port", "router", "stub_replica"]
