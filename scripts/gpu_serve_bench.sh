#!/usr/bin/env bash
# Continuous batching on a real GPU, end to end, in one call of about 8 minutes (the batched step itself, kernel
# by kernel and per batch-size bucket, is scripts/gpu_batch_check.py, a call of its own):
#   1. the full-size synthetic checkpoint in $MODEL_DIR (19.5 GB, with the real-vocabulary tokenizer), unless
#      it is there already
#   2. `lily bench --model $MODEL_DIR --contexts 4096` ($CONTEXT): the batch-1 numbers the lone stream is held to
#   3. scripts/serve_bench.py: `lily serve` on that checkpoint, streams at concurrency 1,4,8,16,32,64 through
#      the openai client, 4K-token prompts, 256 tokens each: aggregate and per-stream tok/s, TTFT p50/p99, the
#      lone stream against step 2, GPU memory against the --gpu-memory-fraction budget
#      ($OUT/serve-bench-h200.json; draw it elsewhere with `python3 scripts/serve_bench.py --plot-only FILE`)
# Carry .whl/server (scripts/server_wheels.sh). Usage (repo root): scripts/gpu_serve_bench.sh [serve_bench args]
#   SKIP=bench scripts/gpu_serve_bench.sh --concurrency 1,8,32      (no step 2, three levels)
#   BUDGET_S=470 (the whole call's seconds: the load benchmark skips the levels that would start later)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lily-serve-bench}
MODEL_DIR=${MODEL_DIR:-/tmp/lily-full}
SKIP=${SKIP:-}
BUDGET_S=${BUDGET_S:-470}
CONTEXT=${CONTEXT:-4096}   # the bench's context: the load benchmark's --prompt-tokens (4096 by default)
mkdir -p "$OUT"
# shellcheck source=scripts/server_wheels.sh
. scripts/server_wheels.sh
export LILY_GIT_REVISION=${LILY_GIT_REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/nvidia-smi.txt" || true
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
stamp() { echo "[gpu_serve_bench +$(elapsed)s] $*" >&2; }
RC_MAKE=0; RC_LOAD=0; RC_BENCH=0
if [ ! -f "$MODEL_DIR/config.json" ]; then
  stamp "1/3 the full-size synthetic checkpoint in $MODEL_DIR"
  timeout 240 python3 -m lily make-synthetic --preset full --device cuda "$MODEL_DIR" > "$OUT/make.log" 2>&1
  RC_MAKE=$?; tail -n 2 "$OUT/make.log"
fi
BENCH_ARGS=()
if [[ ",$SKIP," != *",bench,"* ]] && [ $RC_MAKE = 0 ]; then
  stamp "2/3 lily bench at $CONTEXT (batch 1)"
  timeout 150 python3 -m lily bench --model "$MODEL_DIR" --contexts "$CONTEXT" --rounds 2 --no-plot \
    --out "$OUT/bench-$CONTEXT.json" > "$OUT/bench-$CONTEXT.log" 2>&1; RC_BENCH=$?
  tail -n 3 "$OUT/bench-$CONTEXT.log"
  [ -f "$OUT/bench-$CONTEXT.json" ] && BENCH_ARGS=(--batch1-bench "$OUT/bench-$CONTEXT.json")
fi
LEFT=$(( BUDGET_S - $(elapsed) ))
if [ $RC_MAKE = 0 ] && [ $LEFT -ge 120 ]; then
  stamp "3/3 load benchmark through lily serve (${LEFT}s left)"
  # (levels start only while there is time: the server's start-up, the warm-up and the largest level fit after)
  timeout "$LEFT" python3 scripts/serve_bench.py --model "$MODEL_DIR" --json "$OUT/serve-bench-h200.json" \
    --time-budget $(( LEFT - 60 )) ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} "$@" 2>&1 | tee "$OUT/serve-bench.log" | grep -v "^\s*$" | tail -n 20
  RC_LOAD=${PIPESTATUS[0]}
else
  RC_LOAD=1; stamp "no load benchmark (checkpoint rc $RC_MAKE, ${LEFT}s left)"
fi
stamp "done"
ok() { [ "$1" = 0 ] && echo OK || echo "FAILED (rc $1)"; }
echo "== summary: checkpoint $(ok $RC_MAKE), bench $([[ ",$SKIP," == *",bench,"* ]] && echo skipped || ok $RC_BENCH), load $(ok $RC_LOAD)"
[ $RC_MAKE = 0 ] && [ $RC_LOAD = 0 ] && [ $RC_BENCH = 0 ]
