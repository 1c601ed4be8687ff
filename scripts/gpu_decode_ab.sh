#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: decode tok/s at 4K and 128K with each set of programmatic kernel families
# (LILY_PDL values, ';'-separated in MODES; lily/kernels/pdl.py), their graphs replayed in alternating rounds
# in one process; the fastest at 4K is written to $OUT/lily_env. Run scripts/gpu_bench.sh with
# LILY_ENV_FILE=$OUT/lily_env to use it (the bench notes it in its JSON). Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lily-ab-out}
MODES=${MODES:-"0;gate_up;gdn,gdn_out,gate_up;gdn,gdn_out,gate_up,down;all"}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="$OUT" python3 scripts/gpu_decode_check.py --skip kernels,fidelity,tune --contexts 4096,131072 \
  --pdl-modes "$MODES" > "$OUT/pdl_ab.log" 2>&1
grep "  pdl " "$OUT/pdl_ab.log"
python3 - "$OUT" <<'PY'
import json, sys
rows = json.load(open(f"{sys.argv[1]}/decode-h200.json"))["pdl"]["rows"]["4096"]
best = max(rows, key=lambda m: rows[m]["tok_per_s"])
open(f"{sys.argv[1]}/lily_env", "w").write(f"LILY_PDL={best}\n")
print(f"chosen: LILY_PDL={best} ({rows[best]['tok_per_s']:.1f} tok/s at 4K)")
PY
