#!/usr/bin/env bash
# Regenerate the committed golden bundles, or check them byte for byte. Two sets:
#   golden/              synthetic tiny preset + drafter (synth tiny --drafter --seed 0), prompts golden/prompts.jsonl
#   golden/kdtree-tiny/  the trained pair models/kdtree-tiny (+ drafter/), prompts golden/kdtree-tiny/prompts.jsonl
#   golden/k26-gate/     with KDTREE_GOLDEN_K26=1 only (~35 GB of disk, minutes of CPU): the real-width model
#                        manifests/presets/k26-gate.toml (synth --seed 1 --drafter, --ranks 1), flags in its FLAGS file;
#                        scripts/gpu-test-k26.sh rebuilds and compares it on every run of the real-width gate
#   golden/k26-long/     with KDTREE_GOLDEN_K26=1 only: the same model, one prompt of 3,200 tokens (the prefill's
#                        large-M grouped GEMM at 67 rows an expert), flags in its FLAGS file
#
#   golden/regen.sh           convert -> kdtree-golden -> replace each set's index.json + *.safetensors
#   golden/regen.sh --check   the same into a temp dir, twice (RAYON_NUM_THREADS=1 and =2); fail (exit 1) on
#                             any byte difference from each other or from what is committed
#
# `make golden` / `make golden-check` call this. Settings below are the ones golden/README.md documents.
set -euo pipefail
cd "$(dirname "$0")/.."

SEED=0
SYNTH_ARGS=(--max-tokens 16 --full-logits-steps 4 --topk 8 --budget 8 --trace-step 1)
PAIR_ARGS=(--max-tokens 16 --full-logits-steps 2 --topk 8 --budget 8 --trace-step 1)
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

"$BIN/kdtree-convert" synth tiny "$work/hf" --drafter --seed "$SEED" >/dev/null
"$BIN/kdtree-convert" repack "$work/hf" "$work/model" --drafter "$work/hf/drafter" >/dev/null
"$BIN/kdtree-convert" repack models/kdtree-tiny "$work/pair" --drafter models/kdtree-tiny/drafter >/dev/null

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

# set NAME MODEL DEST ARGS...: regenerate (or check) one bundle set
status=0
run_set() {
    local name="$1" model="$2" dest="$3"
    shift 3
    if [ $check -eq 0 ]; then
        "$BIN/kdtree-golden" "$model" --prompts "$dest/prompts.jsonl" --out "$work/golden-$name" "$@"
        rm -f "$dest/index.json" "$dest"/*.safetensors
        cp "$work/golden-$name/index.json" "$work/golden-$name/"*.safetensors "$dest/"
        echo "golden: wrote $(files_of "$dest" | wc -l) files ($(cd "$dest" && du -cb $(files_of .) | tail -1 | cut -f1) bytes) to $dest/"
        return 0
    fi
    for t in 1 2; do
        RAYON_NUM_THREADS=$t "$BIN/kdtree-golden" "$model" --prompts "$dest/prompts.jsonl" --out "$work/golden-$name-t$t" \
            "$@" --quiet
    done
    local ok=0
    same_dirs "$work/golden-$name-t1" "$work/golden-$name-t2" || { echo "golden-check [$name]: output differs between RAYON_NUM_THREADS=1 and 2" >&2; ok=1; }
    same_dirs "$dest" "$work/golden-$name-t1" || { echo "golden-check [$name]: rebuilt bundles differ from the committed $dest/ (run make golden on purpose if the change is intended)" >&2; ok=1; }
    [ $ok -eq 0 ] && echo "golden-check [$name]: OK ($(files_of "$dest" | wc -l) files identical, threads 1 and 2)"
    [ $ok -eq 0 ] || status=1
}

run_set synth-tiny "$work/model" golden "${SYNTH_ARGS[@]}"
run_set kdtree-tiny "$work/pair" golden/kdtree-tiny "${PAIR_ARGS[@]}"
if [ "${KDTREE_GOLDEN_K26:-0}" = 1 ]; then
    "$BIN/kdtree-convert" synth manifests/presets/k26-gate.toml "$work/k26-hf" --drafter --seed 1 --quiet
    "$BIN/kdtree-convert" repack "$work/k26-hf" "$work/k26" --drafter "$work/k26-hf/drafter" --ranks 1 --quiet
    rm -rf "$work/k26-hf"
    # shellcheck disable=SC2046 # the flags file holds several words
    run_set k26-gate "$work/k26" golden/k26-gate $(cat golden/k26-gate/FLAGS)
    # shellcheck disable=SC2046
    [ -f golden/k26-long/prompts.jsonl ] && run_set k26-long "$work/k26" golden/k26-long $(cat golden/k26-long/FLAGS)
fi
exit $status
