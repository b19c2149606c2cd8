#!/usr/bin/env bash
# Issue 19, run 27 on one H200 (~9 minutes): (a) one 128k bf16 cross-replica ON request's timeline with the load in
# 1 and then 2 layer waves: torch.profiler with named ranges and no synchronize (experiments/h200_tail_profile.py
# --timeline; summary by experiments/request_timeline.py), after a plain (unprofiled) request of another document;
# (b) the storing request vs cache OFF and ON at 32k, in-process replicas A then B, blocks OFF-ON-ON-OFF
# (experiments/h200_cross_replica.py; two 32B replicas do not fit one H200 at once).
#   OUT=/some/dir bash experiments/h200_run27.sh
source experiments/h200_setup.sh run27
timeout $((${TAIL_S:-250} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-250}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 72GiB --arms bf16 \
  --docs 2 --waves 1,2 --timeline 2>&1 | grep -vE "^(==|USDT|ERROR: External)" | tee "$OUT/tail.txt" | tail -60
echo "tail exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
timeout "${CROSS_S:-300}" python3 experiments/h200_cross_replica.py run --lengths 32768 --reps 3 \
  --max-model-len 40960 --pool-size 48GiB --regression-len 0 --out "$OUT/cross32k" 2>&1 | tail -14
echo "cross exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
