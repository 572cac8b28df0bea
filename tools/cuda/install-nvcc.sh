#!/usr/bin/env bash
# Installs a CUDA 13.0 nvcc from PyPI wheels into a local folder (default .cuda/ at the repo root, git-ignored)
# and prints the nvcc path on stdout (logs go to stderr). Idempotent: a finished install is reused.
# Used by kernels/check.sh (CI compile check) and by `cargo build --features cuda` (via KDTREE_NVCC or PATH).
# Needs python3 + pip and PyPI; no root, no system CUDA.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.cuda}"
ver="13.0.*"
nvcc="$dest/nvidia/cu13/bin/nvcc"
if [ -x "$nvcc" ] && [ -f "$dest/.complete" ]; then
  echo "$nvcc"
  exit 0
fi
echo "installing nvcc ($ver) into $dest" >&2
rm -rf "$dest.partial"
python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --target "$dest.partial" \
  "nvidia-cuda-nvcc==$ver" "nvidia-cuda-cccl==$ver" "nvidia-cuda-crt==$ver" "nvidia-nvvm==$ver" \
  "nvidia-cuda-runtime==$ver" >&2
rm -rf "$dest"
mv "$dest.partial" "$dest"
if [ ! -x "$nvcc" ]; then
  found="$(find "$dest" -name nvcc -type f | head -1)"
  echo "error: nvcc not at $nvcc after install (found: ${found:-nothing})" >&2
  exit 2
fi
touch "$dest/.complete"
echo "$nvcc"
