#!/usr/bin/env bash
# Issue 19, run 18 on one H200, one call bounded to ~8 minutes: (a) the CUDA tests of tests/engine (the paged kernel
# against float64, the engine's CUDA and fp8 tests, now through the kernel and CUDA graphs), (b) the kernel against the
# gathered path for the 32B attention shape (experiments/h200_paged_kernel.py), (c) served decode through the HTTP
# stream: CUDA graphs vs eager kernel vs eager gathered (experiments/h200_served_decode.py). Each part has its own time
# limit. From the repository root with the wheels of scripts/gather-wheels.sh in .whl/:
#   OUT=/some/dir bash experiments/h200_run18.sh
set -uo pipefail
OUT=${OUT:-out/run18}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
timeout "${PYTEST_S:-120}" python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine 2>&1 \
  | tee "$OUT/pytest.txt" | tail -8
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout "${KERNEL_S:-150}" python3 experiments/h200_paged_kernel.py --out "$OUT/paged_kernel.json" \
  --budget $((${KERNEL_S:-150} - 30)) 2>&1 | tee "$OUT/paged_kernel.txt"
echo "kernel probe exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout "${DECODE_S:-210}" python3 experiments/h200_served_decode.py --out "$OUT/decode" \
  --budget $((${DECODE_S:-210} - 20)) 2>&1 | tee "$OUT/decode.txt" | grep -v "prompt [0-9]:"
echo "served decode exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
