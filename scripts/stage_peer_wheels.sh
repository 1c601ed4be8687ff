#!/usr/bin/env bash
# On a machine with internet, for a GPU machine without it: download the benchmark peers' wheels (MLX-LM
# with MLX's CUDA 13 build; transformers' fast path flash-linear-attention) into .whl/ (git-ignored).
# Copy .whl/ into the GPU machine's checkout; scripts/gpu_bench.sh installs the peers from it (and
# scripts/gpu_structured_overhead.sh lily's grammar engine, llguidance, when it is missing). Their own
# dependencies (numpy, transformers, ...) come with `pip install -e '.[test]'` on that machine.
# With internet on the GPU machine, skip this: python3 -m pip install -e '.[bench,peers]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}          # the GPU machine's python (the cp tag of the wheels)
PLATFORM=${PLATFORM:-manylinux_2_35_x86_64}

rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform "$PLATFORM" -d .whl mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 fla-core==0.6.0 \
  flash-linear-attention==0.6.0 einops llguidance==1.9.1
git check-ignore -q .whl || echo "warning: .whl/ is not git-ignored" >&2
ls -l .whl
