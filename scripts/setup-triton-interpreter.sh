#!/usr/bin/env bash
# Triton and a numpy its interpreter works with, in .triton-interpreter/ (outside the venv: the project's numpy stays
# as it is). tests/engine/test_paged_interpreter.py runs the paged-attention and fused kernels with them on a CPU
# (TRITON_INTERPRET=1); without this folder that test skips. Triton 3.6.0 is the version the H200 host's torch ships;
# its interpreter fails on numpy >= 2.4 (a one-element array as a loop bound).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
"$PY" -m pip install -q --disable-pip-version-check --target .triton-interpreter triton==3.6.0 numpy==2.3.5
echo "Triton's interpreter ready in .triton-interpreter"
