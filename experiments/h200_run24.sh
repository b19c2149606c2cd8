#!/usr/bin/env bash
# Issue 19, run 24 on one H200 (~8 minutes): (a) the storing request vs cache OFF and cross-replica ON at 32k with
# the final code, in-process replicas A then B, blocks OFF-ON-ON-OFF, three requests a block
# (experiments/h200_cross_replica.py: two 32B replicas do not fit one H200 at once, so not served); (b) served decode
# through the HTTP stream, graphs + kernels vs eager gathered (experiments/h200_served_decode.py).
#   OUT=/some/dir bash experiments/h200_run24.sh
set -uo pipefail
OUT=${OUT:-out/run24}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout "${CROSS_S:-330}" python3 experiments/h200_cross_replica.py run --lengths 32768 --reps 3 \
  --max-model-len 40960 --pool-size 48GiB --regression-len 0 --out "$OUT/cross32k" 2>&1 | tail -14
echo "cross exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout "${DECODE_S:-110}" python3 experiments/h200_served_decode.py --out "$OUT/decode" --arms graphs,eager-torch \
  --budget $((${DECODE_S:-110} - 10)) 2>&1 | grep -v "prompt [0-9]:" | tee "$OUT/decode.txt"
echo "served decode exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
