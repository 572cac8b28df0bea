#!/usr/bin/env bash
# A/B of the engine's switches (docs/design/options.md) on the K2.6 TP8 rank-0 slice, on the GPU machine: for each
# setting (a space-separated list of VAR=VALUE, or `-` for the defaults) the slice's AR step, feed round (budget 0)
# and DDTree rounds (`cuda_k26_slice`: 40 steps after 4, the median) and, with KDTREE_AB_LONGCTX set (prompt lengths), the
# long-context figures (bench/long-context.sh: TTFT, AR step, b16 / b64 rounds). One table last, a row a setting.
# Usage: bench/ab.sh DIR SETTING... (DIR: the staged .dev-gpu/), e.g.
#   bench/ab.sh .dev-gpu - KDTREE_W4A16_BLOCKS_PER_SM=3 'KDTREE_MLA_PREFILL_P1=1 KDTREE_PDL=0'
# Full logs to $OUT (or a temporary folder). Exit 0 every run answered, 1 one failed, 2 bad usage.
set -uo pipefail
dir="${1:?usage: bench/ab.sh DIR SETTING... (a setting: VAR=VALUE ..., or - for the defaults)}"
shift
[ $# -gt 0 ] || { echo "ab: no settings (give - for the defaults)" >&2; exit 2; }
[ -x "$dir/cuda_k26_slice" ] || { echo "ab: no $dir/cuda_k26_slice (run make gpu-stage)" >&2; exit 2; }
for setting in "$@"; do
  [ "$setting" = - ] && continue
  for kv in $setting; do
    [[ "$kv" =~ ^KDTREE_[A-Z0-9_]+=[^[:space:]]*$ ]] || { echo "ab: '$kv' is not KDTREE_VAR=VALUE" >&2; exit 2; }
  done
done
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out" || exit 2
. "$root/scripts/gpu-env.sh"
status=0 rows=() i=0
median() { grep -oE "BENCH k26r0 $1: median [0-9.]+" "$2" | awk '{print $NF}'; }
for setting in "$@"; do
  i=$((i + 1))
  envs=()
  [ "$setting" = - ] || read -r -a envs <<< "$setting"
  log="$out/ab-$i.txt"
  echo "== setting $i: ${setting} (log $log)"
  env "${envs[@]}" "$dir/cuda_k26_slice" --ignored --nocapture > "$log" 2>&1 || status=1
  row="| ${setting} | $(median ar_step "$log") | $(median 'feed_round budget=0' "$log") | $(median 'ddtree_round budget=16' "$log") | $(median 'ddtree_round budget=64' "$log") | $(median 'ddtree_round budget=256' "$log") |"
  if [ -n "${KDTREE_AB_LONGCTX:-}" ]; then
    read -r -a lens <<< "$KDTREE_AB_LONGCTX"
    env "${envs[@]}" bash "$root/bench/long-context.sh" "$dir" "${lens[@]}" > "$out/ab-$i-longctx.txt" 2>&1 || status=1
    row+=" $(grep '^LONGCTX' "$out/ab-$i-longctx.txt" | sed -E 's/.*ctx=([0-9]+) ttft_ms=([0-9.-]+) ar_step_ms=([0-9.-]+) ddtree_b16_round_ms=([0-9.-]+) ddtree_b64_round_ms=([0-9.-]+).*/\1: \2 \/ \3 \/ \4 \/ \5/' | paste -sd ';' -) |"
  fi
  rows+=("$row")
done
echo
echo "A/B on the K2.6 TP8 rank-0 slice, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), commit $(cat "$dir/COMMIT" 2>/dev/null || echo unknown)"
head="| setting | AR step ms | feed round ms | b16 round ms | b64 round ms | b256 round ms |"
sep="|---|---|---|---|---|---|"
[ -n "${KDTREE_AB_LONGCTX:-}" ] && head+=" long context (tokens: TTFT ms / AR step / b16 / b64 round ms) |" && sep+="---|"
echo "$head"; echo "$sep"
printf '%s\n' "${rows[@]}"
exit $status
