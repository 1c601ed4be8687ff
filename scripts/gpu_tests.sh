#!/usr/bin/env bash
# Every GPU-only check, as one pass/fail (the CPU suite covers the rest):
#   1. decode kernels at full shapes and the fast path's fidelity (scripts/gpu_check.sh)
#   2. prefill kernels at full shapes and the prefill's fidelity (scripts/gpu_prefill_check.py)
#   3. the token picks at the real vocabulary (scripts/gpu_sample_check.py)
#   4. the server on the GPU (scripts/gpu_server_check.sh: the engine's fast path, 64 streaming clients,
#      and tests/test_server_gpu.py, whose tests may not skip here)
# Logs and JSON under $OUT (default /tmp/lily-gpu-tests), one folder a part; a summary is printed last.
# Exit status 0 only when every part passes.
#
# Usage (repo root, on a machine with an NVIDIA GPU):  scripts/gpu_tests.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LILY_REQUIRE_GPU=1  # tests/conftest.py: a skipped GPU test fails
OUT=${OUT:-/tmp/lily-gpu-tests}
START=$SECONDS
names=() codes=()

part() {  # NAME COMMAND...: run it with its own $OUT, its output in $OUT/NAME.log
    local name=$1
    shift
    mkdir -p "$OUT/$name"
    echo "[gpu_tests +$((SECONDS - START))s] $name: $*" >&2
    OUT="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    codes+=($?)
    names+=("$name")
}

part decode scripts/gpu_check.sh
part prefill python3 scripts/gpu_prefill_check.py
part sample python3 scripts/gpu_sample_check.py
part server scripts/gpu_server_check.sh

failed=0
for i in "${!names[@]}"; do
    echo "== ${names[$i]} (exit ${codes[$i]}): $OUT/${names[$i]}.log"
    tail -n 8 "$OUT/${names[$i]}.log"
    [ "${codes[$i]}" = 0 ] || failed=$((failed + 1))
done
echo "== gpu_tests: $(( ${#names[@]} - failed )) of ${#names[@]} parts passed in $((SECONDS - START))s"
[ "$failed" = 0 ]
