"""The facts of one vLLM release's KV-connector API that kvshare's connector depends on, as JSON, read with `ast`.

Usage (from the repository root):

    python scripts/vllm_api_facts.py .vllm-carry/wheels/vllm-0.26.0-*.whl > tests/integrations/vllm_api_0_26.json
    python scripts/vllm_api_facts.py .venv-vllm/lib/python3.11/site-packages > tests/integrations/vllm_api_0_32.json
    python scripts/vllm_api_facts.py .vllm-carry/wheels/vllm-0.33.0-*.whl > tests/integrations/vllm_api_0_33.json
    python scripts/vllm_api_facts.py .vllm-carry/wheels/vllm-0.34.0-*.whl > tests/integrations/vllm_api_0_34.json

(the 0.33 and 0.34 CUDA wheels: `pip download vllm==0.33.0 --no-deps -d .vllm-carry/wheels`, read, never installed.)

SOURCE is a vllm wheel (a zip, read in place) or a folder that holds the `vllm` package. Nothing is imported or
executed: each file is parsed. The JSON holds, per release: its version; for each class of base.py the connector uses,
its methods (parameters as [name, kind], abstract or not, plain / property / classmethod, line); base.py's top-level
names; the fields of the dataclasses the connector reads (inherited ones within the same module included, in
order); the top-level names of every vllm module kvshare/integrations/vllm imports from (null: no such module); and a
few single facts. tests/integrations/test_vllm_api_versions.py checks the connector and kvshare.integrations.vllm
.compat against these files, and checks them against the wheel or the installed vllm where those are present.
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASSES = ["KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata", "KVConnectorWorkerMetadata",
                "KVConnectorRole"]
# file -> dataclasses whose fields the connector reads (or that compat tests for).
FIELDS = {
    "vllm/v1/core/sched/output.py": ["SchedulerOutput", "CachedRequestData", "NewRequestData"],
    "vllm/v1/outputs.py": ["KVConnectorOutput"],
    "vllm/v1/kv_cache_interface.py": ["KVCacheConfig", "KVCacheGroupSpec", "AttentionSpec", "FullAttentionSpec",
                                      "MambaSpec"],
    "vllm/config/cache.py": ["CacheConfig"],
}
# Every module kvshare/integrations/vllm imports from, and those compat probes (tests check the list is complete).
MODULES = [
    "vllm", "vllm.config", "vllm.platforms", "vllm.forward_context", "vllm.v1.request", "vllm.v1.outputs",
    "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_layout", "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.output", "vllm.v1.attention.backend", "vllm.v1.attention.backends.utils",
    "vllm.v1.metrics.cache_hit_source", "vllm.v1.metrics.utils", "vllm.distributed.kv_transfer.kv_connector.v1",
    "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    "vllm.distributed.kv_transfer.kv_connector.factory",
]


class Source:
    """The files of one release: in a wheel or under a folder."""

    def __init__(self, path: Path):
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._root = path

    def read(self, name: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(name).decode()
            except KeyError:
                return None
        file = self._root / name
        return file.read_text() if file.is_file() else None

    def module(self, dotted: str) -> tuple[str, str] | None:
        """(file name, text) of a module: a .py file or a package's __init__.py."""
        base = dotted.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            text = self.read(name)
            if text is not None:
                return name, text
        return None


def _params(fn: ast.FunctionDef) -> list[list[str]]:
    """[name, kind] per parameter, kinds as inspect.Parameter names them."""
    args = fn.args
    out = [[a.arg, "POSITIONAL_ONLY"] for a in args.posonlyargs]
    out += [[a.arg, "POSITIONAL_OR_KEYWORD"] for a in args.args]
    if args.vararg:
        out.append([args.vararg.arg, "VAR_POSITIONAL"])
    out += [[a.arg, "KEYWORD_ONLY"] for a in args.kwonlyargs]
    if args.kwarg:
        out.append([args.kwarg.arg, "VAR_KEYWORD"])
    return out


def _method(fn: ast.FunctionDef) -> dict:
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    kind = "property" if "property" in decorators else "classmethod" if "classmethod" in decorators else "method"
    return {"params": _params(fn), "abstract": "abstractmethod" in decorators, "kind": kind, "line": fn.lineno}


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _fields(classes: dict[str, ast.ClassDef], name: str) -> list[str]:
    """Annotated class-level names of `name` and, first, of its bases defined in the same module."""
    node, out = classes[name], []
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out += _fields(classes, base.id)
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id not in out:
            out.append(item.target.id)
    return out


def _top_names(tree: ast.Module) -> list[str]:
    """Names a module defines or imports at top level (inside `if`/`try` too, not under TYPE_CHECKING), and those its
    module-level `__getattr__` compares its argument with (lazy names: vllm.platforms.current_platform)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__getattr__":
                    names.update(c.value for cmp in ast.walk(node) if isinstance(cmp, ast.Compare)
                                 for c in [cmp.left, *cmp.comparators]
                                 if isinstance(c, ast.Constant) and isinstance(c.value, str))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return sorted(names)


def _version(source: Source) -> str:
    text = source.read("vllm/_version.py") or ""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return str(node.value.value)
    raise ValueError("no vllm/_version.py with __version__")


def facts(path: Path) -> dict:
    """The API facts of the release at `path` (a wheel or a folder holding `vllm`)."""
    source = Source(path)
    base_tree = ast.parse(source.read(BASE))
    classes = _classes(base_tree)
    base = {name: {n.name: _method(n) for n in classes[name].body if isinstance(n, ast.FunctionDef)}
            for name in BASE_CLASSES}
    fields = {}
    for file, names in FIELDS.items():
        file_classes = _classes(ast.parse(source.read(file)))
        fields.update({name: _fields(file_classes, name) for name in names})
    modules = {}
    for dotted in MODULES:
        found = source.module(dotted)
        modules[dotted] = None if found is None else _top_names(ast.parse(found[1]))
    factory = source.read("vllm/distributed/kv_transfer/kv_connector/factory.py") or ""
    return {
        "version": _version(source),
        "base_classes": base,
        "base_module_names": _top_names(base_tree),
        "fields": fields,
        "modules": modules,
        "factory_reads_kv_connector_module_path": "kv_transfer_config.kv_connector_module_path" in factory,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(facts(Path(argv[0])), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
