#!/usr/bin/env bash
# The benchmark matrix on a machine with an NVIDIA GPU, from the repo root: `lily bench --synthetic full`
# over lily's whole context matrix, with fidelity, load/memory and the peers (MLX-LM on CUDA,
# transformers + flash-linear-attention) in the same run. Results and logs go to $OUT; the short table
# is printed last. A peer that is not installed is skipped (and the skip noted in the JSON).
#
# The peers come from PyPI:   python3 -m pip install -e '.[bench,peers]'
# Without internet on the GPU machine: run scripts/stage_peer_wheels.sh on a machine that has it, copy
# the .whl/ folder it fills into this checkout, and this script installs the peers from there.
#
# Knobs (environment): BACKEND (fast), CONTEXTS (256 ... 128K), PEER_CONTEXTS (256,4096),
# LILY_BUDGET (seconds for lily's matrix, 120), TOTAL (seconds for everything, 540), NAME (bench-h200-DATE),
# WHEELS (.whl), LILY_ENV_FILE (a file of VAR=value settings to run with, e.g. from scripts/gpu_decode_ab.sh),
# PEERS (which of the installed peers run: mlx,hf), PEER_BUDGETS (e.g. mlx=420: --peer-time-budget);
# for a smoke test on a CPU box: DEVICE=cpu SYNTH=tiny BACKEND=reference CONTEXTS=16,32 PEER_CONTEXTS=16.
#
# A slow peer as a separate invocation (MLX-LM on CUDA prefills ~280 tok/s: its rows may not fit the time a
# whole run has left): first `PEERS=hf scripts/gpu_bench.sh`, then, on the same machine,
#   MERGE_INTO=$OUT/<NAME>.json PEERS=mlx PEER_BUDGETS=mlx=480 scripts/gpu_bench.sh
# runs only that peer, under the first run's contract, and adds its rows to that JSON (and PNG), noted.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-/tmp/lily-bench-out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}

PEERS_WANTED=${PEERS:-}   # (the PEERS array below holds the installed ones)
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

# settings chosen by measurement (e.g. LILY_PDL from scripts/gpu_decode_ab.sh), recorded in the JSON
if [ -n "${LILY_ENV_FILE:-}" ] && [ -f "$LILY_ENV_FILE" ]; then
  set -a; . "$LILY_ENV_FILE"; set +a
  NOTES+=(--note "environment from $LILY_ENV_FILE: $(tr '\n' ' ' < "$LILY_ENV_FILE")")
fi

# -- the peers: installed already, or from the wheels in $WHEELS (scripts/stage_peer_wheels.sh) ---------
install_wheels() {  # the named packages' wheels from $WHEELS, without their dependencies
  local files=()
  for pkg in "$@"; do files+=("$WHEELS"/"$pkg"-*.whl); done
  ls "${files[@]}" > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps "${files[@]}" >> "$LOG" 2>&1
}
PEERS=()
if ! python3 -c "import mlx.core as mx, mlx_lm; assert mx.cuda.is_available()" >> "$LOG" 2>&1; then
  install_wheels mlx mlx_cuda_13 mlx_lm
fi
if python3 -c "import mlx.core as mx, mlx_lm; assert mx.cuda.is_available()" >> "$LOG" 2>&1; then
  PEERS+=(mlx)
else
  skip "mlx peer skipped: mlx with CUDA and mlx-lm are not installed (pip install -e '.[peers]')"
fi
if ! python3 -c "import fla" >> "$LOG" 2>&1; then
  python3 -c "import einops" 2>/dev/null || install_wheels einops
  install_wheels fla_core flash_linear_attention
fi
if python3 -c "import transformers, fla; from transformers import Qwen3_5MoeForCausalLM" >> "$LOG" 2>&1; then
  PEERS+=(hf)
else
  skip "hf peer skipped: transformers with Qwen3_5MoeForCausalLM, or flash-linear-attention, is not installed (pip install -e '.[peers]')"
fi

# transformers first: it is quick, and the MLX peer (slow on CUDA) then gets all the time that is left
if [ -n "${PEERS_WANTED:-}" ]; then   # only the peers named in $PEERS (of those installed)
  KEEP=()
  for p in "${PEERS[@]}"; do [[ ",$PEERS_WANTED," == *",$p,"* ]] && KEEP+=("$p"); done
  PEERS=("${KEEP[@]}")
fi
PEER_LIST=$(printf '%s\n' "${PEERS[@]}" | sort | paste -sd, -)
ELAPSED=$(( $(date +%s) - START ))
DEADLINE=$(( TOTAL - ELAPSED ))
say "peers: ${PEER_LIST:-none}; lily backend $BACKEND; ${DEADLINE} s left for the bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${MERGE_INTO:-}" ]; then   # the peers alone, their rows added to an earlier run's JSON
  [ -n "$PEER_LIST" ] || { say "MERGE_INTO: no peer to run"; exit 1; }
  python3 -m lily bench --synthetic "$SYNTH" --device "$DEVICE" --peers "$PEER_LIST" \
    ${PEER_BUDGETS:+--peer-time-budget "$PEER_BUDGETS"} --checkpoint-dir /tmp/lily-synth-full \
    --deadline "$DEADLINE" --merge-into "$MERGE_INTO" > "$OUT/merge.stdout.txt" 2> "$OUT/merge.stderr.log"
  RC=$?
  rm -rf /tmp/lily-synth-full
  say "lily bench --merge-into exit $RC after $(( $(date +%s) - START )) s"
  echo "---- stderr tail ----"; tail -n 12 "$OUT/merge.stderr.log"
  echo "---- table ----"; cat "$OUT/merge.stdout.txt"
  exit $RC
fi
python3 -m lily bench --synthetic "$SYNTH" --device "$DEVICE" --backend "$BACKEND" --contexts "$CONTEXTS" \
  --decode-steps 64 --rounds 2 --retries 1 --time-budget "$LILY_BUDGET" \
  ${PEER_LIST:+--peers "$PEER_LIST"} --peer-contexts "$PEER_CONTEXTS" ${PEER_BUDGETS:+--peer-time-budget "$PEER_BUDGETS"} \
  --fidelity --memory --memory-max-seq "${MEMORY_MAX_SEQ:-4K,32K,128K}" --checkpoint-dir /tmp/lily-synth-full \
  --deadline "$DEADLINE" "${NOTES[@]}" --out "$OUT/$NAME.json" > "$OUT/bench.stdout.txt" 2> "$OUT/bench.stderr.log"
RC=$?
rm -rf /tmp/lily-synth-full
say "lily bench exit $RC after $(( $(date +%s) - START )) s; outputs in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo "---- stderr tail ----"; tail -n 12 "$OUT/bench.stderr.log"
echo "---- table ----"; cat "$OUT/bench.stdout.txt"
exit $RC
