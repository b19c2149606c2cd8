#!/usr/bin/env bash
# Issue 19, run 26 on one H200 (~8 minutes): after the forward's inputs stopped synchronizing the host (it queues the
# forward while a pool load copies): (a) tests/engine on CUDA, (b) cross-replica ON at 128k, bf16 then fp8, two
# documents each, the load in 1 and 2 waves (experiments/h200_tail_profile.py --plain --waves 1,2).
#   OUT=/some/dir bash experiments/h200_run26.sh
set -uo pipefail
OUT=${OUT:-out/run26}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine 2>&1 | tee "$OUT/pytest.txt" | tail -3
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout $((${TAIL_S:-380} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-380}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 72GiB --arms bf16,fp8 \
  --docs 2 --plain --waves 1,2 2>&1 | grep -E "B |\|" | tail -20
echo "tail exit $? after $((SECONDS - start)) s"
