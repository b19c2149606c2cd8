#!/usr/bin/env bash
# Issue 19, run 20 on one H200 (~8 minutes): (a) the CUDA tests of tests/engine (paged kernel, fused per-token kernels,
# the engine through both and CUDA graphs), (b) served decode through the HTTP stream, graphs + kernels (now) vs eager
# gathered (before) (experiments/h200_served_decode.py), (c) the floor, then cross-replica ON at 128k, bf16 then fp8,
# two documents each (experiments/h200_tail_profile.py --plain).
#   OUT=/some/dir bash experiments/h200_run20.sh
set -uo pipefail
OUT=${OUT:-out/run20}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout "${PYTEST_S:-100}" python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine 2>&1 \
  | tee "$OUT/pytest.txt" | tail -5
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout "${DECODE_S:-110}" python3 experiments/h200_served_decode.py --out "$OUT/decode" --arms graphs,eager-torch \
  --budget $((${DECODE_S:-110} - 10)) 2>&1 | grep -v "prompt [0-9]:" | tee "$OUT/decode.txt"
echo "served decode exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout 60 python3 experiments/h200_floor.py 2>&1 | tee "$OUT/floor.txt"
timeout $((${TAIL_S:-290} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-290}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 100GiB --arms bf16,fp8 \
  --docs 2 --plain 2>&1 | grep -E "B |summary|\|" | tail -12
echo "tail exit $? after $((SECONDS - start)) s"
