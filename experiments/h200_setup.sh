# Sourced by the H200 run scripts (experiments/h200_runNN.sh): $OUT made (default out/<name>), the carried wheels
# installed beside the host's torch, the import path set, `start` the script's start; `engine_tests` runs
# tests/engine on CUDA (not slow) into $OUT/pytest.txt.
#   source experiments/h200_setup.sh run29
set -uo pipefail
OUT=${OUT:-out/$1}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:experiments PYTHONUNBUFFERED=1

engine_tests() {
  timeout 130 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine 2>&1 | tee "$OUT/pytest.txt" | tail -2
  echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
