#!/usr/bin/env bash
# `lily serve` on a real GPU (fast backend, tiny synthetic checkpoint; no internet needed):
#   1. the engine's fast path in one process (scripts/gpu_server_check.py): no per-request state or graph
#      capture (the pooled state is reused), pooled/prefix-hit requests == fresh-state greedy tokens, GPU
#      memory back to idle; what a request used to pay (allocate + capture) vs its first-token latency now
#   2. 64 concurrent streaming clients against a real `lily serve --device cuda --backend fast`
#      (scripts/load_test.py): every request complete or a clean 429, host RSS and GPU memory back to idle
#   3. tests/test_server_gpu.py (a server process checked against the device-side greedy loop)
# Logs and JSON go to $OUT; a short summary is printed last. Exit status 0 only when all three pass.
#
# The server's packages (fastapi, uvicorn, pydantic, openai, ...) come with `pip install -e '.[test]'`. On a GPU
# machine without internet where they are missing: `stage` downloads them here into the git-ignored
# .whl/server/; copy that folder into the GPU machine's checkout and this script installs them into /tmp/site.
#
# Usage (repo root):  scripts/gpu_server_check.sh stage            (on a machine with internet: the wheels, ~6 MB)
#                     scripts/gpu_server_check.sh                  (on the GPU machine)
#                     scripts/gpu_server_check.sh --device cpu     (a dry run without a GPU: the kernels in the
#                        Triton interpreter for step 1, the reference backend for the server, step 3 skips itself)
set -uo pipefail
cd "$(dirname "$0")/.."
# versions the test suite is known to pass with; wheels for python 3.12 (PY_VERSION to change)
SERVER_WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 typing-inspection==0.4.2
  annotated-types==0.7.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 typing-extensions==4.16.0 anyio==4.16.0
  uvicorn==0.54.0 h11==0.16.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  sniffio==1.3.1"
if [ "${1:-}" = stage ]; then
  rm -rf .whl/server && mkdir -p .whl/server
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl/server $SERVER_WHEELS || exit 1
  git check-ignore -q .whl/server || echo "warning: .whl/server is not git-ignored" >&2
  ls .whl/server && du -sh .whl/server
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lily-server-check}
mkdir -p "$OUT"
# shellcheck source=scripts/server_wheels.sh
. scripts/server_wheels.sh
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=$2; fi
if [ "$DEVICE" = cpu ]; then
  BACKEND=reference; ENGINE_ARGS=(--requests 2 --max-tokens 3 --prompt-tokens 6); LOAD_TOKENS=8
else
  BACKEND=fast; ENGINE_ARGS=(--requests 6 --max-tokens 24); LOAD_TOKENS=32
fi
START=$(date +%s)
stamp() { echo "[gpu_server_check +$(( $(date +%s) - START ))s] $*" >&2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true

stamp "1/3 engine fast path ($DEVICE)"
timeout 200 python3 scripts/gpu_server_check.py --device "$DEVICE" "${ENGINE_ARGS[@]}" --json "$OUT/server-engine.json" \
  > "$OUT/server-engine.log" 2>&1
RC_ENGINE=$?

stamp "2/3 load test: 64 streaming clients against lily serve --device $DEVICE --backend $BACKEND"
timeout 150 python3 scripts/load_test.py --serve-synthetic --device "$DEVICE" --backend "$BACKEND" --clients 64 \
  --max-tokens "$LOAD_TOKENS" --max-seq 2048 --seed 7 --server-log "$OUT/load-serve.log" --json "$OUT/load-64.json" \
  > "$OUT/load-64.log" 2>&1
RC_LOAD=$?

RC_TESTS=0
if [ -f tests/test_server_gpu.py ]; then
  stamp "3/3 tests/test_server_gpu.py"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_server_gpu.py --junitxml "$OUT/test_server_gpu.xml" \
    > "$OUT/test_server_gpu.log" 2>&1
  RC_TESTS=$?
else
  echo "tests/test_server_gpu.py: not present" > "$OUT/test_server_gpu.log"
fi
stamp "done"

echo "== engine (exit $RC_ENGINE): $OUT/server-engine.log"
tail -n 12 "$OUT/server-engine.log"
echo "== load test (exit $RC_LOAD): $OUT/load-64.log"
tail -n 6 "$OUT/load-64.log"
echo "== tests/test_server_gpu.py (exit $RC_TESTS): $OUT/test_server_gpu.log"
tail -n 3 "$OUT/test_server_gpu.log"
echo "== summary: engine $([ $RC_ENGINE = 0 ] && echo OK || echo FAILED), load $([ $RC_LOAD = 0 ] && echo OK || echo FAILED), server tests $([ $RC_TESTS = 0 ] && echo OK || echo FAILED); $(( $(date +%s) - START ))s"
[ $RC_ENGINE = 0 ] && [ $RC_LOAD = 0 ] && [ $RC_TESTS = 0 ]
