#!/usr/bin/env bash
# Issue 19, run 28 on one H200 (~8 minutes): after the forward's inputs are uploaded before a pool load queues its
# copies (run 27: an upload queued after them waited for all of them, so layer waves could not overlap anything):
# (a) tests/engine on CUDA; (b) cross-replica ON at 128k, bf16 then fp8, the load in 1, 2 and 3 layer waves
# (experiments/h200_tail_profile.py --timeline: per arm two documents plain, the third under the profiler with no
# synchronize; only the bf16 traces of 2 and 3 waves are kept, the others' timelines are in timelines.jsonl).
#   OUT=/some/dir bash experiments/h200_run28.sh
source experiments/h200_setup.sh run28
engine_tests
timeout $((${TAIL_S:-400} + 10)) python3 experiments/h200_tail_profile.py run --out "$OUT/tail128k" \
  --budget "${TAIL_S:-400}" --settle 14 --length 131072 --max-model-len 135168 --pool-size 72GiB --arms bf16,fp8 \
  --docs 3 --waves 1,2,3 --timeline 2>&1 | grep -vE "^(==|USDT|ERROR: External|  _warn_once)|UserWarning" \
  > "$OUT/tail.txt"
echo "tail exit $? after $((SECONDS - start)) s"
grep -E "^  B |^pool copies|^\|" "$OUT/tail.txt" | tail -40
rm -f "$OUT"/tail128k/trace_fp8_*.json.gz "$OUT"/tail128k/trace_bf16_w1.json.gz
