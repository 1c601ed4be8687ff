#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: decode tok/s at 4K with each PDL mode (LILY_PDL=0 and =moe), and the
# faster one written to $OUT/lily_env; run scripts/gpu_bench.sh with LILY_ENV_FILE=$OUT/lily_env to use it
# (the bench notes it in its JSON). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lily-ab-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
best=0; best_mode=0
for mode in 0 moe; do
  LILY_PDL=$mode OUT="$OUT/ab_$mode" python3 scripts/gpu_decode_check.py --skip kernels,fidelity,tune \
    --contexts 4096 > "$OUT/ab_$mode.log" 2>&1
  tps=$(grep -o "ctx   4096: *[0-9.]*" "$OUT/ab_$mode.log" | head -n 1 | awk '{print $NF}')
  echo "LILY_PDL=$mode: ${tps:-failed} tok/s at 4K"
  if [ -n "$tps" ] && python3 -c "import sys; sys.exit(0 if float('$tps') > float('$best') else 1)"; then
    best=$tps; best_mode=$mode
  fi
done
echo "LILY_PDL=$best_mode" > "$OUT/lily_env"
echo "chosen: LILY_PDL=$best_mode ($best tok/s)"
