#!/usr/bin/env bash
# Compile-checks every kernel file on its own for sm_90a and sm_120a, then all of them as the one translation
# unit build.rs compiles, warnings as errors (the CI check: `make kernels-check`).
# nvcc: $KDTREE_NVCC, else installed by tools/cuda/install-nvcc.sh into .cuda/.
# Exit 0 when all compile, 1 when one fails, 2 when nvcc cannot be had.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
nvcc="${KDTREE_NVCC:-}"
if [ -z "$nvcc" ]; then
  nvcc="$(bash "$root/tools/cuda/install-nvcc.sh")" || { echo "kernels-check: no nvcc" >&2; exit 2; }
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail=0
n=0
for f in "$root"/kernels/cuda/*.cu; do
  for arch in 90a 120a; do
    n=$((n + 1))
    if ! "$nvcc" -cubin -O3 -std=c++17 -Werror all-warnings -I "$root/kernels/cuda" \
        -gencode "arch=compute_$arch,code=sm_$arch" -o "$tmp/$(basename "$f").$arch.cubin" "$f" 2>"$tmp/err"; then
      echo "FAIL $(basename "$f") sm_$arch" >&2
      cat "$tmp/err" >&2
      fail=1
    fi
  done
done
# build.rs compiles all files as ONE translation unit: names at file scope (an `extern __shared__` array,
# a constant in an anonymous namespace) must not collide across files. Checked once, for sm_90a.
for f in "$root"/kernels/cuda/*.cu; do echo "#include \"$f\""; done > "$tmp/all.cu"
n=$((n + 1))
if ! "$nvcc" -cubin -O3 -std=c++17 -Werror all-warnings -I "$root/kernels/cuda" \
    -gencode "arch=compute_90a,code=sm_90a" -o "$tmp/all.cubin" "$tmp/all.cu" 2>"$tmp/err"; then
  echo "FAIL all kernels as one translation unit (as build.rs builds them) sm_90a" >&2
  cat "$tmp/err" >&2
  fail=1
fi
if [ $fail -ne 0 ]; then
  echo "kernels-check: failed" >&2
  exit 1
fi
echo "kernels-check: $n compiles ok ($(ls "$root"/kernels/cuda/*.cu | wc -l) files x sm_90a, sm_120a, then all as one unit), warnings as errors"
