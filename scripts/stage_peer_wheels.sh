#!/usr/bin/env bash
# Here (a machine with PyPI access): download the peers' wheels into the git-ignored folders .whl/ and
# .mlxcuda/, for scripts/gpu_bench.sh to install on the GPU machine (which has no network).
# The mlx-cuda-13 wheel (~90 MB) is over one device call's 64 MiB carry, so it is split in two parts:
# call 1 stashes part_aa on the machine, call 2 carries part_ab + .whl and runs the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}          # the GPU machine's python (cp tag of the mlx wheel)
PLATFORM=${PLATFORM:-manylinux_2_35_x86_64}

rm -rf .whl .mlxcuda && mkdir -p .whl .mlxcuda
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform "$PLATFORM" -d .whl mlx==0.32.4 mlx-lm==0.32.2 fla-core==0.6.0 flash-linear-attention==0.6.0 einops
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --platform "$PLATFORM" -d "$tmp" mlx-cuda-13==0.32.4
whl=$(ls "$tmp"/mlx_cuda_13-*.whl)
basename "$whl" > .mlxcuda/NAME
sha256sum "$whl" | cut -d' ' -f1 > .mlxcuda/SHA256
split -b 46000000 "$whl" .mlxcuda/part_
rm -rf "$tmp"
{ git check-ignore -q .whl && git check-ignore -q .mlxcuda; } || echo "warning: .whl/ or .mlxcuda/ is not git-ignored" >&2
ls -l .whl .mlxcuda
cat <<'TXT'

Staged. On the GPU machine (device tool), two calls back to back (the machine keeps /root while warm):
  call 1: carry [".mlxcuda/part_aa"]                          command: scripts/gpu_bench.sh stash
  call 2: carry [".mlxcuda/part_ab", ".mlxcuda/NAME", ".mlxcuda/SHA256", ".whl"]
                                                              command: scripts/gpu_bench.sh
Without the wheels gpu_bench.sh still runs lily alone and marks the peers as skipped.
TXT
