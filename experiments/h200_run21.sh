#!/usr/bin/env bash
# Issue 19, run 21 on one H200 (~5.5 minutes): (a) the fused-kernel and paged-kernel tests, (b) a local prefix hit's
# 20-token tail at 128k without a pool, timed and profiled (experiments/h200_tail_local.py), (c) fp8 cross-replica ON
# at 128k, two documents (experiments/h200_tail_profile.py --plain).
#   OUT=/some/dir bash experiments/h200_run21.sh
set -uo pipefail
OUT=${OUT:-out/run21}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_fused_ops.py tests/engine/test_paged_attention.py \
  2>&1 | tee "$OUT/pytest.txt" | tail -3
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout "${LOCAL_S:-100}" python3 experiments/h200_tail_local.py --length 131072 --out "$OUT/local.json" 2>&1 \
  | grep -v -i warn | tail -17 | tee "$OUT/local.txt"
echo "local exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout $((${TAIL_S:-170} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-170}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 72GiB --arms fp8 \
  --docs 2 --plain 2>&1 | grep -E "B |\|" | tail -8
echo "tail exit $? after $((SECONDS - start)) s"
