#!/usr/bin/env bash
# `--budget auto` against fixed budgets on the GPU (issue 10 item 7), part of bench/gpu-bench.sh: the trained
# pair converted for one rank, `kdtree-run calibrate` on this GPU (the cost file it writes is printed), then
# the held-out prompts greedy with --budget auto and 4, 16, 64, 256: tok/s, acceptance length and mean budget.
# Usage: bench/auto.sh DIR OUT (DIR: staged binaries). Prints `BENCH auto ...` lines; exit 1 if a run failed.
set -uo pipefail
dir="$1" out="$2"
cd "$(dirname "$0")/.." || exit 2
w="$(mktemp -d)"
"$dir/kdtree-convert" repack models/kdtree-tiny "$w/pair1" --drafter models/kdtree-tiny/drafter --ranks 1 --quiet || exit 1
"$dir/kdtree-run" calibrate "$w/pair1" --device cuda --quiet || { echo "BENCH auto: calibrate failed"; exit 1; }
cost="$(ls "$w"/pair1/kdtree-cost-*.json | head -1)"
cp "$cost" "$out/" 2>/dev/null
python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print('BENCH auto cost model', sys.argv[1].split('/')[-1], json.dumps({k: c[k] for k in c if k != 'schema'}))" "$cost"
fail=0
for b in auto 4 16 64 256; do
  "$dir/kdtree-run" "$w/pair1" --prompts examples/heldout.jsonl --out "$w/auto-$b.jsonl" --device cuda --mode ddtree --budget $b \
    --summary "$w/auto-$b.json" --quiet || fail=1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"BENCH auto budget={sys.argv[2]}: {d.get('tokens_per_s') or 0:.0f} tok/s, acceptance length {d.get('acceptance_length')}, mean budget {d.get('mean_budget')}, {d.get('completion_tokens')} tokens\")" "$w/auto-$b.json" $b || fail=1
done
python3 - "$w" <<'PY'
import json, sys
w = sys.argv[1]
load = lambda b: {x["id"]: x.get("token_ids") for x in map(json.loads, open(f"{w}/auto-{b}.jsonl"))}
a = load("auto")
print("BENCH auto: greedy tokens identical to budget 16 on", sum(a[k] == v for k, v in load("16").items()), "of", len(a), "prompts")
PY
rm -rf "$w"
exit $fail
