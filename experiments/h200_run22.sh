#!/usr/bin/env bash
# Issue 19, run 22 on one H200 (~7 minutes): (a) the CUDA tests never run on a GPU yet (layered loads' per-layer
# ordering, graph decode == eager decode, the final tail setting, the checksum kernel) and `kvshare validate
# transfer` (half its trials in layer waves), (b) the transfer floor, (c) cross-replica ON at
# 128k with the load in 1, 2, 4 and 8 layer waves side by side, bf16 and fp8, two documents each
# (experiments/h200_tail_profile.py --plain --waves).
#   OUT=/some/dir bash experiments/h200_run22.sh
set -uo pipefail
OUT=${OUT:-out/run22}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/transfer/test_transfer_cuda.py \
  tests/transfer/test_waves.py tests/engine 2>&1 | tee "$OUT/pytest.txt" | tail -4
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout 60 python3 -m kvshare validate transfer --device cuda --trials 20 --json "$OUT/validate.json" 2>&1 | tail -6
timeout 40 python3 experiments/h200_floor.py 2>&1 | tee "$OUT/floor.txt"
timeout $((${TAIL_S:-300} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/waves128k" \
  --budget "${TAIL_S:-300}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 72GiB --arms bf16,fp8 \
  --docs 2 --plain --waves 1,2,4,8 2>&1 | grep -E "B |\|" | tail -30
echo "waves exit $? after $((SECONDS - start)) s"
