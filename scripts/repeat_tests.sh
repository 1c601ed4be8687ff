#!/usr/bin/env bash
# Is the server test suite deterministic? Runs the server, reliability and end-to-end test modules
# N times in a row (default 20), then once more with every core kept busy by a spinning loop; a test
# that depends on how fast the machine is shows up as a failing run. Each run has a fresh random seed
# (printed; LILY_TEST_SEED=that repeats it); the logs of failing runs are kept.
#
#   scripts/repeat_tests.sh [N] [pytest args...]     e.g. scripts/repeat_tests.sh 5 -k "not schemathesis"
#   LILY_REPEAT_MODULES="tests/test_server_e2e.py" scripts/repeat_tests.sh 3
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
shift || true
read -r -a modules <<< "${LILY_REPEAT_MODULES:-tests/test_server_app.py tests/test_server_e2e.py tests/test_server_api_gaps.py tests/test_server_batching.py tests/test_reliability_faults.py tests/test_reliability_load.py tests/test_reliability_security.py tests/test_reliability_bad_input.py tests/test_batching.py}"
logs=$(mktemp -d "${TMPDIR:-/tmp}/lily-repeat-XXXXXX")
failed=()

one_run() {  # $1: the run's name; the rest: pytest arguments
    local name=$1 t0=$SECONDS seed
    shift
    local log="$logs/$name.log"
    seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
    if LILY_TEST_SEED=$seed python3 -m pytest -p no:cacheprovider "${modules[@]}" "$@" > "$log" 2>&1; then
        echo "$name: passed in $((SECONDS - t0))s (LILY_TEST_SEED=$seed)"
        rm -f "$log"
    else
        echo "$name: FAILED in $((SECONDS - t0))s (LILY_TEST_SEED=$seed); log: $log"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
        failed+=("$name")
    fi
}

for i in $(seq 1 "$runs"); do
    one_run "run-$i-of-$runs" "$@"
done

spinners=()
for _ in $(seq "$(nproc)"); do
    ( while :; do :; done ) &
    spinners+=($!)
done
trap 'kill "${spinners[@]}" 2>/dev/null' EXIT
one_run "loaded-run-$(nproc)-busy-loops" "$@"
kill "${spinners[@]}" 2>/dev/null
trap - EXIT

echo "${#failed[@]} of $((runs + 1)) runs failed${failed:+: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]
