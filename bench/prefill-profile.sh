#!/usr/bin/env bash
# Where a long prefill's time goes: on the GPU machine, the TP8 rank-0 slice of the 61-layer K2.6 from dummy
# weights (as bench/long-context.sh), one prompt of N random ids, --max-tokens 1, under Nsight Compute: the first
# 2,600 kernels (the dummy-weight fills, then about 19 layers of the prefill) each timed alone
# (gpu__time_duration, clocks and caches as in the run), summed by kernel name, largest first.
# Usage: bench/prefill-profile.sh DIR OUT [N...] (DIR: the staged .dev-gpu/; N default 4096 16384). Set
# KDTREE_MLA_EXPANDED_MIN_ROWS as for the run. Exit 0 when every profile ran, 1 when one failed, 2 on bad usage.
set -uo pipefail
dir="${1:?usage: bench/prefill-profile.sh DIR OUT [N...]}"
out="${2:?usage: bench/prefill-profile.sh DIR OUT [N...]}"
shift 2
lens=("$@")
[ ${#lens[@]} -gt 0 ] || lens=(4096 16384)
for n in "${lens[@]}"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "prefill-profile: length '$n' is not a positive integer" >&2; exit 2; }
done
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)"
[ -n "$ncu" ] || { echo "prefill-profile: ncu not found" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$dir/kdtree-convert" synth k26 "$tmp/cfg" --drafter --config-only --quiet || exit 1
status=0
for n in "${lens[@]}"; do
  python3 -c 'import json, random, sys
n = int(sys.argv[1]); r = random.Random(n)
print(json.dumps({"id": f"p{n}", "prompt_token_ids": [r.randrange(20480) for _ in range(n)]}))' "$n" > "$tmp/p$n.jsonl"
  timeout 250 "$ncu" --clock-control none --cache-control none --launch-count 2600 --metrics gpu__time_duration.sum \
    --csv --print-units base "$dir/kdtree-run" "$tmp/cfg" --load-format dummy --ranks 8 --rank 0 --device cuda \
    --mode ar --max-tokens 1 --prompts "$tmp/p$n.jsonl" --out "$tmp/o.jsonl" --quiet > "$out/prefill-$n.csv" 2> "$out/prefill-$n.err" ||
    { echo "prefill-profile: ncu at $n tokens failed (see $out/prefill-$n.err)" >&2; status=1; continue; }
  python3 - "$out/prefill-$n.csv" "$n" <<'PY'
import collections, csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
tot, cnt = collections.defaultdict(float), collections.Counter()
for r in rows:
    k = r["Kernel Name"].split("(")[0][:70]
    tot[k] += float(r["Metric Value"].replace(",", ""))
    cnt[k] += 1
print(f"\n## prompt {sys.argv[2]} tokens: {sum(tot.values()) / 1e6:.1f} ms over {len(rows)} kernels")
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{v / 1e6:9.3f} ms {cnt[k]:6d} {k}")
PY
done
exit $status
