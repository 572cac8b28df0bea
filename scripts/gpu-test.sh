#!/usr/bin/env bash
# The GPU suite: runs the prebuilt CUDA test binaries in DIR (cuda_ops, cuda_gemm, cuda_mla, cuda_bench; built on a
# machine with Rust by `cargo test -p kdtree-engine --features cuda --release --no-run` and copied there
# without their hash suffix), parity first (KDTREE_REQUIRE_GPU=1: no GPU is a failure), then timings, and
# prints a short table last. Needs only the NVIDIA driver and the CUDA 13 libraries (libcublas) on the
# GPU machine; builds nothing. Usage: scripts/gpu-test.sh DIR [LOG]. Exit 0 all passed, 1 a test failed.
# On the build machine, `scripts/gpu-test.sh --stage DIR` builds the binaries (nvcc from
# tools/cuda/install-nvcc.sh), strips them and copies them, the fatbin and this script into DIR.
set -uo pipefail
if [ "${1:-}" = "--stage" ]; then
  dest="${2:?usage: scripts/gpu-test.sh --stage DIR}"
  root="$(cd "$(dirname "$0")/.." && pwd)"
  KDTREE_NVCC="${KDTREE_NVCC:-$(bash "$root/tools/cuda/install-nvcc.sh")}" || exit 2
  export KDTREE_NVCC
  mkdir -p "$dest"
  (cd "$root" && cargo test -p kdtree-engine --features cuda --release --locked --no-run --message-format=json) |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("cuda_"):
        print(m["target"]["name"], m["executable"])' |
    while read -r name exe; do strip -o "$dest/$name" "$exe" || exit 2; done
  cp "$0" "$dest/gpu-test.sh"
  cp "$(ls -t "$root"/target/release/build/kdtree-kernels-*/out/kdtree_kernels.fatbin | head -1)" "$dest/"
  ls -l "$dest" >&2
  exit 0
fi
dir="${1:?usage: scripts/gpu-test.sh DIR-with-test-binaries [LOG]}"
log="${2:-$(mktemp)}"
export KDTREE_REQUIRE_GPU=1
# cudarc dlopens libcuda and libcublas by name: add the usual CUDA 13 library folders when not found.
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
      $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cublas")))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
status=0
for t in cuda_ops cuda_gemm cuda_mla; do
  echo "== $t (parity)"
  "$dir/$t" --nocapture 2>&1 | tee -a "$log" | grep -E "^(PARITY|test |test result|thread|  left|  right|SKIP)|panicked"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "== cuda_bench (timings)"
"$dir/cuda_bench" --ignored --nocapture --test-threads=1 2>&1 | tee -a "$log" | grep -E "^(BENCH|test result)|panicked"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo
echo "== summary"
printf '%-100s %s\n' "parity case" "rel (tol)"
grep '^PARITY' "$log" | sed -E 's/^PARITY (.*) max_abs=([^ ]+) rel=([^ ]+) tol=([^ ]+)$/\1|\3 (\4)/; s/^PARITY (.*) exact(.*)$/\1|exact\2/' | awk -F'|' '{printf "%-100s %s\n", $1, $2}'
grep '^BENCH' "$log" | sed 's/^BENCH //'
echo "verdict: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
