#!/usr/bin/env bash
# Issue 19, run 12 on one H200, one call bounded to ~8.5 minutes: (a) the CUDA tests of tests/transfer and
# tests/engine (not slow), (b) replica start-up attached to 32 and 100 GiB pools, (c) fp8 vs bf16 cross-replica ON
# TTFT with the transfer floor (experiments/h200_run12.py). Every part has its own time limit, so $OUT always holds
# what was measured. Run from the repository root with the wheels of scripts/gather-wheels.sh in .whl/:
#   OUT=/some/dir bash experiments/h200_run12.sh      (TOTAL=seconds for all of it, default 490; PYTEST_S, default 100;
#   PYTEST_ARGS: test paths, default tests/transfer tests/engine; RUN_ARGS: more flags for h200_run12.py run)
set -uo pipefail
OUT=${OUT:-out/run12}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
free -g | head -2; df -h /dev/shm | tail -1; ulimit -l
timeout "${PYTEST_S:-100}" python3 -m pytest -q -p no:cacheprovider -m "not slow" ${PYTEST_ARGS:-tests/transfer tests/engine} 2>&1 \
  | tee "$OUT/pytest.txt" | tail -15
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
budget=$((${TOTAL:-490} - (SECONDS - start)))
python3 experiments/h200_run12.py run --out "$OUT" --budget "$budget" ${RUN_ARGS:-}
echo "run12 done after $((SECONDS - start)) s"
