#!/usr/bin/env bash
# Issue 19, run 13 on one H200, one call bounded to ~8 minutes: (a) the registration tests (tests/transfer, the ctypes
# path and the pieces; CUDA tests included), (b) replica start-up attached to a 100 GiB pool (then 32 GiB where time
# allows) with cudaHostRegister through torch's binding and through ctypes, and lazily; main-thread CUDA calls timed
# while the registration runs, (c) a 16 GiB pool killed and restarted twice under an attached CUDA connector
# (experiments/h200_run13.py), (d) the fp8/bf16 ON tail timed by phase and profiled (experiments/h200_tail_profile.py).
# Every part has its own time limit, so $OUT always holds what was measured. Run from the repository root with the
# wheels of scripts/gather-wheels.sh in .whl/:
#   OUT=/some/dir bash experiments/h200_run13.sh      (TOTAL=seconds for (a)-(c), default 330; TAIL_S for (d), default
#   200; PYTEST_S, default 60;
#   RUN_ARGS: more flags for h200_run13.py run, e.g. --pools 100GiB)
set -uo pipefail
OUT=${OUT:-out/run13}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
free -g | head -2; df -h /dev/shm | tail -1; ulimit -l
timeout "${PYTEST_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/transfer/test_register_via.py \
  tests/transfer/test_register_pieces.py 2>&1 | tee "$OUT/pytest.txt" | tail -8
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
budget=$((${TOTAL:-330} - (SECONDS - start) - 10))
timeout $((budget + 10)) python3 experiments/h200_run13.py run --out "$OUT" --budget "$budget" ${RUN_ARGS:-}
echo "run13 exit $? after $((SECONDS - start)) s"
# the fp8/bf16 tail profile (issue 19 item 2) with what the call has left: TAIL_S seconds, default 200
timeout $((${TAIL_S:-200} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail" --budget "${TAIL_S:-200}"
echo "tail profile exit $? after $((SECONDS - start)) s"
grep MemAvailable /proc/meminfo; ls /dev/shm | grep -c kvshare
nvidia-smi --query-gpu=memory.used --format=csv,noheader
