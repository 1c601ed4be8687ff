#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: install the staged peer wheels, run
# `lily bench --synthetic full` with lily's whole context matrix, fidelity, load/memory and the peers
# (MLX-LM on CUDA, transformers + flash-linear-attention) in the same run, all within one call.
# Results and logs go to $OUT; the short table is printed last. A peer whose wheels are absent is skipped.
#
#   scripts/stage_peer_wheels.sh            (here, once: downloads into .whl/ and .mlxcuda/)
#   call 1: carry [".mlxcuda/part_aa"]                                   run: scripts/gpu_bench.sh stash
#   call 2: carry [".mlxcuda/part_ab", ".mlxcuda/NAME", ".mlxcuda/SHA256", ".whl"]   run: scripts/gpu_bench.sh
#
# Knobs (environment): BACKEND (fast), CONTEXTS (256 ... 128K), PEER_CONTEXTS (256,4096),
# LILY_BUDGET (seconds for lily's matrix, 120), TOTAL (seconds for everything, 540), NAME (bench-h200-DATE);
# for a smoke test on a CPU box: DEVICE=cpu SYNTH=tiny BACKEND=reference CONTEXTS=16,32 PEER_CONTEXTS=16.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-/tmp/lily-bench-out}
mkdir -p "$OUT"
STASH=/root/stash

if [ "${1:-}" = "stash" ]; then                     # call 1: keep the first half of the mlx-cuda wheel
  mkdir -p "$STASH" && cp .mlxcuda/part_a? "$STASH"/ && ls -l "$STASH" | tee "$OUT/stash.log"
  exit 0
fi

BACKEND=${BACKEND:-fast}
DEVICE=${DEVICE:-cuda}
SYNTH=${SYNTH:-full}
CONTEXTS=${CONTEXTS:-256,512,1K,2K,4K,8K,16K,32K,64K,128K}
PEER_CONTEXTS=${PEER_CONTEXTS:-256,4096}
LILY_BUDGET=${LILY_BUDGET:-120}
TOTAL=${TOTAL:-540}
NAME=${NAME:-bench-h200-$(date -u +%Y%m%d-%H%M)}
LOG="$OUT/gpu_bench.log"
NOTES=()
say() { echo "[gpu_bench] $*" | tee -a "$LOG" >&2; }
skip() { say "$*"; NOTES+=(--note "$*"); }   # also recorded in the JSON and printed with the table

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >> "$LOG" 2>&1
python3 -c "import torch, triton, safetensors; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$LOG" 2>&1 \
  || { say "torch/triton/safetensors missing on this machine"; exit 1; }

# settings an earlier call on this machine chose by measurement (e.g. LILY_PDL), recorded in the JSON
if [ -f "$STASH/lily_env" ]; then
  set -a; . "$STASH/lily_env"; set +a
  NOTES+=(--note "environment from an A/B run earlier on this machine: $(tr '\n' ' ' < "$STASH/lily_env")")
fi

PEERS=()
# -- MLX-LM on CUDA: join the two halves of the mlx-cuda-13 wheel --------------------------------------
PART_AA=$(ls "$STASH"/part_aa .mlxcuda/part_aa 2>/dev/null | head -n 1)   # stashed by call 1, or carried
if [ -n "$PART_AA" ] && [ -f .mlxcuda/part_ab ] && ls .whl/mlx-*.whl .whl/mlx_lm-*.whl >/dev/null 2>&1; then
  WHL=/tmp/$(cat .mlxcuda/NAME 2>/dev/null || echo mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl)
  cat "$PART_AA" .mlxcuda/part_ab > "$WHL"
  if [ -f .mlxcuda/SHA256 ] && [ "$(sha256sum "$WHL" | cut -d' ' -f1)" != "$(cat .mlxcuda/SHA256)" ]; then
    skip "mlx peer skipped: the joined mlx-cuda wheel's sha256 does not match"
  elif python3 -m pip install -q --no-index --no-deps "$WHL" .whl/mlx-*.whl .whl/mlx_lm-*.whl >> "$LOG" 2>&1 \
       && python3 -c "import mlx.core as mx, mlx_lm; assert mx.cuda.is_available()" >> "$LOG" 2>&1; then
    PEERS+=(mlx)
  else
    skip "mlx peer skipped: the mlx wheels did not install or see no CUDA (see $LOG)"
  fi
else
  skip "mlx peer skipped: wheels absent (need $STASH/part_aa from call 1, .mlxcuda/part_ab and .whl/)"
fi
# -- transformers + flash-linear-attention ---------------------------------------------------------------
if ls .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >/dev/null 2>&1; then
  python3 -c "import einops" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/einops-*.whl >> "$LOG" 2>&1
  python3 -m pip install -q --no-index --no-deps .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >> "$LOG" 2>&1
fi
if python3 -c "import transformers, fla; from transformers import Qwen3_5MoeForCausalLM" >> "$LOG" 2>&1; then
  PEERS+=(hf)
else
  skip "hf peer skipped: transformers with Qwen3_5MoeForCausalLM, or flash-linear-attention, is not importable"
fi

PEER_LIST=$(IFS=,; echo "${PEERS[*]:-}")
ELAPSED=$(( $(date +%s) - START ))
DEADLINE=$(( TOTAL - ELAPSED ))
say "peers: ${PEER_LIST:-none}; lily backend $BACKEND; ${DEADLINE} s left for the bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m lily bench --synthetic "$SYNTH" --device "$DEVICE" --backend "$BACKEND" --contexts "$CONTEXTS" \
  --decode-steps 64 --rounds 2 --retries 1 --time-budget "$LILY_BUDGET" \
  ${PEER_LIST:+--peers "$PEER_LIST"} --peer-contexts "$PEER_CONTEXTS" \
  --fidelity --memory --memory-max-seq "${MEMORY_MAX_SEQ:-4K,32K,128K}" --checkpoint-dir /tmp/lily-synth-full \
  --deadline "$DEADLINE" "${NOTES[@]}" --out "$OUT/$NAME.json" > "$OUT/bench.stdout.txt" 2> "$OUT/bench.stderr.log"
RC=$?
rm -rf /tmp/lily-synth-full
say "lily bench exit $RC after $(( $(date +%s) - START )) s; outputs in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo "---- stderr tail ----"; tail -n 12 "$OUT/bench.stderr.log"
echo "---- table ----"; cat "$OUT/bench.stdout.txt"
exit $RC
