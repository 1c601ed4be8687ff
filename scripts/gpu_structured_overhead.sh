#!/usr/bin/env bash
# Structured outputs' decode overhead on a GPU: constrained (JSON schema) vs unconstrained decode tok/s at
# a 4K context on the full-size random model. Installs llguidance from .whl/ (scripts/stage_peer_wheels.sh)
# when the machine has no index to install it from. Writes $OUT/structured-overhead.json, a table last.
# Usage (repo root): scripts/gpu_structured_overhead.sh [extra args for scripts/gpu_structured_overhead.py]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import llguidance" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/llguidance-*.whl
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec python3 scripts/gpu_structured_overhead.py --json "${OUT:-.}/structured-overhead.json" "$@"
