#!/usr/bin/env bash
# Downloads the wheels the H200 host lacks (it has torch, numpy, xxhash, httpx, rich, prometheus-client, jinja2 ...
# but not msgspec, FastAPI and its stack, whose telemetry module needs opentelemetry-api, nor fla-core + einops) into .whl/ for Python 3.12 manylinux x86_64. The device run installs them
# with: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# Versions follow the CPU venv so both machines run the same code paths.
pkgs=(msgspec==0.23.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc opentelemetry-api==1.45.2
      fla-core==0.6.0 einops==0.8.2)  # flash-linear-attention's kernels: hybrid models' Gated DeltaNet on CUDA
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "${pkgs[@]}"
ls -1 .whl
