#!/usr/bin/env bash
# Cross-check the CPU reference (kdtree-golden, full logits for 32 greedy steps) against transformers'
# DeepseekV3ForCausalLM in float32 on synthetic checkpoints. `make crosscheck` runs this.
#
# usage: crosscheck/run.sh [PRESET...]        (default: tiny small)
# env:   OUT (default out) -> work files in $OUT/crosscheck/<preset>/, reports in .../report.json
#        SEED (default 0), STEPS (default 32), THRESHOLD (default 1e-4, on rel_step)
# Exit 1 when any preset is over the threshold or its greedy tokens differ.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=crosscheck/.venv-crosscheck
WORK="${OUT:-out}/crosscheck"
SEED="${SEED:-0}"
STEPS="${STEPS:-32}"
THRESHOLD="${THRESHOLD:-1e-4}"
BIN="${CARGO_TARGET_DIR:-target}/release"
if [ "$#" -gt 0 ]; then presets=("$@"); else presets=(tiny small); fi

# 1. Python side: a venv with pinned CPU torch + transformers (reinstalled when requirements change)
if [ ! -x "$VENV/bin/python" ] || ! cmp -s crosscheck/requirements.txt "$VENV/.installed-requirements"; then
    echo "== creating $VENV (torch, transformers from PyPI)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r crosscheck/requirements.txt
    cp crosscheck/requirements.txt "$VENV/.installed-requirements"
fi
PY="$VENV/bin/python"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

# 2. Python self-test: INT4 unpacking, transformers mapping vs numpy k26-format §4
echo "== crosscheck self-test"
"$PY" crosscheck/test_crosscheck.py

# 3. Rust side
echo "== building kdtree-convert, kdtree-golden"
cargo build --release --locked -p kdtree-convert -p kdtree-golden

status=0
for p in "${presets[@]}"; do
    d="$WORK/$p"
    echo "== preset $p (seed $SEED, $STEPS steps)"
    rm -rf "$d" && mkdir -p "$d"
    "$BIN/kdtree-convert" synth "$p" "$d/hf" --drafter --seed "$SEED" >/dev/null
    "$BIN/kdtree-convert" repack "$d/hf" "$d/model" --drafter "$d/hf/drafter" >/dev/null
    "$BIN/kdtree-golden" "$d/model" --prompts crosscheck/prompts.jsonl --out "$d/golden" \
        --max-tokens "$STEPS" --full-logits-steps "$STEPS" --no-ddtree --quiet
    if ! "$PY" crosscheck/crosscheck.py compare --model "$d/hf" --bundle "$d/golden" \
        --prompts crosscheck/prompts.jsonl --steps "$STEPS" --threshold "$THRESHOLD" --report "$d/report.json"; then
        status=1
    fi
done
exit $status
