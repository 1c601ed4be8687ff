#!/usr/bin/env bash
# The fast decode path on a real GPU: kernel checks at full shapes, fast vs reference fidelity, decode
# speed at several contexts. Writes $OUT/decode-h200.json and prints a table last.
# Usage (repo root): scripts/gpu_check.sh [extra args for scripts/gpu_decode_check.py]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
exec python3 scripts/gpu_decode_check.py "$@"
