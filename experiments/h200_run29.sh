#!/usr/bin/env bash
# Issue 19, run 29 on one H200 (~8 minutes): the forward's inputs (the tail's tokens after the LOOKUP) uploaded
# before the load queues its copies: (a) tests/engine on CUDA; (b) cross-replica ON at 128k, bf16 then fp8, two
# documents each (a 72 GiB pool holds two bf16 ones), each loaded with 1, 2 and 3 layer waves, TTFT only
# (experiments/h200_tail_profile.py --plain).
#   OUT=/some/dir bash experiments/h200_run29.sh
source experiments/h200_setup.sh run29
engine_tests
timeout $((${TAIL_S:-380} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-380}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 72GiB --arms bf16,fp8 \
  --docs 2 --waves 1,2,3 --plain 2>&1 | grep -vE "^(==|USDT|ERROR: External)" > "$OUT/tail.txt"
echo "tail exit $? after $((SECONDS - start)) s"
grep -E "^  B |^\|" "$OUT/tail.txt" | tail -24
