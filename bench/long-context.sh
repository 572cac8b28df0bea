#!/usr/bin/env bash
# The long-context table (issue 27): on the GPU machine, the TP8 rank-0 slice of the full 61-layer K2.6 from dummy
# weights (`kdtree-run --load-format dummy --ranks 8 --rank 0`), one prompt of seeded random token ids per length,
# 16 tokens greedy: time to first token, the AR step, and the DDTree round at budget 16 (random drafter: its
# acceptance means nothing, the round's cost does). Each run answers a 1,024-token warm-up prompt first, so the
# figures are a warm process's (kernels loaded, cuBLAS's heuristics for most shapes chosen), as a server's are; the
# figures of bench/GPU-RESULTS.md runs <= 80 were the process's first prompt. Prints one `LONGCTX` line per
# length and a table last.
# Usage: bench/long-context.sh DIR [LENGTH...] (DIR: the staged .dev-gpu/; lengths default 1024 4096 16384 32768).
# Exit 0 when every run answered, 1 when one failed, 2 on bad usage.
set -uo pipefail
dir="${1:?usage: bench/long-context.sh DIR [LENGTH...]}"
shift
lens=("$@")
[ ${#lens[@]} -gt 0 ] || lens=(1024 4096 16384 32768)
for n in "${lens[@]}"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "long-context: length '$n' is not a positive integer" >&2; exit 2; }
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$dir/kdtree-convert" synth k26 "$tmp/k26cfg" --drafter --config-only --quiet || exit 1
commit="$(cat "$dir/COMMIT" 2>/dev/null || echo unknown)"
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
status=0
rows=()
for n in "${lens[@]}"; do
  # Token ids below V / 8 (the rank's vocab shard of dummy weights), seeded by the length.
  python3 -c 'import json, random, sys
n = int(sys.argv[1]); r = random.Random(n)
w = random.Random(1)
print(json.dumps({"id": "warmup", "prompt_token_ids": [w.randrange(20480) for _ in range(1024)]}))
print(json.dumps({"id": f"ctx{n}", "prompt_token_ids": [r.randrange(20480) for _ in range(n)]}))' "$n" > "$tmp/p$n.jsonl"
  line="$n"
  for mode in ar ddtree; do
    extra=()
    [ "$mode" = ddtree ] && extra=(--budget 16)
    if "$dir/kdtree-run" "$tmp/k26cfg" --load-format dummy --ranks 8 --rank 0 --device cuda --mode "$mode" "${extra[@]}" \
        --max-tokens 16 --prompts "$tmp/p$n.jsonl" --out "$tmp/o-$mode-$n.jsonl" --quiet 2> "$tmp/err"; then
      # AR: decode time per generated token after the first; DDTree: per verify round.
      line+=" $(python3 -c 'import json, sys
r = next(r for r in map(json.loads, open(sys.argv[1])) if r["id"] == sys.argv[3])
t = r["timing"]; n = len(r["token_ids"])
steps = r["spec"]["verify_steps"] if sys.argv[2] == "ddtree" else n - 1
print("%.1f %.2f" % (t["ttft_ms"], t["decode_ms"] / max(steps, 1)))' "$tmp/o-$mode-$n.jsonl" "$mode" "ctx$n")"
    else
      echo "long-context: $mode at $n tokens failed:" >&2
      tail -5 "$tmp/err" >&2
      line+=" - -"
      status=1
    fi
  done
  # n ttft_ar step_ar ttft_dd round_dd
  set -- $line
  echo "LONGCTX ctx=$1 ttft_ms=$2 ar_step_ms=$3 ddtree_b16_round_ms=$5 gpu=\"$gpu\" commit=$commit"
  rows+=("| $1 | $2 | $3 | $5 |")
done
echo
echo "Long context, K2.6 TP8 rank-0 slice (dummy weights), $gpu, commit $commit"
echo "| prompt tokens | TTFT ms (warm) | AR step ms | DDTree b16 round ms |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
