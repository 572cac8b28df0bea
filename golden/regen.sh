#!/usr/bin/env bash
# Regenerate the committed golden bundles (tiny preset + drafter), or check them byte for byte.
#
#   golden/regen.sh           synth tiny -> repack -> kdtree-golden -> replace golden/index.json + *.safetensors
#   golden/regen.sh --check   the same into a temp dir, twice (RAYON_NUM_THREADS=1 and =2); fail (exit 1) on
#                             any byte difference from each other or from what is committed
#
# `make golden` / `make golden-check` call this. Settings below are the ones golden/README.md documents.
set -euo pipefail
cd "$(dirname "$0")/.."

PRESET=tiny
SEED=0
GOLDEN_ARGS=(--max-tokens 16 --full-logits-steps 4 --topk 8 --budget 8 --trace-step 1)
BIN="${CARGO_TARGET_DIR:-target}/release"

check=0
case "${1:-}" in
    "") ;;
    --check) check=1 ;;
    *) echo "usage: golden/regen.sh [--check]" >&2; exit 2 ;;
esac

cargo build --release --locked -p kdtree-convert -p kdtree-golden
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$BIN/kdtree-convert" synth "$PRESET" "$work/hf" --drafter --seed "$SEED" >/dev/null
"$BIN/kdtree-convert" repack "$work/hf" "$work/model" --drafter "$work/hf/drafter" >/dev/null

# bundle files of a dir: index.json + every *.safetensors, sorted
files_of() { (cd "$1" && ls index.json *.safetensors 2>/dev/null | LC_ALL=C sort); }

same_dirs() { # same_dirs A B: identical file lists and bytes
    local a="$1" b="$2" ok=0
    if [ "$(files_of "$a")" != "$(files_of "$b")" ]; then
        echo "golden: file lists differ: $a: [$(files_of "$a" | tr '\n' ' ')] vs $b: [$(files_of "$b" | tr '\n' ' ')]" >&2
        return 1
    fi
    for f in $(files_of "$a"); do
        cmp "$a/$f" "$b/$f" >&2 || ok=1
    done
    return $ok
}

if [ $check -eq 0 ]; then
    "$BIN/kdtree-golden" "$work/model" --prompts golden/prompts.jsonl --out "$work/golden" "${GOLDEN_ARGS[@]}"
    rm -f golden/index.json golden/*.safetensors
    cp "$work/golden/index.json" "$work/golden/"*.safetensors golden/
    echo "golden: wrote $(files_of golden | wc -l) files ($(du -cb golden/index.json golden/*.safetensors | tail -1 | cut -f1) bytes) to golden/"
    exit 0
fi

for t in 1 2; do
    RAYON_NUM_THREADS=$t "$BIN/kdtree-golden" "$work/model" --prompts golden/prompts.jsonl --out "$work/golden-t$t" \
        "${GOLDEN_ARGS[@]}" --quiet
done
status=0
same_dirs "$work/golden-t1" "$work/golden-t2" || { echo "golden-check: output differs between RAYON_NUM_THREADS=1 and 2" >&2; status=1; }
same_dirs golden "$work/golden-t1" || { echo "golden-check: rebuilt bundles differ from the committed golden/ (run make golden on purpose if the change is intended)" >&2; status=1; }
[ $status -eq 0 ] && echo "golden-check: OK ($(files_of golden | wc -l) files identical, threads 1 and 2)"
exit $status
