#!/usr/bin/env bash
# Continuous batching on a real GPU, end to end, in one call (the batched step itself, kernel by kernel and
# per batch-size bucket, is scripts/gpu_batch_check.py, a call of its own):
#   1. scripts/serve_bench.py: `lily serve` on the full-size synthetic checkpoint (made in $MODEL_DIR, 19.5 GB,
#      unless it is there), streams at concurrency 1,4,8,16,32,64 through the openai client, 4K-token prompts,
#      256 tokens each: aggregate and per-stream tok/s, TTFT p50/p99, GPU memory against the budget
#      ($OUT/serve-bench-h200.json; draw it here with `python3 scripts/serve_bench.py --plot-only FILE`)
#   2. `lily bench --model $MODEL_DIR --contexts 4096`: the batch-1 numbers the single stream is held to
# Carry .whl/server (scripts/server_wheels.sh). Usage (repo root): scripts/gpu_serve_bench.sh [serve_bench args]
#   SKIP=bench scripts/gpu_serve_bench.sh --concurrency 1,8,32      (only the load benchmark, 3 levels)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lily-serve-bench}
MODEL_DIR=${MODEL_DIR:-/tmp/lily-full}
SKIP=${SKIP:-}
mkdir -p "$OUT"
# shellcheck source=scripts/server_wheels.sh
. scripts/server_wheels.sh
export LILY_GIT_REVISION=${LILY_GIT_REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/nvidia-smi.txt" || true
START=$(date +%s)
stamp() { echo "[gpu_serve_bench +$(( $(date +%s) - START ))s] $*" >&2; }
RC_LOAD=0; RC_BENCH=0
stamp "1/2 load benchmark through lily serve"
timeout 420 python3 scripts/serve_bench.py --make-full "$MODEL_DIR" --json "$OUT/serve-bench-h200.json" "$@" \
  2>&1 | tee "$OUT/serve-bench.log" | grep -v "^\s*$" | tail -n 16
RC_LOAD=${PIPESTATUS[0]}
if [[ ",$SKIP," != *",bench,"* ]]; then
  stamp "2/2 lily bench at 4K (batch 1)"
  timeout 120 python3 -m lily bench --model "$MODEL_DIR" --contexts 4096 --rounds 2 --no-plot \
    --out "$OUT/bench-4k.json" > "$OUT/bench-4k.log" 2>&1; RC_BENCH=$?
  tail -n 6 "$OUT/bench-4k.log"
fi
stamp "done"
echo "== summary: load $([ $RC_LOAD = 0 ] && echo OK || echo FAILED), bench $([ $RC_BENCH = 0 ] && echo OK || echo FAILED)"
[ $RC_LOAD = 0 ] && [ $RC_BENCH = 0 ]
