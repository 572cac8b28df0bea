#!/usr/bin/env bash
# Issue 10's W4A16 comparison in one device call, from the repository root on the GPU machine: our timings
# (every staged cuda_bench* test binary with --ignored: cuda_bench first, whose w4a16_bandwidth prints the
# `BENCH w4a16` lines), the PyTorch peers (bench/peers.py: torch int4, cuBLAS bf16, the copy bandwidth), then
# ONE table last (bench/table.py: ours vs torch int4 vs cuBLAS, % of copy, the goals met or not, every failed
# part named), a markdown block ready for bench/RESULTS.md. Each part may fail alone; the table still prints.
# Needs the NVIDIA driver, the CUDA 13 libraries and python3 with torch; builds nothing (`make gpu-stage`
# builds the binaries into DIR on a machine with Rust and writes DIR/COMMIT).
# Usage: bench/gpu-bench.sh DIR (`make gpu-bench`). Full logs go to $OUT (or a temporary folder): bench-rust.log,
# peers.jsonl, peers.stderr, bench-status.tsv, w4a16-table.md, ncu-*. Exit 0 every part passed, 1 a part failed,
# 2 bad usage. KDTREE_BENCH_BUDGET (s, default 540): the whole run fits in it (each part's timeout shrinks to
# what is left, 20 s kept for the table); KDTREE_BENCH_BINS (default 'cuda_bench* cuda_k26_slice'): which binaries run;
# KDTREE_BENCH_FILTER: only the timings whose test name contains it (e.g. w4a16_bandwidth); KDTREE_BENCH_LONGCTX
# (default '1024 4096 16384 32768 131072'): the prompt lengths of bench/long-context.sh's table, printed last.
set -uo pipefail
dir="${1:?usage: bench/gpu-bench.sh DIR-with-staged-binaries (make gpu-stage)}"
dir="$(cd "$dir" 2>/dev/null && pwd)" || { echo "gpu-bench: $1 is not a folder (run make gpu-stage first)" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out" || exit 2
rust="$out/bench-rust.log" peers="$out/peers.jsonl" perr="$out/peers.stderr" status="$out/bench-status.tsv"
: > "$rust"; : > "$peers"; : > "$perr"; : > "$status"
budget="${KDTREE_BENCH_BUDGET:-540}"
command -v timeout >/dev/null || timeout() { shift; "$@"; } # no coreutils timeout: run unbounded
export KDTREE_REQUIRE_GPU=1
. "$root/bench/cuda-libs.sh" # the CUDA 13 library folders, when the loader does not find libcublas
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
echo "gpu: ${gpu:-unknown} ($(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1))"
echo "commit: $(cat "$dir/COMMIT" 2>/dev/null || echo "unknown (no $dir/COMMIT: stage with make gpu-stage)")"
echo "logs: $out"
left() { # seconds a part may take: what the budget has left, 20 s kept for the table, at most $1
  local l=$((budget - SECONDS - 20))
  [ "$l" -gt "$1" ] && l=$1
  echo $((l > 1 ? l : 1))
}
part() { # NAME RC: record a part's exit code (124: it ran out of its time)
  printf '%s\t%s\n' "$1" "$2" >> "$status"
  [ "$2" -eq 0 ] || fail=1
}
fail=0
run_bin() { # one staged test binary, its ignored (timing) tests one at a time, from the repository root
  local b="$1" name t
  name="$(basename "$b")"
  t="$(left 300)"
  echo "== $name --ignored (timings, at most $t s)" | tee -a "$rust"
  (cd "$root" && timeout "$t" "$b" --ignored --nocapture --test-threads=1 ${KDTREE_BENCH_FILTER:-}) >> "$rust" 2>&1
  local rc=$?
  part "$name" "$rc"
  echo "$name: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out)'), $(grep -c '^BENCH' "$rust") BENCH lines in the log so far"
}
shopt -s nullglob
bins=()
read -r -a pats <<< "${KDTREE_BENCH_BINS:-cuda_bench* cuda_k26_slice}" # no globbing here: the patterns are for $dir
for pat in "${pats[@]}"; do
  for b in "$dir"/$pat; do
    [ -f "$b" ] && [ -x "$b" ] && [ "$(basename "$b")" != cuda_bench ] && bins+=("$b")
  done
done
if [ -x "$dir/cuda_bench" ]; then run_bin "$dir/cuda_bench"; else echo "gpu-bench: no $dir/cuda_bench" | tee -a "$rust"; part cuda_bench 2; fi
t="$(left 300)"
echo "== bench/peers.py (torch int4, cuBLAS bf16, copy; at most $t s)"
timeout "$t" python3 "$root/bench/peers.py" > "$peers" 2> "$perr"
rc=$?
part peers.py "$rc"
echo "peers.py: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out)'), $(grep -c . "$peers") lines, $(grep -c '"error"' "$peers") with an error"
grep '^peers: .*Error' "$perr" | head -8 | cut -c1-300
for b in "${bins[@]}"; do run_bin "$b"; done
if [ -x "$dir/kdtree-run" ] && [ "$(left 300)" -gt 60 ]; then
  echo "== bench/auto.sh (--budget auto against fixed budgets, trained pair)"
  timeout "$(left 200)" bash "$root/bench/auto.sh" "$dir" "$out" 2>> "$out/auto.stderr" | tee -a "$rust"
  part auto.sh "${PIPESTATUS[0]}"
fi
longctx="$out/long-context.txt"
if [ -x "$dir/kdtree-run" ] && [ "$(left 300)" -gt 90 ]; then
  read -r -a lens <<< "${KDTREE_BENCH_LONGCTX:-1024 4096 16384 32768 131072}"
  echo "== bench/long-context.sh ${lens[*]} (TTFT, AR step, DDTree b16 / b64 rounds on the K2.6 TP8 rank-0 slice)"
  timeout "$(left 240)" bash "$root/bench/long-context.sh" "$dir" "${lens[@]}" > "$longctx" 2>&1
  part long-context.sh "$?"
  grep '^LONGCTX' "$longctx" | tee -a "$rust"
fi
if [ -x "$dir/cuda_bench" ] && [ "$(left 300)" -gt 60 ]; then
  echo "== bench/ncu.sh (busy fraction of a captured step and round; ddtree_build and W4A16 profiles)"
  bash "$root/bench/ncu.sh" "$dir" "$out" "$rust" 2>> "$out/ncu.stderr" | tee -a "$rust"
fi
grep -E 'panicked|^test .* FAILED' "$rust" | head -8 | cut -c1-300
echo
python3 "$root/bench/table.py" --rust "$rust" --peers "$peers" --status "$status" --commit-file "$dir/COMMIT" \
  ${gpu:+--gpu "$gpu"} --md-out "$out/w4a16-table.md"
[ $? -eq 0 ] || { echo "gpu-bench: bench/table.py failed (logs in $out)"; fail=1; }
# The long-context table (issue 27) after the W4A16 one.
[ -s "$longctx" ] && { echo; sed -n '/^Long context/,$p' "$longctx"; }
# The device tool returns at most 8 files: everything in one archive too.
tar -C "$out" -czf "$out/bench-all.tgz" --exclude bench-all.tgz . 2>/dev/null
exit $fail
