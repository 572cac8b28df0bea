#!/usr/bin/env bash
# DDTree acceptance of the trained pair on the CPU backend, per tree budget, on the held-out prompts
# (examples/heldout.jsonl, made by tools/train/train.py from held-out stdlib files), greedy; plus plain AR.
#
#   tools/train/bench_acceptance.sh [OUT_DIR]      (default out/bench-acceptance; `make bench-acceptance`)
#
# Prints a markdown table (acceptance length = tokens committed per verify step incl. the bonus token,
# tools/kdtree-run/README.md) for all prompts and for the prompts whose source is not an encodings/ codec
# table (those are near-copies of each other and inflate acceptance). Summaries and JSONL stay in OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-out/bench-acceptance}"
BIN="${CARGO_TARGET_DIR:-target}/release"
BUDGETS="${BUDGETS:-1 4 16 64 256}"
mkdir -p "$OUT"
if [ ! -f "$OUT/model/manifest.toml" ]; then
    "$BIN/kdtree-convert" repack models/kdtree-tiny "$OUT/model" --drafter models/kdtree-tiny/drafter --quiet
fi
for b in $BUDGETS; do
    [ -f "$OUT/b$b.summary.json" ] && continue
    s=$(date +%s)
    "$BIN/kdtree-run" "$OUT/model" --prompts examples/heldout.jsonl --out "$OUT/b$b.jsonl" --budget "$b" \
        --summary "$OUT/b$b.summary.json" --device cpu --quiet
    echo "budget $b: $(( $(date +%s) - s )) s" >&2
done
[ -f "$OUT/ar.summary.json" ] || "$BIN/kdtree-run" "$OUT/model" --prompts examples/heldout.jsonl --out "$OUT/ar.jsonl" \
    --mode ar --summary "$OUT/ar.summary.json" --device cpu --quiet
python3 - "$OUT" $BUDGETS <<'PY'
import json, sys
out, budgets = sys.argv[1], sys.argv[2:]
src = json.load(open("tools/train/eval.json"))["heldout_prompt_sources"]
def agg(path, keep):
    acc = steps = toks = 0
    for line in open(path):
        r = json.loads(line)
        if r["status"] != "ok" or not keep(r["id"]):
            continue
        acc += r["spec"]["accepted"]; steps += r["spec"]["verify_steps"]; toks += r["usage"]["completion_tokens"]
    return (acc + steps) / steps, toks, steps
code = lambda i: not src[i].startswith("encodings/")
n_all, n_code = len(src), sum(map(code, src))
ar = json.load(open(f"{out}/ar.summary.json"))
print(f"| budget | acceptance length, all {n_all} prompts | acceptance rate | verify steps | reach depth 1 / 2 / 3 / 7 | acceptance length, {n_code} non-codec prompts | CPU tok/s |")
print("|---|---|---|---|---|---|---|")
for b in budgets:
    s = json.load(open(f"{out}/b{b}.summary.json"))
    d = s["acceptance_per_depth"]
    reach = " / ".join(f"{d[k]:.3f}" for k in (0, 1, 2, 6))
    lc, _, _ = agg(f"{out}/b{b}.jsonl", code)
    print(f"| {b} | **{s['acceptance_length']:.3f}** | {s['acceptance_rate']:.3f} | {s['verify_steps']} | {reach} | {lc:.3f} | {s['tokens_per_s']:.1f} |")
print(f"| AR | 1 (by definition) | – | {ar['completion_tokens']} | – | 1 | {ar['tokens_per_s']:.1f} |")
ids = lambda path: [json.loads(l).get("token_ids") for l in open(path)]
same = all(ids(f"{out}/b{b}.jsonl") == ids(f"{out}/ar.jsonl") for b in budgets)
print(f"\ngreedy DDTree tokens identical to AR on every prompt and budget: {'yes' if same else 'NO'}")
sys.exit(0 if same else 1)
PY
