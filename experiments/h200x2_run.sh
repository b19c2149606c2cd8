#!/usr/bin/env bash
# Issue 9 on kind nvidia-h200-x2: the case study's setup run the way a user runs it - one pool on the host, two
# `kvshare serve` replicas of the qwen2.5-32b shape (dummy bf16 weights), one per GPU, and for sessions the router in
# front - driven by `kvshare bench` over HTTP with streaming. One part per device call (each must end within 10 min):
#
#   bash experiments/h200x2_run.sh check      CUDA tests of the engine and transfer layer, then cross-replica at 128k
#   bash experiments/h200x2_run.sh cross256a  cross-replica at 255k (261120 tokens + a 64-token question: fits 262144),
#                                         blocks OFF1 and ON1 (the four blocks outlast one 10-minute call)
#   ROWS=.../requests.jsonl bash experiments/h200x2_run.sh cross256b   blocks ON2 and OFF2, reported with cross256a's rows
#   bash experiments/h200x2_run.sh sessions   six-turn sessions at 32k and 128k, alternate vs fixed, pool OFF vs ON
#
# A 255k prompt is 64 GiB of KV; the pool's default lease limit is half its arena, so the 255k parts default to a
# 136 GiB pool (limit 68 GiB): with less, A stores and B loads only the part of the document under the limit.
#
# Results go to $OUT/<part>.tar.gz (rows, report.md, summary.json, plots, replica logs: one file, since the device
# tool returns only a few files per call). Environment overrides for a dry run
# on a CPU machine: PRESET=small DEVICE=cpu GPUS= LENGTHS=512 CONTEXTS=1k POOL=2GiB MAXLEN=4096.
set -euo pipefail
part=${1:?usage: h200x2_run.sh check|cross256a|cross256b|sessions}
OUT=${OUT:?set OUT to the results folder}
PY=${PYTHON:-python3}
export COLUMNS=${COLUMNS:-160}  # the summary tables are printed for a log, not a terminal
PRESET=${PRESET:-qwen2.5-32b}
DEVICE=${DEVICE:-cuda}
if [ -z "${MODEL:-}" ]; then  # generated afresh each call (config + tokenizer only: seconds)
  MODEL=$(mktemp -d)/$PRESET
  $PY -m kvshare.cli make-model --preset "$PRESET" --out "$MODEL"
fi
rm -f /dev/shm/kvshare-*  # an arena left by a run the call limit killed
mkdir -p "$OUT/$part"
pack() {  # the device tool returns only a few files per call: one archive per part (rows, reports, plots, logs)
  tar czf "$OUT/$part.tar.gz" -C "$OUT" "$part" && rm -rf "${OUT:?}/$part"
}
trap pack EXIT
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv \
  || true; df -h /dev/shm; free -g; nproc; } > "$OUT/$part/machine.txt" 2>&1
# Loaded chunks are not checksummed unless VERIFY=1 (comparable with docs/results/h200 runs 3-4, which predate the
# parallel hashing that overlaps the copies); byte-exactness of the path is what `kvshare validate transfer` proves.
case $part in cross256*) pool=${POOL:-136GiB} ;; *) pool=${POOL:-100GiB} ;; esac
common=(--local "$MODEL" --device "$DEVICE" --gpus "${GPUS-0,1}" --load-format dummy --max-model-len "${MAXLEN:-262144}"
        --pool-size "$pool")
[ "${VERIFY:-0}" = 1 ] || common+=(--no-verify-checksums)
# Each benchmark stops itself (SIGTERM: it stops its processes and writes a partial report) before the device
# tool's 10-minute limit would kill the call without packing the archive.
bench() { timeout -s TERM "${PART_TIMEOUT:-540}" $PY -m kvshare.cli bench "$@" || echo "bench exited with $?"; }
cross() {  # cross-replica OFF-ON-ON-OFF, one request per length and block; A's request skipped in OFF blocks
  bench cross-replica "${common[@]}" --lengths "$1" --per-block 1 --question-tokens 64 \
    --max-tokens 8 --skip-off-warm --out "$OUT/$part/cross-$2" "${@:3}"
}
case $part in
  check)
    if [ "$DEVICE" = cuda ]; then
      $PY -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/transfer/test_transfer_cuda.py \
        2>&1 | tail -5 | tee "$OUT/$part/pytest-cuda.txt"
    fi
    cross "${LENGTHS:-128k}" 128k ;;
  cross256a)
    cross "${LENGTHS:-261120}" 255k --blocks OFF1,ON1 ;;
  cross256b)
    cross "${LENGTHS:-261120}" 255k --blocks ON2,OFF2 --rows "${ROWS:?set ROWS to the requests.jsonl of cross256a}" ;;
  sessions)
    bench sessions "${common[@]}" --contexts "${CONTEXTS:-32k,128k}" --turns 6 --user-tokens 256 \
      --answer-tokens 32 --sessions 1 --out "$OUT/$part/sessions" ;;
  *) echo "unknown part $part: check|cross256a|cross256b|sessions" >&2; exit 2 ;;
esac
