"""Real server processes for router tests (stub replicas, routers on loopback): see kvshare.router.local. Routers
started here accept policy switches with the tests' admin token (helpers.ADMIN_TOKEN)."""

import tempfile
from pathlib import Path

from kvshare.processes import ServerProcess, free_port
from kvshare.router import local
from kvshare.router.local import stub_replica

from .helpers import ADMIN_TOKEN

__all__ = ["ServerProcess", "free_port", "router", "stub_replica", "admin_token_file"]
_token_dir = tempfile.TemporaryDirectory(prefix="kvshare-router-tests-")


def admin_token_file() -> str:
    path = Path(_token_dir.name) / "admin-token"
    if not path.exists():
        path.write_text(ADMIN_TOKEN + "\n")
        path.chmod(0o600)
    return str(path)


def router(replica_urls: list[str], policy: str = "round-robin", *extra: str) -> ServerProcess:
    return local.router(replica_urls, policy, "--admin-token-file", admin_token_file(), *extra)
