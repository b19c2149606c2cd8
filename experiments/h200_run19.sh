#!/usr/bin/env bash
# Issue 19, run 19 on one H200 (~9 minutes): (a) where a decode step goes with CUDA graphs
# (experiments/h200_decode_breakdown.py), (b) the transfer floor (experiments/h200_floor.py), (c) cross-replica ON at
# 128k, fp8 then bf16, with the paged kernel in the tail (experiments/h200_tail_profile.py --plain: TTFT only).
#   OUT=/some/dir bash experiments/h200_run19.sh
set -uo pipefail
OUT=${OUT:-out/run19}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout "${BREAKDOWN_S:-100}" python3 experiments/h200_decode_breakdown.py --out "$OUT/breakdown.json" 2>&1 \
  | grep -v Warning | tail -14 | tee "$OUT/breakdown.txt"
echo "breakdown exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout 60 python3 experiments/h200_floor.py 2>&1 | tee "$OUT/floor.txt"
timeout $((${TAIL_S:-400} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-400}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 100GiB --arms fp8,bf16 \
  --plain 2>&1 | tail -12
echo "tail exit $? after $((SECONDS - start)) s"
