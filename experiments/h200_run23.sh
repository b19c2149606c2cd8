#!/usr/bin/env bash
# Issue 19, run 23 on one H200 (~9 minutes): the 256k rows. Cross-replica ON at 252k tokens (a 258,048-token
# document plus a question), fp8 first (target <= 0.90 s), then bf16 (target: ON minus floor <= 0.20 s), the load in
# 1 and 4 layer waves side by side, one document per KV dtype (A's 252k prefill takes ~2 minutes), and the floor.
#   OUT=/some/dir bash experiments/h200_run23.sh
set -uo pipefail
OUT=${OUT:-out/run23}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout 60 python3 experiments/h200_floor.py 2>&1 | tee "$OUT/floor.txt"
timeout $((${TAIL_S:-520} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/waves256k" \
  --budget "${TAIL_S:-520}" --settle 14 --length 258048 --max-model-len 262144 --pool-size 72GiB --arms fp8,bf16 \
  --docs 1 --plain --waves 1,2 2>&1 | grep -E "A |B |\||==" | tail -16
echo "waves exit $? after $((SECONDS - start)) s"
