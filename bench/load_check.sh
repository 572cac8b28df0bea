#!/usr/bin/env bash
# The load check's cost on the CPU backend (issue 29 item 2): kdtree-run on one synthetic model with the check
# (the default) and with --no-check-weights, one line of one prompt token and one generated token (`--mode ar`),
# so each run is the process start, the load and one forward; ROUNDS alternating runs each, page cache warm
# (a first untimed run of each), medians. Also one cold-cache run of each when run as root (drop_caches).
#   bench/load_check.sh [PRESET [SYNTH FLAGS...]]     e.g. bench/load_check.sh small --drafter
# ROUNDS (5), CPU=1 (user + sys CPU seconds instead of wall time), BIN, ON / OFF (the flags) from the environment.
# Prints a Markdown table for bench/RESULTS.md. Needs release binaries (`make build`).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-${CARGO_TARGET_DIR:-target}/release}"
# The flags that turn the check on and off (a build from before the check was default: ON=--check-weights OFF=).
ON="${ON-}"
OFF="${OFF---no-check-weights}"
ROUNDS="${ROUNDS:-5}"
preset="${1:-small}"
shift || true
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$BIN/kdtree-convert" synth "$preset" "$work/hf" --quiet "$@" >/dev/null
drafter=()
[ -d "$work/hf/drafter" ] && drafter=(--drafter "$work/hf/drafter")
"$BIN/kdtree-convert" repack "$work/hf" "$work/model" --ranks 1 "${drafter[@]}" --quiet
bytes=$(du -sb "$work/model" | cut -f1)
echo '{"id":"a","prompt_token_ids":[1],"max_tokens":1}' > "$work/p.jsonl"

run() { # run FLAGS...: wall seconds of one run (CPU=1: user + sys seconds instead, steadier on a busy machine)
    local t0 t1 cpu
    t0=$(date +%s.%N)
    cpu=$( { /usr/bin/time -f '%U %S' "$BIN/kdtree-run" "$work/model" --prompts "$work/p.jsonl" \
        --out "$work/o.jsonl" --device cpu --mode ar --quiet "$@" 2>&1 >/dev/null; } | tail -1)
    t1=$(date +%s.%N)
    if [ "${CPU:-0}" = 1 ]; then
        echo "$cpu" | awk '{print $1 + $2}'
    else
        echo "$t1 - $t0" | bc -l
    fi
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

cold_on="" cold_off=""
if [ -w /proc/sys/vm/drop_caches ]; then
    sync; echo 3 > /proc/sys/vm/drop_caches; cold_on=$(run $ON)
    sync; echo 3 > /proc/sys/vm/drop_caches; cold_off=$(run $OFF)
fi
run $ON >/dev/null; run $OFF >/dev/null
on=() off=()
for _ in $(seq "$ROUNDS"); do
    on+=("$(run $ON)")
    off+=("$(run $OFF)")
done
m_on=$(printf '%s\n' "${on[@]}" | median)
m_off=$(printf '%s\n' "${off[@]}" | median)
echo "| model | bytes | runs | without the check | with the check | cost |"
echo "|---|---|---|---|---|---|"
printf '| %s %s | %s | %s warm | %.3f s | %.3f s | %+.3f s (%+.1f %%) |\n' "$preset" "$*" "$bytes" "$ROUNDS" \
    "$m_off" "$m_on" "$(echo "$m_on - $m_off" | bc -l)" "$(echo "100 * ($m_on - $m_off) / $m_off" | bc -l)"
if [ -n "$cold_on" ]; then
    printf '| %s %s | %s | 1 cold | %.3f s | %.3f s | %+.3f s |\n' "$preset" "$*" "$bytes" "$cold_off" "$cold_on" \
        "$(echo "$cold_on - $cold_off" | bc -l)"
fi
echo "warm runs with the check: ${on[*]}" >&2
echo "warm runs without: ${off[*]}" >&2
