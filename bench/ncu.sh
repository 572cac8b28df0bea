#!/usr/bin/env bash
# Nsight Compute figures for issue 10, part of bench/gpu-bench.sh: (1) the GPU's busy fraction in a captured
# AR step and DDTree round of the trained pair: one replay of each graph between cuProfilerStart/Stop
# (cuda_bench step_busy with KDTREE_PROFILE=ar|dd16|dd64), every kernel node timed alone
# (gpu__time_duration), their sum over the replay time that cuda_bench printed; (2) where two kernels spend
# their time (ddtree_build at the tree-stage bench, the W4A16 M=1 GEMM on 4096x7168): Speed of Light,
# memory, warp-state and occupancy sections, kept as text in $OUT. Usage: bench/ncu.sh DIR OUT RUST_LOG.
# Prints `BENCH ncu ...` lines; exit 0 (ncu missing or refused is said, not an error of the bench).
set -uo pipefail
dir="$1" out="$2" rust="$3"
cd "$(dirname "$0")/.." || exit 0
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)"
[ -n "$ncu" ] || { echo "BENCH ncu: not installed, skipped"; exit 0; }
for tag in ar dd16 dd64; do
  # Clocks and caches as in the unprofiled run (ncu would lock base clocks and flush caches per kernel).
  KDTREE_PROFILE=$tag timeout 240 "$ncu" --profile-from-start off --graph-profiling node --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum \
    --csv --print-units base "$dir/cuda_bench" --ignored --nocapture --exact step_busy > "$out/ncu-busy-$tag.csv" 2> "$out/ncu-busy-$tag.err"
  echo "ncu step_busy $tag: exit $? ($(grep -c gpu__time_duration "$out/ncu-busy-$tag.csv") kernels)" >&2
done
# The k26 rank-0 slice: one AR step and one budget-16 round, every kernel node alone (cuda_k26_slice).
if [ -x "$dir/cuda_k26_slice" ]; then
  for tag in k26ar k26dd16; do
    KDTREE_PROFILE=$tag timeout 300 "$ncu" --profile-from-start off --graph-profiling node --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --print-units base "$dir/cuda_k26_slice" --ignored --nocapture > "$out/ncu-busy-$tag.csv" 2> "$out/ncu-busy-$tag.err"
    echo "ncu k26 $tag: exit $? ($(grep -c gpu__time_duration "$out/ncu-busy-$tag.csv") kernels)" >&2
  done
fi
python3 - "$out" "$rust" <<'PY'
import csv, re, sys
out, rust = sys.argv[1:3]
replay = {}
for l in open(rust, errors="replace"):
    m = re.search(r"BENCH step_busy (\w+): replay ([\d.]+) us", l)
    if m:
        replay[m.group(1)] = float(m.group(2))
    m = re.search(r"BENCH k26r0 (ar_step|ddtree_round budget=16): median ([\d.]+) ms", l)
    if m:
        replay["k26ar" if m.group(1) == "ar_step" else "k26dd16"] = float(m.group(2)) * 1e3
for tag in ("ar", "dd16", "dd64", "k26ar", "k26dd16"):
    try:
        lines = open(f"{out}/ncu-busy-{tag}.csv", errors="replace").readlines()
    except OSError:
        continue
    rows = [r for r in csv.reader(l for l in lines if l.startswith('"'))
            if len(r) > 3 and r[-3] == "gpu__time_duration.sum"]
    if not rows:
        err = open(f"{out}/ncu-busy-{tag}.err", errors="replace").read().strip().splitlines()
        print(f"BENCH ncu step_busy {tag}: no kernel measured ({(err or ['no message'])[-1][:200]})")
        continue
    ns = [float(r[-1].replace(",", "")) for r in rows]
    busy = sum(ns) / 1e3
    top, count = {}, {}
    for r, v in zip(rows, ns):
        name = re.sub(r"\(.*", "", r[4])[:48]
        top[name] = top.get(name, 0.0) + v / 1e3
        count[name] = count.get(name, 0) + 1
    top = [(f"{n} x{count[n]}", v) for n, v in sorted(top.items(), key=lambda x: -x[1])[:12 if tag.startswith("k26") else 6]]
    rep = replay.get(tag)
    frac = f", busy {100 * busy / rep:.0f}% of the {rep:.1f} us replay (idle or launch gaps {100 * (1 - busy / rep):.0f}%)" if rep else ""
    print(f"BENCH ncu step_busy {tag}: {len(ns)} kernels, {busy:.1f} us summed alone{frac}; largest: "
          + ", ".join(f"{n} {v:.1f} us" for n, v in top))
PY
sec="--clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
timeout 120 "$ncu" --kernel-name regex:ddtree_build --launch-skip 2 --launch-count 1 $sec \
  "$dir/cuda_bench" --ignored --nocapture --exact ddtree_tree_stages > "$out/ncu-ddtree-build.txt" 2>&1
echo "BENCH ncu ddtree_build: exit $?, report in ncu-ddtree-build.txt: $(grep -E 'Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per' "$out/ncu-ddtree-build.txt" | tr -s ' ' | tr '\n' ';' | cut -c1-400)"
timeout 120 "$ncu" --kernel-name regex:w4a16_gemm_i4g32_m1 --launch-skip 12 --launch-count 1 $sec \
  "$dir/cuda_bench" --ignored --nocapture --exact w4a16_bandwidth > "$out/ncu-w4a16-m1.txt" 2>&1
echo "BENCH ncu w4a16_m1: exit $?, report in ncu-w4a16-m1.txt: $(grep -E 'Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size' "$out/ncu-w4a16-m1.txt" | tr -s ' ' | tr '\n' ';' | cut -c1-400)"
exit 0
