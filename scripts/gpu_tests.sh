#!/usr/bin/env bash
# GPU test files one by one, each under its own time limit, logs to $OUT/tests_<name>.log and a
# one-line tally per file printed last. Arguments: a file or pytest node id, with more pytest
# arguments after it if any (split on spaces), then @seconds (default 120 s), e.g.
#   scripts/gpu_tests.sh tests/gpu/test_penalties_cuda.py@60 "tests/gpu/test_fp8_cuda.py::test_x"
#   scripts/gpu_tests.sh "tests/gpu/test_models_cuda.py -k qwen2_moe@300"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
summary=()
for spec in "$@"; do
  file=${spec%%@*}; limit=120; [ "$spec" != "$file" ] && limit=${spec##*@}
  read -ra args <<<"$file"  # the file or node id, then any pytest arguments
  name=$(basename "${file%%::*}" .py)${file#"${file%%::*}"}; name=${name//[^A-Za-z0-9_]/_}
  timeout "$limit" python3 -m pytest -q -rf --tb=short -p no:cacheprovider "${args[@]}" \
    >"$OUT/tests_$name.log" 2>&1
  rc=$?
  tally=$(grep -E "passed|failed|error" "$OUT/tests_$name.log" | tail -1)
  [ $rc -eq 124 ] && tally="TIMEOUT after ${limit}s; $(grep -cE '(PASSED|FAILED)' "$OUT/tests_$name.log") lines"
  summary+=("$name: $tally")
  grep -E "^FAILED|^ERROR" "$OUT/tests_$name.log" | cut -c1-220
done
printf '%s\n' "${summary[@]}"
