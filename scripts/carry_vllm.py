"""Carries vLLM 0.26.0 (the CUDA wheel) and the dependencies the H200 host lacks to that host, in pieces.

The host has no network and each device call carries at most 64 MiB (the working tree included), so `prepare`
(here) downloads the wheels, splits the large ones and bundles the small ones into pieces that fit, and prints the
device calls to make; `receive N...` (there) copies carried pieces into /tmp/vllm-carry/ and checks them; `install`
(there) reassembles the wheels, checks them and installs them into /tmp/vllm-site. `prepare --lmcache` adds LMCache
0.5.3 (the release built for the host's torch 2.11) and what it needs of the rest, for vLLM's LMCacheConnectorV1.
Entry point: scripts/carry-vllm.sh. docs/vllm-on-h200.md describes the procedure. The host side needs only the
standard library (and `packaging`, which the host has, for the version report).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VLLM_VERSION = "0.26.0"
VLLM_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
VLLM_SIZE = 303_698_761
VLLM_SHA256 = "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de"

# LMCache 0.5.3: the newest release whose compiled c_ops was built against torch 2.11.0 with CUDA 13 (its sdist's
# build requirement); 0.5.4 and later are built for torch 2.13 and their extension does not load on the host's torch.
LMCACHE_VERSION = "0.5.3"
LMCACHE_WHEEL = f"lmcache-{LMCACHE_VERSION}-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
LMCACHE_SIZE = 15_263_628
LMCACHE_SHA256 = "e7adfc5b4113e0bd626c692afbfe84c07abf895ab14638409f3ee426ce9bd288"

MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # what one device call may carry, the working tree included
MAX_PIECE = 60 * MIB
MARGIN = 2 * MIB  # room for the manifest, this script, and files others add to the tree before the calls

REPO = Path(__file__).resolve().parent.parent
CARRY_DIR = ".vllm-carry"  # git-ignored (prepare adds it to .git/info/exclude)
WHEELS = f"{CARRY_DIR}/wheels"  # downloads; never carried
PIECES = f"{CARRY_DIR}/pieces"  # what the calls carry, one path each
MANIFEST = f"{CARRY_DIR}/manifest.json"
TOOL = "scripts/carry-vllm.sh"

# The host's Python and platform: vLLM's markers are evaluated for these, not for this machine's Python.
HOST_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "platform_machine": "x86_64",
    "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix", "platform_release": "",
    "platform_version": "", "extra": "",
}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64", "manylinux_2_5_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64",
             "manylinux1_x86_64"]

# What the H200 host's image 'cuda' holds, as the device docs list it (KINDS.md, "Python packages already there",
# read 2026-11-17). Versions only where the docs give them (its pip list row); the others are checked there by
# `install`, which reports every host package that misses a pin of vLLM's tree.
HOST_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
# The resolver takes these at the host's versions (torch's family, and the Hugging Face stack vLLM sits on). numpy
# is not among them: mistral-common pins numpy<2.4 on Python 3.12 while the host has 2.5.2, so the resolution would
# fail; the host keeps its numpy and `install` reports the miss (mistral-common is only vLLM's Mistral tokenizer).
HOST_VERSIONS = {
    "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "triton": "3.6.0", "transformers": "5.17.0",
    "tokenizers": "0.23.2", "huggingface-hub": "1.33.0", "safetensors": "0.8.0", "tiktoken": "0.14.0",
    "sentencepiece": "0.2.2", "accelerate": "1.15.0",
}

# vLLM's own requirements that are CUDA kernel libraries or media decoders, imported where a backend or model needs
# them, not by `import vllm` or the OpenAI server: carried only with `prepare --kernels` (their trees run to
# several hundred MiB: cutlass-dsl's libraries, tilelang, a triton fork, the CUDA compiler wheels).
KERNEL_ROOTS = {"flashinfer-python", "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors",
                "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels", "torchcodec",
                "pynvvideocodec"}


# LMCache 0.5.3's requirements that `prepare --lmcache` leaves out, each with why: read from the wheel, no import at
# module level on the path from vllm's lmcache_connector through lmcache.integration.vllm.vllm_v1_adapter (its engine,
# storage manager, every remote-connector adapter, the local CPU backend) or from lmcache.v1.server reaches them; the
# backends that import them do so when they are configured, and the arm uses none of them. (cupy-cuda13x, the one
# large requirement, is on the host already, as are numpy, numba, psutil, pyyaml and the other plain ones.)
LMCACHE_LEFT_OUT = {
    "awscrt": "the S3 connector",
    "cufile-python": "the GPUDirect Storage backend",
    "google-api-core": "the Bigtable connector",
    "google-cloud-bigtable": "the Bigtable connector",
    "redis": "the Redis connector",
    "nvtx": "profiling ranges, imported under try in lmcache.utils (one of vLLM's --kernels set)",
    "setuptools-scm": "LMCache's build, never imported",
    # LMCache's multiprocess mode's observability only; its pins (opentelemetry-api<=1.40.0) would also take vLLM's
    # OpenTelemetry tree (1.45) back a release, so vLLM's carried one stays.
    "opentelemetry-api": "the multiprocess mode's tracing",
    "opentelemetry-sdk": "the multiprocess mode's tracing",
    "opentelemetry-exporter-otlp": "the multiprocess mode's tracing",
    "opentelemetry-exporter-prometheus": "the multiprocess mode's metrics",
}

# What `install` imports to call the install good: vLLM's OpenAI server, and with LMCache carried, vLLM's LMCache
# connector and the LMCache adapter that connector builds (without `use_native`, LMCache's own implementation).
VLLM_IMPORTS = ("vllm", "vllm.entrypoints.openai.api_server")
LMCACHE_IMPORTS = ("lmcache", "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
                   "lmcache.integration.vllm.vllm_v1_adapter")
LMCACHE_FALLBACK = "compiled extension not found"  # LMCache's warning when c_ops fails to load (torch ops instead)


def die(msg: str) -> None:
    print(f"carry-vllm: error: {msg}", file=sys.stderr)
    sys.exit(1)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def tmp_dir() -> Path:
    return Path(os.environ.get("VLLM_CARRY_TMP", "/tmp/vllm-carry"))


def site_dir() -> Path:
    return Path(os.environ.get("VLLM_CARRY_SITE", "/tmp/vllm-site"))


# ---------------------------------------------------------------------------------------------------- prepare (here)

def pip(*args: str, quiet: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, capture_output=quiet, text=True)
    if r.returncode != 0:
        tail = "\n".join(line for line in (r.stderr or "").splitlines() if "is ignored" not in line)[-3000:]
        die(f"pip {args[0]} failed (exit {r.returncode}); check the network/index and rerun prepare:\n{tail}")


def platform_args() -> list[str]:
    out = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(name).decode()


def requires(metadata_requires: list[str], extras: set[str]):
    """The requirements that apply on the host, for the given extras of the requiring package."""
    from packaging.requirements import Requirement

    for line in metadata_requires:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**HOST_ENV, "extra": e}) for e in (extras or {""})):
            yield req


def make_stubs(stub_dir: Path, pins: list[str]) -> Path:
    """Metadata-only wheels at the host's known versions (a local +host tag, so pip prefers them) and a constraints
    file pinning those versions: the resolver then chooses what fits the host's torch, transformers, numpy ...
    instead of their newest releases (and never reaches for torch's own CUDA wheels)."""
    stub_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, ver in HOST_VERSIONS.items():
        v = f"{ver}+host"
        dist = f"{name.replace('-', '_')}-{v}"
        path = stub_dir / f"{dist}-py3-none-any.whl"
        if not path.exists():
            with zipfile.ZipFile(path, "w") as z:
                z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
                z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: carry-vllm\n"
                           "Root-Is-Purelib: true\nTag: py3-none-any\n")
                z.writestr(f"{dist}.dist-info/RECORD", "")
        lines.append(f"{name}=={ver}")
    constraints = stub_dir / "constraints.txt"
    constraints.write_text("\n".join(lines + pins) + "\n")
    return constraints


def requires_dist(whl: Path) -> list[str]:
    meta = wheel_metadata(whl)
    return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]


def resolve(vllm_whl: Path, kernels: bool, lmcache_whl: Path | None = None) -> tuple[dict, list[dict]]:
    """Which wheels the host lacks: vLLM's Requires-Dist (markers for the host), the ones the host has set aside,
    the rest resolved by pip together with everything they pull in; host packages met on the way are kept as
    requirements for the host check, not carried. With `lmcache_whl`, LMCache's Requires-Dist join vLLM's (less
    LMCACHE_LEFT_OUT) in the same resolution, so both trees agree on every shared package."""
    roots, host_reqs, skipped, lmcache_left_out = [], [], [], []
    for req in requires(requires_dist(vllm_whl), set()):
        n = norm(req.name)
        if n in HOST_PACKAGES:
            host_reqs.append({"name": n, "spec": str(req.specifier), "by": "vllm"})
        elif n in KERNEL_ROOTS and not kernels:
            skipped.append(req)
        else:
            roots.append((req, "vllm"))
    for req in requires(requires_dist(lmcache_whl), set()) if lmcache_whl else []:
        n = norm(req.name)
        if n in LMCACHE_LEFT_OUT:
            lmcache_left_out.append(f"{req} ({LMCACHE_LEFT_OUT[n]})")
        elif n in HOST_PACKAGES:
            host_reqs.append({"name": n, "spec": str(req.specifier), "by": "lmcache"})
        else:
            roots.append((req, "lmcache"))
    stubs = REPO / CARRY_DIR / "stubs"
    # vLLM's pins on what is left out still hold where something else pulls it in (xgrammar: apache-tvm-ffi).
    constraints = make_stubs(stubs, [f"{r.name}{r.specifier}" for r in skipped if str(r.specifier)])
    report = REPO / CARRY_DIR / "resolve-report.json"
    with tempfile.TemporaryDirectory() as target:
        # --target keeps pip off this machine's own environment; --ignore-installed resolves from nothing.
        pip("install", "-q", "--dry-run", "--ignore-installed", "--report", str(report), "--target", target,
            "--find-links", str(stubs), "-c", str(constraints), *platform_args(), *[str(r) for r, _ in roots])
    found = {}
    for item in json.loads(report.read_text())["install"]:
        m = item["metadata"]
        found[norm(m["name"])] = item
    # Walk the tree again with the host's markers (pip evaluated them for this machine's Python).
    carry: dict[str, dict] = {}
    todo = list(roots)
    while todo:
        req, by = todo.pop()
        n = norm(req.name)
        if n in HOST_PACKAGES:
            if str(req.specifier):
                host_reqs.append({"name": n, "spec": str(req.specifier), "by": by})
            continue
        if n not in found:
            die(f"pip's resolution has no {n} (needed by {by}); rerun prepare, or add it by hand to the roots")
        item = found[n]
        if n in carry:
            if not req.specifier.contains(item["metadata"]["version"], prereleases=True):
                die(f"{n} {item['metadata']['version']} misses {by}'s pin {req.specifier}")
            carry[n]["by"].add(by)
            if not set(req.extras) - carry[n]["extras"]:
                continue
        entry = carry.setdefault(n, {"extras": set(), "by": set()})
        entry["extras"] |= set(req.extras)
        entry["by"].add(by)
        m = item["metadata"]
        for sub in requires(m.get("requires_dist", []), entry["extras"]):
            todo.append((sub, n))
    wheels = []
    for n in sorted(carry):
        item = found[n]
        url = item["download_info"]["url"]
        fname = url.rsplit("/", 1)[-1].replace("%2B", "+")
        sha = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256", "")
        wheels.append({"name": n, "version": item["metadata"]["version"], "file": fname, "sha256": sha,
                       "kernels": n in KERNEL_ROOTS, "needed_by": sorted(carry[n]["by"])})
    for r in skipped:  # something pulled a left-out root in anyway: it is carried, so say so
        if norm(r.name) in carry:
            print(f"note: {norm(r.name)} is carried all the same: {', '.join(sorted(carry[norm(r.name)]['by']))}"
                  " needs it")
    # host_reqs: unique, sorted
    uniq = {(h["name"], h["spec"], h["by"]) for h in host_reqs}
    info = {"host_requirements": [dict(zip(("name", "spec", "by"), u)) for u in sorted(uniq)],
            "left_out": sorted(str(r) for r in skipped)}
    if lmcache_whl:
        info["lmcache_left_out"] = sorted(lmcache_left_out)
    return info, wheels


def download(wheels: list[dict], dest: Path) -> None:
    missing = [w for w in wheels if not (dest / w["file"]).exists()]
    if missing:
        print(f"downloading {len(missing)} wheels ({len(wheels) - len(missing)} already here)")
        pip("download", "-q", "--no-deps", *platform_args(), "-d", str(dest),
            *[f"{w['name']}=={w['version']}" for w in missing])
    else:
        print(f"all {len(wheels)} dependency wheels already here")
    for w in wheels:
        path = dest / w["file"]
        if not path.exists():
            die(f"pip saved no {w['file']}; delete {WHEELS} and rerun prepare")
        got = sha256(path)
        if w["sha256"] and got != w["sha256"]:
            die(f"{w['file']} has sha256 {got}, the index says {w['sha256']}; delete it and rerun prepare")
        w["sha256"] = got
        w["size"] = path.stat().st_size


def fetch_pinned(wdir: Path, name: str, version: str, file: str, size: int, sha: str) -> Path:
    """One wheel pinned by name, size and sha256 (vLLM's, LMCache's): downloaded unless already here, then checked."""
    whl = wdir / file
    if not whl.exists() or whl.stat().st_size != size:
        print(f"downloading {file} ({mib(size)})")
        whl.unlink(missing_ok=True)
        pip("download", "-q", "--no-deps", *platform_args(), "-d", str(wdir), f"{name}=={version}")
        if not whl.exists():
            die(f"pip saved no {file}; check that the index has {name}=={version} for manylinux_2_28_x86_64")
    got = sha256(whl)
    if got != sha:
        die(f"{whl.relative_to(REPO)} has sha256 {got}, expected {sha}; delete it and rerun prepare")
    print(f"{file}: {size} bytes, sha256 ok")
    return whl


def tree_bytes() -> int:
    """What every call carries besides its pieces: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    total = 0
    for rel in out.split(b"\0"):
        if rel:
            p = REPO / os.fsdecode(rel)
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def split_file(src: Path, stem: str, size: int, out_dir: Path) -> list[dict]:
    """`src` in parts of `size` bytes, the last the rest: full parts leave the rest as room that plan_calls fills
    with a bundle, so the calls number ceil(all pieces / a call's budget) where equal parts would take one more."""
    n = -(-src.stat().st_size // size)
    pieces = []
    with open(src, "rb") as f:
        for i in range(n):
            data = f.read(size)
            name = f"{stem}.part{i + 1}of{n}"
            (out_dir / name).write_bytes(data)
            pieces.append({"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                           "kind": "part", "of": src.name, "index": i + 1, "count": n})
    return pieces


def bundle(files: list[Path], name: str, out_dir: Path) -> dict:
    path = out_dir / name
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for f in files:
            info = t.gettarinfo(str(f), arcname=f.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(f, "rb") as fh:
                t.addfile(info, fh)
    return {"file": name, "size": path.stat().st_size, "sha256": sha256(path), "kind": "bundle",
            "holds": [f.name for f in files]}


def plan_pieces(vllm_whl: Path, wheels: list[dict], budget: int) -> list[dict]:
    out_dir = REPO / PIECES
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    piece_max = min(MAX_PIECE, budget)
    pieces = split_file(vllm_whl, vllm_whl.name, piece_max, out_dir)
    wdir = REPO / WHEELS
    small, big = [], []
    for w in sorted(wheels, key=lambda w: -w["size"]):
        (big if w["size"] > piece_max // 2 else small).append(w)
    for w in big:
        pieces += split_file(wdir / w["file"], w["file"], piece_max, out_dir)
    # First-fit-decreasing into bundles of at most piece_max (a tar adds ~1.5 KiB a member).
    bins: list[list[dict]] = []
    for w in small:
        for b in bins:
            if sum(x["size"] + 2048 for x in b) + w["size"] + 2048 + 10240 <= piece_max:
                b.append(w)
                break
        else:
            bins.append([w])
    for i, b in enumerate(bins):
        pieces.append(bundle([wdir / w["file"] for w in b], f"deps{i + 1}.tar", out_dir))
    for i, p in enumerate(pieces):
        p["n"] = i + 1
    return pieces


def plan_calls(pieces: list[dict], budget: int) -> list[list[int]]:
    """Pieces into calls, largest first, each call's pieces within the budget; calls in piece order."""
    calls: list[list[dict]] = []
    for p in sorted(pieces, key=lambda p: -p["size"]):
        for c in calls:
            if sum(x["size"] for x in c) + p["size"] <= budget:
                c.append(p)
                break
        else:
            calls.append([p])
    calls.sort(key=lambda c: min(x["n"] for x in c))
    return [sorted(x["n"] for x in c) for c in calls]


def print_calls(manifest: dict) -> None:
    pieces = {p["n"]: p for p in manifest["pieces"]}
    calls = manifest["calls"]
    print(f"\n{len(calls)} device calls, back to back (the host keeps /tmp only while it stays warm, ~30 s);"
          f" {mib(manifest['carried_bytes'])} of pieces in all, each call within {mib(manifest['budget'])}"
          f" beside a working tree of {mib(manifest['tree_bytes'])}:")
    for i, c in enumerate(calls):
        carry = [MANIFEST] + [f"{PIECES}/{pieces[n]['file']}" for n in c]
        cmd = f"bash {TOOL} receive {' '.join(map(str, c))}"
        if i == len(calls) - 1:
            cmd += f" && bash {TOOL} install"
        size = sum(pieces[n]["size"] for n in c)
        print(f"  call {i + 1}/{len(calls)} ({mib(size)}):")
        print(f"    carry:   {json.dumps(carry)}")
        print(f"    command: {cmd}")
    print(f"then, in a later call on that same warm machine: bash {TOOL} install (only checks), and\n"
          f"  export PYTHONPATH={site_dir()}:.  (ahead of any /tmp/site from .whl/: its FastAPI is past vLLM's pin)")


def cmd_prepare(args: argparse.Namespace) -> None:
    try:
        import packaging.requirements  # noqa: F401
    except ImportError:
        die("prepare needs the 'packaging' module; run it with the project's .venv (scripts/carry-vllm.sh does)")
    os.chdir(REPO)
    exclude = REPO / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if f"/{CARRY_DIR}/" not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with open(exclude, "a") as f:
            f.write(f"/{CARRY_DIR}/\n")
    wdir = REPO / WHEELS
    wdir.mkdir(parents=True, exist_ok=True)
    vllm_whl = fetch_pinned(wdir, "vllm", VLLM_VERSION, VLLM_WHEEL, VLLM_SIZE, VLLM_SHA256)
    lmcache_whl = fetch_pinned(wdir, "lmcache", LMCACHE_VERSION, LMCACHE_WHEEL, LMCACHE_SIZE, LMCACHE_SHA256) \
        if args.lmcache else None
    info, wheels = resolve(vllm_whl, args.kernels, lmcache_whl)
    download(wheels, wdir)
    if lmcache_whl:  # a wheel like the others from here on: bundled, reassembled, checked, installed
        wheels.append({"name": "lmcache", "version": LMCACHE_VERSION, "file": LMCACHE_WHEEL, "sha256": LMCACHE_SHA256,
                       "kernels": False, "needed_by": ["--lmcache"], "size": LMCACHE_SIZE})
    # the LMCache wheel stays through a prepare without --lmcache: the next --lmcache needs no download
    keep = {VLLM_WHEEL, LMCACHE_WHEEL} | {w["file"] for w in wheels}
    for stale in wdir.glob("*.whl"):  # versions an earlier prepare chose
        if stale.name not in keep:
            stale.unlink()
    tree = tree_bytes()
    budget = CARRY_LIMIT - tree - MARGIN
    if budget < 8 * MIB:
        die(f"the working tree is {mib(tree)}: too little of the 64 MiB a call carries is left for pieces")
    pieces = plan_pieces(vllm_whl, wheels, budget)
    manifest = {
        "vllm": {"file": VLLM_WHEEL, "size": VLLM_SIZE, "sha256": VLLM_SHA256, "version": VLLM_VERSION},
        "kernels": args.kernels, "wheels": wheels, "pieces": pieces, **info,
        "tree_bytes": tree, "budget": budget, "carried_bytes": sum(p["size"] for p in pieces),
    }
    if lmcache_whl:  # only then: a manifest without --lmcache stays as it was
        manifest["lmcache"] = {"file": LMCACHE_WHEEL, "size": LMCACHE_SIZE, "sha256": LMCACHE_SHA256,
                               "version": LMCACHE_VERSION}
    manifest["calls"] = plan_calls(pieces, budget)
    manifest["id"] = hashlib.sha256(json.dumps(pieces, sort_keys=True).encode()).hexdigest()[:16]
    (REPO / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    dep_bytes = sum(w["size"] for w in wheels)
    print(f"{len(wheels)} dependency wheels the host lacks, {mib(dep_bytes)}:")
    for w in wheels:
        print(f"  {w['name']}=={w['version']}  {mib(w['size'])}{'  [kernels]' if w['kernels'] else ''}")
    if info["left_out"]:
        print("left out (CUDA kernel and media libraries; prepare --kernels carries them): "
              + ", ".join(info["left_out"]))
    if info.get("lmcache_left_out"):
        print("left out of LMCache's requirements (not imported on LMCacheConnectorV1's path): "
              + ", ".join(info["lmcache_left_out"]))
    print(f"{len(pieces)} pieces in {PIECES}/, manifest {MANIFEST}")
    print_calls(manifest)


def cmd_plan(args: argparse.Namespace) -> None:
    print_calls(load_manifest(REPO / MANIFEST))


# ------------------------------------------------------------------------------------------- receive, install (there)

def load_manifest(path: Path) -> dict:
    if not path.exists():
        die(f"no {path}: carry {MANIFEST} in this call (prepare writes it; its carry lists name it)")
    return json.loads(path.read_text())


def present(manifest: dict, tmp: Path) -> list[int]:
    done = []
    for p in manifest["pieces"]:
        f = tmp / p["file"]
        ok = tmp / (p["file"] + ".ok")
        if f.exists() and ok.exists() and ok.read_text().strip() == p["sha256"] and f.stat().st_size == p["size"]:
            done.append(p["n"])
    return done


def sync_manifest(manifest_src: Path, tmp: Path) -> dict:
    manifest = load_manifest(manifest_src)
    tmp.mkdir(parents=True, exist_ok=True)
    old = tmp / "manifest.json"
    if old.exists() and json.loads(old.read_text()).get("id") != manifest["id"]:
        print(f"carry-vllm: {tmp} held pieces of another prepare; starting over there")
        shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    shutil.copyfile(manifest_src, old)
    return manifest


def cmd_receive(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    tmp = tmp_dir()
    manifest = sync_manifest(REPO / MANIFEST, tmp)
    pieces = {p["n"]: p for p in manifest["pieces"]}
    for n in args.n:
        if n not in pieces:
            die(f"there is no piece {n}: the manifest has 1..{len(pieces)}; use the numbers prepare printed")
        p = pieces[n]
        src = REPO / PIECES / p["file"]
        if not src.exists():
            die(f"piece {n} ({PIECES}/{p['file']}) was not carried: add it to this call's carry list and call again")
        dst = tmp / p["file"]
        shutil.copyfile(src, dst)
        got = sha256(dst)
        if got != p["sha256"]:
            dst.unlink()
            die(f"piece {n} ({p['file']}) has sha256 {got}, expected {p['sha256']}: on this machine rerun"
                f" `prepare` where it ran if the pieces changed since, else carry this piece again")
        (tmp / (p["file"] + ".ok")).write_text(p["sha256"] + "\n")
        print(f"piece {n}/{len(pieces)} {p['file']}: {p['size']} bytes, sha256 ok")
    have = present(manifest, tmp)
    missing = [n for n in pieces if n not in have]
    print(f"{len(have)}/{len(pieces)} pieces in {tmp}" + (f", still missing {missing}" if missing else ", all there")
          + f"; {time.monotonic() - t0:.1f} s")
    earlier = [n for n in missing if n < min(args.n)]
    if earlier:
        print(f"carry-vllm: warning: pieces {earlier} of earlier calls are gone: this is a fresh machine;"
              f" make the calls again from the first, back to back")


def check_import(site: Path, py: str, modules: tuple[str, ...], show: str = "") -> tuple[bool, str, str]:
    """Imports `modules` in a fresh `py` with `site` first: (ok, what `show` evaluates to (default: the first
    module's version), everything it printed). That goes out behind a marker: LMCache logs to stdout as it imports."""
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    code = f"import {', '.join(modules)}; print('carry-vllm-shows', {show or modules[0] + '.__version__'})"
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True)
    said = (r.stdout + r.stderr).strip()
    shown = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("carry-vllm-shows ")]
    return r.returncode == 0 and bool(shown), (shown[-1] if shown else ""), said


def check_lmcache(site: Path, py: str) -> tuple[bool, str]:
    """LMCache's imports (LMCACHE_IMPORTS); the message names the device LMCache found and, on CUDA, whether its
    compiled c_ops loaded or LMCache fell back to its torch ops (slower; a few ops raise NotImplementedError)."""
    ok, shown, said = check_import(site, py, LMCACHE_IMPORTS, "lmcache.__version__, lmcache.torch_device_type")
    if not ok:
        return False, said[-2500:]
    version, device = shown.split()
    if device != "cuda":
        ops = f"device {device}: no CUDA, so c_ops was not tried"
    elif LMCACHE_FALLBACK in said:
        ops = "cuda, on its torch fallback: its compiled c_ops did not load"
    else:
        ops = "cuda, with its compiled c_ops"
    return True, f"lmcache {version} imports ({', '.join(LMCACHE_IMPORTS[1:])} too); {ops}"


def host_report(manifest: dict, site: Path, py: str) -> None:
    """Which host packages miss a pin of vLLM's tree (the host's versions as seen with the new site first)."""
    code = r"""
import importlib.metadata as md, json, sys
from packaging.specifiers import SpecifierSet
bad, absent = [], {}
for r in json.loads(sys.argv[1]):
    try:
        v = md.version(r["name"])
    except md.PackageNotFoundError:
        absent.setdefault(r["name"], set()).add(r["by"])
        continue
    if r["spec"] and not SpecifierSet(r["spec"]).contains(v, prereleases=True):
        bad.append(r["name"] + " " + v + " misses " + r["spec"] + " (" + r["by"] + ")")
print("host packages missing a pin: " + ("; ".join(sorted(set(bad))) or "none"))
absent = [n + " (" + ", ".join(sorted(b)) + ")" for n, b in sorted(absent.items())]
print("host packages absent: " + ("; ".join(absent) or "none"))
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([py, "-c", code, json.dumps(manifest["host_requirements"])], env=env, capture_output=True,
                       text=True)
    print(r.stdout.strip() if r.returncode == 0 else f"(host version report failed: {r.stderr.strip()[-300:]})")


def cmd_install(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    tmp, site = tmp_dir(), site_dir()
    py = os.environ.get("VLLM_CARRY_PYTHON", "python3")
    src = REPO / MANIFEST
    manifest = load_manifest(src if src.exists() else tmp / "manifest.json")
    stamp = site / f".carry-vllm-{manifest['id']}"
    pythonpath = f"export PYTHONPATH={site}:."
    if stamp.exists():
        ok, version, _ = check_import(site, py, VLLM_IMPORTS)
        lmcache_ok, lmcache_said = check_lmcache(site, py) if manifest.get("lmcache") else (True, "")
        if ok and lmcache_ok:
            print(f"vllm {version} already installed in {site}; import ok ({time.monotonic() - t0:.1f} s)")
            if lmcache_said:
                print(lmcache_said)
            print(pythonpath)
            return
        print(f"carry-vllm: {site} was installed but the import fails now; installing again")
    have = present(manifest, tmp)
    missing = [p["n"] for p in manifest["pieces"] if p["n"] not in have]
    if missing:
        die(f"pieces {missing} are not in {tmp}: make the calls that carry them (prepare prints them, or"
            f" `bash {TOOL} plan` here), back to back, then install")
    wdir = tmp / "wheels"
    shutil.rmtree(wdir, ignore_errors=True)
    wdir.mkdir()
    parts: dict[str, list[dict]] = {}
    for p in manifest["pieces"]:
        if p["kind"] == "part":
            parts.setdefault(p["of"], []).append(p)
        else:
            with tarfile.open(tmp / p["file"]) as t:
                t.extractall(wdir, filter="data")
    for name, ps in parts.items():
        with open(wdir / name, "wb") as out:
            for p in sorted(ps, key=lambda p: p["index"]):
                with open(tmp / p["file"], "rb") as f:
                    shutil.copyfileobj(f, out, 16 * MIB)
    expect = {manifest["vllm"]["file"]: manifest["vllm"]["sha256"]}
    expect.update({w["file"]: w["sha256"] for w in manifest["wheels"]})
    for name, sha in expect.items():
        path = wdir / name
        if not path.exists():
            die(f"{name} is missing after reassembly: the pieces do not match this manifest; rerun prepare here")
        got = sha256(path)
        if got != sha:
            die(f"{name} reassembled with sha256 {got}, expected {sha}: delete {tmp} and make the calls again")
    print(f"{len(expect)} wheels reassembled, sha256 ok (vllm {manifest['vllm']['sha256'][:12]}...);"
          f" {time.monotonic() - t0:.1f} s")
    shutil.rmtree(site, ignore_errors=True)
    # VLLM_CARRY_PIP_ARGS: extra pip arguments, for a dry run off the host (--python-version 3.12 --platform ...).
    extra = os.environ.get("VLLM_CARRY_PIP_ARGS", "").split()
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", *extra, "--target", str(site), *[str(wdir / n) for n in expect]])
    if r.returncode != 0:
        die(f"pip install --target {site} failed (exit {r.returncode}); see pip's message above")
    shutil.rmtree(wdir, ignore_errors=True)  # the pieces stay, so install can run again
    print(f"installed into {site}; {time.monotonic() - t0:.1f} s")
    host_report(manifest, site, py)
    lmcache = bool(manifest.get("lmcache"))
    # The two import checks run side by side (each a fresh Python, ~30-50 s on the H200 host, mostly imports):
    # the call then waits for the longer, not their sum.
    with ThreadPoolExecutor(max_workers=2) as pool:
        lmcache_check = pool.submit(check_lmcache, site, py) if lmcache else None
        ok, version, said = check_import(site, py, VLLM_IMPORTS)
        lmcache_result = lmcache_check.result() if lmcache_check is not None else None
    if not ok:
        die(f"`import vllm, vllm.entrypoints.openai.api_server` fails with PYTHONPATH={site}:"
            f"\n{said[-2500:]}\nthe last line names the missing module: carry it as a wheel too (prepare's list)")
    print(f"vllm {version} imports, vllm.entrypoints.openai.api_server too; {time.monotonic() - t0:.1f} s"
          + ("" if lmcache else " in all"))
    if lmcache_result is not None:
        ok, said = lmcache_result
        if not ok:
            die(f"`import {', '.join(LMCACHE_IMPORTS)}` fails with PYTHONPATH={site}:\n{said}\nthe last line names"
                " what is missing: if LMCACHE_LEFT_OUT in scripts/carry_vllm.py names it, take it off that list and"
                " prepare --lmcache again")
        print(f"{said}; {time.monotonic() - t0:.1f} s in all")
    stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    print(pythonpath)


def main() -> None:
    ap = argparse.ArgumentParser(prog="carry-vllm.sh", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: download, split, write the manifest, print the device calls")
    p.add_argument("--kernels", action="store_true", help="also carry vLLM's CUDA kernel and media libraries")
    p.add_argument("--lmcache", action="store_true", help=f"also carry LMCache {LMCACHE_VERSION} (vLLM's "
                   "LMCacheConnectorV1) and what it needs that the host lacks")
    sub.add_parser("plan", help="here: print the device calls of the last prepare again")
    r = sub.add_parser("receive", help="there: copy carried pieces into /tmp/vllm-carry and check them")
    r.add_argument("n", type=int, nargs="+")
    sub.add_parser("install", help="there: reassemble, check, install into /tmp/vllm-site, import vllm (and lmcache"
                   " when carried)")
    args = ap.parse_args()
    {"prepare": cmd_prepare, "plan": cmd_plan, "receive": cmd_receive, "install": cmd_install}[args.cmd](args)


if __name__ == "__main__":
    main()
