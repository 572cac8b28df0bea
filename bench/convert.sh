#!/usr/bin/env bash
# Repack throughput vs plain `cp -r` on the same disk, and repack's peak RSS.
# Synthesizes a K2.6-width checkpoint (default: bench/k26-bench.toml, 1 dense + 1 MoE layer of 192 experts, ~10.6 GB) into
# $DATA (outside the repo), drops the page cache before each timed step when allowed, times
# `cp -r src copy && sync` against `kdtree-convert repack src out --ranks 8 && sync`, then deletes everything.
# Goal (bench/RESULTS.md): repack >= 0.8x cp throughput, peak RSS <= 1 GiB.
# Usage: bench/convert.sh            env: DATA PRESET LAYERS RANKS EXPERTS ROUNDS BIN BASE KEEP=1 (keep the data)
# Reports the best of ROUNDS alternating cp/repack runs, each round's ratio, and repack's CPU seconds.
# BASE=path/to/older/kdtree-convert also times that binary in every round (same input, same alternation),
# so a change is measured against its parent under the same machine load (other work shares the CPU).
# The machine load (1-minute average) is printed before each timed step: a ratio under load is a floor.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DATA:-/work/bench-data}
PRESET=${PRESET:-bench/k26-bench.toml}
LAYERS=${LAYERS:-2}
RANKS=${RANKS:-8}
EXPERTS=${EXPERTS:-tp}
ROUNDS=${ROUNDS:-2}
TARGET=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$TARGET/release/kdtree-convert}
TIME=/usr/bin/time
[ -x "$TIME" ] || { echo "need /usr/bin/time (apt-get install time)" >&2; exit 2; }
[ -x "$BIN" ] || cargo build --release -p kdtree-convert
case "$DATA" in "$PWD"*) echo "DATA must be outside the repo" >&2; exit 2;; esac

drop_caches() {
  sync
  if (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then echo "page cache dropped"; DROPPED=yes; else echo "cannot drop the page cache"; DROPPED=no; fi
}
field() { grep "$1" "$2" | head -1 | awk -F': ' '{print $2}'; }
secs() { # "Elapsed (wall clock) time (h:mm:ss or m:ss): 1:02.34" -> seconds
  local t; t=$(field "Elapsed (wall clock)" "$1"); awk -v t="$t" 'BEGIN{n=split(t,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; print s}'
}

rm -rf "$DATA"; mkdir -p "$DATA"
trap '[ "${KEEP:-0}" = 1 ] || rm -rf "$DATA"' EXIT
echo "== synth $PRESET --layers $LAYERS -> $DATA/src"
$TIME -v "$BIN" synth "$PRESET" "$DATA/src" --layers "$LAYERS" --seed 0 2> "$DATA/synth.time" >/dev/null || { cat "$DATA/synth.time"; exit 1; }
sync
BYTES=$(du -sb "$DATA/src" | cut -f1)
echo "source bytes: $BYTES ($(awk -v b="$BYTES" 'BEGIN{printf "%.2f GiB", b/2^30}')), synth $(secs "$DATA/synth.time") s"

cpu_s() { awk -F': ' '/User time|System time/{s+=$2} END{print s}' "$1"; }
best() { sort -n | head -1; }
CPS=(); RPS=(); RSS=0; CPU=(); BPS=(); BCPU=()
BASE=${BASE:-}
for round in $(seq 1 "$ROUNDS"); do  # alternate cp and repack so machine load hits both alike
  echo "== round $round: cp -r (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  drop_caches
  $TIME -v bash -c "cp -r '$DATA/src' '$DATA/cp' && sync" 2> "$DATA/cp.time"
  CPS+=("$(secs "$DATA/cp.time")"); rm -rf "$DATA/cp"
  echo "== round $round: repack --ranks $RANKS --experts $EXPERTS (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  drop_caches
  $TIME -v bash -c "'$BIN' repack '$DATA/src' '$DATA/out' --ranks $RANKS --experts $EXPERTS --quiet && sync" 2> "$DATA/repack.time" \
    || { cat "$DATA/repack.time"; exit 1; }
  RPS+=("$(secs "$DATA/repack.time")"); CPU+=("$(cpu_s "$DATA/repack.time")")
  r=$(field "Maximum resident set size" "$DATA/repack.time"); [ "$r" -gt "$RSS" ] && RSS=$r
  OUT_BYTES=$(du -sb "$DATA/out" | cut -f1); rm -rf "$DATA/out"   # free the disk before the next cp
  echo "   cp ${CPS[-1]} s, repack ${RPS[-1]} s (cpu ${CPU[-1]} s), ratio $(awk -v c="${CPS[-1]}" -v r="${RPS[-1]}" 'BEGIN{printf "%.2f", c/r}')"
  if [ -n "$BASE" ]; then
    echo "== round $round: BASE repack $BASE (load: $(cut -d' ' -f1-3 /proc/loadavg))"
    drop_caches
    $TIME -v bash -c "'$BASE' repack '$DATA/src' '$DATA/out' --ranks $RANKS --experts $EXPERTS --quiet && sync" 2> "$DATA/base.time" \
      || { cat "$DATA/base.time"; exit 1; }
    BPS+=("$(secs "$DATA/base.time")"); BCPU+=("$(cpu_s "$DATA/base.time")"); rm -rf "$DATA/out"
    echo "   base repack ${BPS[-1]} s (cpu ${BCPU[-1]} s), ratio $(awk -v c="${CPS[-1]}" -v r="${BPS[-1]}" 'BEGIN{printf "%.2f", c/r}')"
  fi
done
CP_S=$(printf '%s\n' "${CPS[@]}" | best); RP_S=$(printf '%s\n' "${RPS[@]}" | best)
RP_CPU=$(printf '%s\n' "${CPU[@]}" | best)

awk -v b="$BYTES" -v c="$CP_S" -v r="$RP_S" -v rss="$RSS" -v ob="$OUT_BYTES" -v d="$DROPPED" -v cpu="$RP_CPU" -v n="$(nproc)" 'BEGIN{
  printf "cp (best of rounds):     %.1f s  %.0f MB/s\n", c, b/c/1e6;
  printf "repack (best of rounds): %.1f s  %.0f MB/s  (output %.2f GiB), cpu %.1f s = %.1f s on %d idle cores\n", r, b/r/1e6, ob/2^30, cpu, cpu/n, n;
  printf "ratio repack/cp throughput: %.2f   peak RSS: %.0f MiB   page cache dropped: %s\n", c/r, rss/1024, d }'
if [ -n "$BASE" ]; then
  B_S=$(printf '%s\n' "${BPS[@]}" | best); B_CPU=$(printf '%s\n' "${BCPU[@]}" | best)
  awk -v c="$CP_S" -v r="$B_S" -v cpu="$B_CPU" 'BEGIN{printf "base repack (best):      %.1f s, cpu %.1f s, ratio %.2f\n", r, cpu, c/r}'
fi
echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty tree)')  date: $(date -u +%FT%TZ)"
