#!/usr/bin/env bash
# The transfer layer on a CUDA host, one command: pytest (CUDA tests included), validate transfer (race test with
# its negative control), bench transfer (Qwen2.5-32B-shaped KV). Logs and JSON go to $OUT; a short table comes last.
# Run from the repository root: OUT=/some/dir bash experiments/h200_transfer.sh   (about 2-3 minutes on an H200)
set -uo pipefail
OUT=${OUT:-out/transfer}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
status=0

if $PY -c "import pytest, hypothesis" 2>/dev/null; then
  timeout 240 $PY -m pytest -q -p no:cacheprovider tests/transfer 2>&1 | tee "$OUT/pytest_transfer.log" | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest or hypothesis missing: bring their wheels to run tests/transfer" | tee "$OUT/pytest_transfer.log"
fi

timeout 240 $PY -m kvshare.cli validate transfer --device cuda --trials 20 --json "$OUT/validate_transfer.json" \
  2>&1 | tee "$OUT/validate_transfer.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 240 $PY -m kvshare.cli bench transfer --device cuda --tokens 32768 --json "$OUT/bench_transfer.json" \
  2>&1 | tee "$OUT/bench_transfer.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

$PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
tests = (out / "pytest_transfer.log").read_text().strip().splitlines()
rows.append(("pytest tests/transfer", tests[-1] if tests else "no output"))
try:
    v = json.loads((out / "validate_transfer.json").read_text())
    for m in v["modes"]:
        rows.append((f"validate ordering={m['ordering']}", f"{m['trials']} trials: store {m['store_mismatches']}, "
                     f"load {m['load_mismatches']}, checksum {m['checksum_mismatches']}, skip {m['skip_violations']} mismatches"))
    rows.append(("validate verdict", "PASS" if v["passed"] else "FAIL"))
except Exception as error:  # noqa: BLE001 - the summary must print whatever happened
    rows.append(("validate", f"no result ({error})"))
try:
    b = json.loads((out / "bench_transfer.json").read_text())
    for name, roof in (("store", "to_host"), ("load", "from_host")):
        got, ceil = b[name]["gbps_median"], b["ceiling"][roof]["gbps_median"]
        rows.append((f"bench {name}", f"{got:.1f} GB/s vs ceiling {ceil:.1f} GB/s = {got / ceil:.0%} (target >= 90%)"))
    rows.append(("bench round trip exact", str(b["round_trip_exact"])))
except Exception as error:  # noqa: BLE001
    rows.append(("bench", f"no result ({error})"))
width = max(len(r[0]) for r in rows)
print("\n== transfer on " + (b["machine"].get("gpu", "?") if "b" in dir() else "?") + " ==")
for name, value in rows:
    print(f"{name:<{width}}  {value}")
PY
exit $status
