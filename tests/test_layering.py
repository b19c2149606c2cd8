"""The tree's contracts beyond import-linter's (pyproject.toml, `make lint`): keys come from kvshare.keys alone, and
the parts that run without torch import none."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvshare"

# Modules that hash with xxhash for something other than a cache key, each for its reason. Anything else that hashes
# would be building keys outside kvshare.keys: a second key scheme that could disagree with the first.
HASHES_BUT_MAKES_NO_KEY = {
    "keys.py": "the keys themselves",
    "identity.py": "the weights' content fingerprint (kvshare.keys.Namespace takes it as a string)",
    "engine/weights.py": "seeds of the dummy weights' generators",
    "router/policies.py": "rendezvous scores of fixed placement",
    "bench/sessions.py": "the harness's own fixed placement",
    "bench/transfer.py": "xxh3's rate as a yardstick beside the checksum's",
    "transfer/layout.py": "the KV layout's identity (a string in kvshare.keys.Namespace, fixed across releases)",
}


def _imports_xxhash(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    return any(name == "xxhash" or name.startswith("xxhash.") for name in names)


def test_only_kvshare_keys_builds_keys():
    hashing = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _imports_xxhash(path)}
    stray = sorted(hashing - set(HASHES_BUT_MAKES_NO_KEY))
    assert not stray, f"modules that hash outside kvshare.keys: {stray}"


@pytest.mark.parametrize("module", ["kvshare.pool.server", "kvshare.pool.cli", "kvshare.router.app", "kvshare.cli"])
def test_the_pool_router_and_command_line_import_no_torch(module):
    """`kvshare pool serve` and `kvshare route` run where torch is not installed (their hosts need not have it)."""
    code = f"import sys, {module}; import kvshare.cli as c; c.build(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
