#!/usr/bin/env bash
# The GPU suite: runs the prebuilt CUDA test binaries in DIR (cuda_ops, cuda_gemm, cuda_mla, cuda_router_error, cuda_ddtree,
# cuda_sample, cuda_drafter, cuda_target, cuda_round, cuda_bench; built on a machine with Rust by `cargo test -p kdtree-engine --features cuda --release --no-run` and copied there
# without their hash suffix), parity first (KDTREE_REQUIRE_GPU=1: no GPU is a failure), then timings, and
# prints a short table last. Needs only the NVIDIA driver and the CUDA 13 libraries (libcublas) on the
# GPU machine; builds nothing. Usage: scripts/gpu-test.sh DIR [LOG]. Exit 0 all passed, 1 a test failed.
# On the build machine, `scripts/gpu-test.sh --stage DIR` builds the binaries (nvcc from
# tools/cuda/install-nvcc.sh), strips them and copies them, the fatbin and this script into DIR, and writes
# DIR/COMMIT (the commit they were built from).
set -uo pipefail
if [ "${1:-}" = "--stage" ]; then
  dest="${2:?usage: scripts/gpu-test.sh --stage DIR}"
  root="$(cd "$(dirname "$0")/.." && pwd)"
  KDTREE_NVCC="${KDTREE_NVCC:-$(bash "$root/tools/cuda/install-nvcc.sh")}" || exit 2
  export KDTREE_NVCC
  mkdir -p "$dest"
  # No binary of an earlier stage stays behind: one that fails to build must be missing, not stale.
  rm -f "$dest"/cuda_*
  (cd "$root" && cargo test -p kdtree-engine --features cuda --release --locked --no-run --message-format=json) |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("cuda_"):
        print(m["target"]["name"], m["executable"])' |
    while read -r name exe; do strip -o "$dest/$name" "$exe" || exit 2; done ||
    { echo "gpu-stage: the CUDA test binaries did not all build (see: cargo test -p kdtree-engine --features cuda --release --no-run)" >&2; exit 2; }
  # The tools, built with the CUDA backend, for the end-to-end checks.
  (cd "$root" && cargo build --release --locked -p kdtree-convert && cargo build --release --locked --features cuda -p kdtree-run -p kdtree-golden) || exit 2
  for b in kdtree-convert kdtree-run kdtree-golden; do strip -o "$dest/$b" "$root/target/release/$b" || exit 2; done
  cp "$0" "$dest/gpu-test.sh"
  cp "$root/scripts/gpu-env.sh" "$root/scripts/gpu-test-k26.sh" "$dest/"
  # The commit these binaries were built from (+dirty: with uncommitted changes), for the results' records:
  # the GPU machine's copy of the tree has no .git (bench/gpu-bench.sh and bench/table.py print it).
  { git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown; } | tr -d '\n' > "$dest/COMMIT.tmp"
  [ -z "$(git -C "$root" status --porcelain 2>/dev/null)" ] || printf '+dirty' >> "$dest/COMMIT.tmp"
  echo >> "$dest/COMMIT.tmp" && mv "$dest/COMMIT.tmp" "$dest/COMMIT"
  cp "$(ls -t "$root"/target/release/build/kdtree-kernels-*/out/kdtree_kernels.fatbin | head -1)" "$dest/"
  ls -l "$dest" >&2
  exit 0
fi
dir="${1:?usage: scripts/gpu-test.sh DIR-with-test-binaries [LOG]}"
log="${2:-$(mktemp)}"
source "$(dirname "$0")/gpu-env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
status=0
suite_start=$(date +%s)
# KDTREE_GPU_SANITIZE: 1 (default) the whole suite; 0 everything but the compute-sanitizer runs; only: those runs
# alone (on the trained pair converted here). The device tool allows 10 minutes a call: run 0, then only.
san_mode="${KDTREE_GPU_SANITIZE:-1}"
case $san_mode in 0|1|only) ;; *) echo "KDTREE_GPU_SANITIZE=$san_mode: 0, 1 or only" >&2; exit 2;; esac
# Suites that capture CUDA graphs run their tests one at a time: the tests of one binary share the device's
# primary context, and another test's teardown (cuBLAS handle, module unload, pinned frees synchronise the
# context) invalidates a capture in flight. One process per GPU, as kdtree-run is, never meets that.
# Rank groups on one GPU (cuda_tp, kdtree-run --share-gpu) pace their launches at launch gates
# (engine/src/cuda/comm.rs), so that none fills the launch queues.
suites=(cuda_ddtree cuda_sample cuda_drafter cuda_round cuda_ops cuda_gemm cuda_mla cuda_mla_prefill cuda_mla_expanded cuda_target
  cuda_router_error cuda_comm cuda_tp)
[ "$san_mode" = only ] && suites=()
for t in "${suites[@]}"; do
  echo "== $t (parity)"
  # One test at a time where a test captures a CUDA graph or times itself. Run 117: cuda_gemm's
  # op_chain_is_graph_capturable failed at a kernel launch of its chain while the binary's other tests ran beside
  # it (it passed in the earlier suites on record; the launch's error text was filtered out, so it is now kept).
  # Suspected: the tests of one binary share the primary context, and a context-wide synchronisation from another
  # thread (cudarc's new_stream synchronises the context before a new handle's first stream: a test starting up)
  # during a capture breaks the capture.
  case $t in cuda_ddtree|cuda_round|cuda_ops|cuda_target|cuda_comm|cuda_tp|cuda_gemm) threads="--test-threads=1";; *) threads="";; esac
  # Poisoned: buffers an op should write in full start as NaN bytes (Gpu::out), so reading unwritten memory fails.
  KDTREE_CUDA_POISON=1 "$dir/$t" --nocapture $threads 2>&1 | tee -a "$log" | grep -E "^(PARITY|BOUNDARY|MEASURE|test |test result|thread|  left|  right|SKIP|called|assertion)|panicked"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
if [ "$san_mode" != only ]; then
  echo "== cuda_tp (parity, eager: the launches paced by the gates alone)"
  KDTREE_CUDA_GRAPHS=0 KDTREE_CUDA_POISON=1 "$dir/cuda_tp" --nocapture --test-threads=1 rank_groups 2>&1 | tee -a "$log" | sed -n 's/^.*\(PARITY\)/\1 eager:/p; /panicked\|test result/p'
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# The route-flip rule of the teacher-forced checks below, from this run's measurement (cuda_router_error): a token's
# experts may differ on the GPU only where the CPU's router margin is below 2 max |Δ selection score|.
flip_margin() { grep -oE "MEASURE router_score_error model=$1 .*flip_margin=[0-9.e+-]+" "$log" | tail -1 | sed 's/.*flip_margin=//'; }
m_tiny="$(flip_margin tiny-synth)"; m_pair="$(flip_margin kdtree-tiny-pair)"
echo "route-flip margins measured: tiny-synth ${m_tiny:-none}, kdtree-tiny-pair ${m_pair:-none}" | tee -a "$log"
if [ "$san_mode" != only ]; then
  [ -n "$m_tiny" ] && [ -n "$m_pair" ] || status=1
fi
if [ "$san_mode" = only ] && [ -x "$dir/kdtree-run" ]; then
  e2e="$(mktemp -d)"
  "$dir/kdtree-convert" repack models/kdtree-tiny "$e2e/pair1" --drafter models/kdtree-tiny/drafter --ranks 1 --quiet || status=1
  san_pair="$e2e/pair1"
elif [ -x "$dir/kdtree-run" ]; then
  # End to end, from the repository root: models converted for one rank here, CPU vs CUDA greedy tokens,
  # --verify against the committed CPU bundles, bundles recorded on the GPU (for measuring |Δ| against
  # the CPU elsewhere), and the trained pair on the GPU (AR and DDTree, the drafter on the GPU too).
  e2e="$(mktemp -d)"
  out="${OUT:-$e2e/out}"; mkdir -p "$out"
  echo "== end to end (kdtree-run / kdtree-golden --device cuda)"
  "$dir/kdtree-convert" synth tiny "$e2e/hf" --drafter --seed 0 --quiet &&
    "$dir/kdtree-convert" repack "$e2e/hf" "$e2e/tiny1" --drafter "$e2e/hf/drafter" --ranks 1 --quiet &&
    "$dir/kdtree-convert" repack models/kdtree-tiny "$e2e/pair1" --drafter models/kdtree-tiny/drafter --ranks 1 --quiet || status=1
  for dev in cpu cuda; do
    "$dir/kdtree-run" "$e2e/tiny1" --prompts golden/prompts.jsonl --out "$e2e/ar-$dev.jsonl" --device $dev --mode ar --max-tokens 16 --quiet || status=1
  done
  # The GPU's greedy tokens teacher-forced through the CPU reference (kdtree-golden --score): at every position the
  # CPU's logit of the GPU's token within 0.15 of the CPU's largest (2 x the measured bf16 logit error of this
  # model, 5.7e-2: tools/kdtree-run/src/verify.rs CUDA_TOLERANCES). Exact equality of the two runs is printed but
  # not required: g-mid's step 7 is a measured near-tie (top-2 margin 3.8e-3), either token is a correct bf16 pick.
  python3 - "$e2e/ar-cpu.jsonl" "$e2e/ar-cuda.jsonl" <<'PY' | tee -a "$log"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
for x, y in zip(a, b):
    same = x["token_ids"] == y["token_ids"]
    print(f"E2E greedy AR tokens {x['id']}: cpu == cuda: {same}" + ("" if same else f" cpu {x['token_ids']} cuda {y['token_ids']}"))
PY
  # Bound 0.15 (2 x the measured bf16 logit error); a larger gap, up to 4.0, only at a route flip (CPU router margin
  # below this run's measured m_tiny), the record's later positions then reported, not judged.
  if "$dir/kdtree-golden" "$e2e/tiny1" --prompts golden/prompts.jsonl --score "$e2e/ar-cuda.jsonl" --bound 0.15 \
      --route-flip "${m_tiny:-0},4.0" --out "$e2e/tiny-score.json" --quiet \
      > "$e2e/tiny-score.log" 2>&1; then
    sed 's/^kdtree-golden: /E2E synthetic tiny greedy AR on cuda, teacher-forced: /' "$e2e/tiny-score.log" | tee -a "$log"
  else
    sed 's/^kdtree-golden: /E2E synthetic tiny greedy AR on cuda, teacher-forced: FAIL /' "$e2e/tiny-score.log" | tee -a "$log"; status=1
  fi
  # --verify against the committed CPU bundles, a gate: the cuda rules are measured tolerances plus the
  # near-tie and route-flip rules of tools/kdtree-run/src/verify/rules.rs; each acceptance is printed.
  verify_gate() { # MODEL PROMPTS BUNDLE TAG
    "$dir/kdtree-run" "$e2e/$1" --prompts "$2" --out "$e2e/verify-$4.jsonl" --device cuda --check-weights=device --verify "$3" --quiet 2>&1 | tee -a "$log" | tail -40
    if [ "${PIPESTATUS[0]}" -eq 0 ]; then echo "E2E kdtree-run --device cuda --verify $3: match" | tee -a "$log"
    else echo "E2E kdtree-run --device cuda --verify $3: MISMATCH (see above)" | tee -a "$log"; status=1; fi
  }
  verify_gate tiny1 golden/prompts.jsonl golden synth
  verify_gate pair1 golden/kdtree-tiny/prompts.jsonl golden/kdtree-tiny pair
  # The same bundle through the rank-group driver (one group on its own thread and stream, the one-GPU
  # communicator inside its graphs): what --gpus N runs, against the CPU golden.
  "$dir/kdtree-run" "$e2e/pair1" --prompts golden/kdtree-tiny/prompts.jsonl --out "$e2e/verify-group.jsonl" --device cuda --check-weights=device \
    --gpus 1 --share-gpu --verify golden/kdtree-tiny --quiet 2>&1 | tee -a "$log" | tail -20
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then echo "E2E kdtree-run --gpus 1 --share-gpu --verify golden/kdtree-tiny: match" | tee -a "$log"
  else echo "E2E kdtree-run --gpus 1 --share-gpu --verify golden/kdtree-tiny: MISMATCH" | tee -a "$log"; status=1; fi
  "$dir/kdtree-golden" "$e2e/tiny1" --prompts golden/prompts.jsonl --out "$e2e/gold-cuda-synth" --device cuda --quiet \
    --max-tokens 16 --full-logits-steps 4 --topk 8 --budget 8 --trace-step 1 || status=1
  "$dir/kdtree-golden" "$e2e/pair1" --prompts golden/kdtree-tiny/prompts.jsonl --out "$e2e/gold-cuda-pair" --device cuda --quiet \
    --max-tokens 16 --full-logits-steps 2 --topk 8 --budget 8 --trace-step 1 || status=1
  tar -C "$e2e" -cf "$out/gpu-bundles.tar" gold-cuda-synth gold-cuda-pair 2>/dev/null
  # The trained pair on the held-out prompts: AR, the chain and DDTree, greedy and T = 1 (seed 1).
  for temp in 0 1; do
    for mode in ar chain ddtree16 ddtree64; do
      case $mode in ddtree*) m="--mode ddtree --budget ${mode#ddtree}";; *) m="--mode $mode";; esac
      "$dir/kdtree-run" "$e2e/pair1" --prompts examples/heldout.jsonl --out "$e2e/pair-$mode-t$temp.jsonl" --device cuda --check-weights=device $m \
        --temperature $temp --seed 1 --summary "$e2e/pair-$mode-t$temp.json" --quiet || status=1
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('E2E trained pair heldout', sys.argv[2], 'T', sys.argv[3], 'backend', d.get('backend'), 'tokens', d.get('completion_tokens'), 'tok/s', d.get('tokens_per_s'), 'acceptance_length', d.get('acceptance_length'))" "$e2e/pair-$mode-t$temp.json" $mode $temp | tee -a "$log"
    done
  done
  tar -C "$e2e" -cf "$out/pair-runs.tar" $(cd "$e2e" && ls pair-*.json pair-*.jsonl) 2>/dev/null
  # The same runs teacher-forced through the CPU reference (measured, not gated): greedy lines' gaps (the CPU's
  # largest logit minus its logit of the GPU's token), and at T = 1 how often the CPU, with the same settings and
  # the same position-keyed uniform, would sample another token (README "Sampling on two devices").
  "$dir/kdtree-golden" "$e2e/pair1" --prompts examples/heldout.jsonl --score "$e2e"/pair-*-t0.jsonl "$e2e"/pair-*-t1.jsonl \
    --bound 0.15 --route-flip "${m_pair:-0},4.0" --out "$e2e/pair-score.json" --quiet 2>&1 | sed 's/^kdtree-golden: /E2E trained pair heldout teacher-forced: /' | tee -a "$log"
  cp "$e2e/pair-score.json" "$out/" 2>/dev/null
  # R ranks side by side on this one GPU (issue 11): the trained pair converted for 2, 4, 8 ranks (tensor
  # parallel, experts split; at 4 and 8 the down projections' K is padded to the W4A16 step) and 2, 4, 8 ranks
  # (expert parallel), greedy AR and DDTree, against the 1-rank GPU run; a
  # difference is accepted only at a near-tie of the 1-rank run (its top-2 logit margin there <= 0.15,
  # recorded by kdtree-golden on the GPU), as in the k26-slice check below.
  for plan in tp2 tp4 tp8 ep2 ep4 ep8; do
    "$dir/kdtree-convert" repack models/kdtree-tiny "$e2e/pair-$plan" --drafter models/kdtree-tiny/drafter \
      --ranks "${plan#??}" --experts "${plan%?}" --quiet 2>> "$e2e/ranks.err" || { status=1; continue; }
    for mode in ar ddtree16; do
      case $mode in ddtree*) m="--mode ddtree --budget ${mode#ddtree}";; *) m="--mode $mode";; esac
      "$dir/kdtree-run" "$e2e/pair-$plan" --prompts examples/heldout.jsonl --out "$e2e/ranks-$plan-$mode.jsonl" --device cuda --check-weights=device $m \
        --summary "$e2e/ranks-$plan-$mode.json" --quiet 2>> "$e2e/ranks.err" || status=1
      # The same ranks as R groups side by side (each its own thread, stream, weights and graphs; --gpus R).
      "$dir/kdtree-run" "$e2e/pair-$plan" --prompts examples/heldout.jsonl --out "$e2e/groups-$plan-$mode.jsonl" --device cuda --check-weights=device $m \
        --gpus "${plan#??}" --share-gpu --summary "$e2e/groups-$plan-$mode.json" --quiet 2>> "$e2e/ranks.err" || status=1
    done
  done
  # 8 groups eagerly (no graphs: every sum's launch paced by the gates) in a fresh process.
  KDTREE_CUDA_GRAPHS=0 "$dir/kdtree-run" "$e2e/pair-tp8" --prompts examples/heldout.jsonl --out "$e2e/groups-eager-tp8-ddtree16.jsonl" --device cuda --check-weights=device \
    --mode ddtree --budget 16 --gpus 8 --share-gpu --summary "$e2e/groups-eager-tp8-ddtree16.json" --quiet 2>> "$e2e/ranks.err" || status=1
  # The rank groups against the CPU reference: --verify (tokens, logits, the DDTree rounds) against kdtree-golden's
  # CPU bundle of the same R-rank conversion, and against the committed 1-rank bundle golden/kdtree-tiny.
  for plan in tp2 tp4 tp8 ep2 ep4 ep8; do
    [ -d "$e2e/pair-$plan" ] || continue
    "$dir/kdtree-golden" "$e2e/pair-$plan" --prompts golden/kdtree-tiny/prompts.jsonl --out "$e2e/golden-$plan" --quiet 2>> "$e2e/ranks.err" || { status=1; continue; }
    for g in "$e2e/golden-$plan" golden/kdtree-tiny; do
      case $g in golden/*) what="the 1-rank CPU bundle $g";; *) what="kdtree-golden's CPU bundle of the $plan conversion";; esac
      if "$dir/kdtree-run" "$e2e/pair-$plan" --prompts golden/kdtree-tiny/prompts.jsonl --out "$e2e/verify-groups-$plan.jsonl" --device cuda --check-weights=device \
          --gpus "${plan#??}" --share-gpu --verify "$g" --quiet >> "$e2e/verify-groups.log" 2>&1; then
        echo "E2E groups $plan --gpus ${plan#??} --share-gpu --verify against $what: match" | tee -a "$log"
      else
        echo "E2E groups $plan --gpus ${plan#??} --share-gpu --verify against $what: MISMATCH" | tee -a "$log"; status=1
        tail -30 "$e2e/verify-groups.log" | tee -a "$log"
      fi
    done
  done
  sed 's/^/E2E ranks stderr: /' "$e2e/ranks.err" | head -20 | tee -a "$log"
  # Batched generation (issue 15): the same runs as the trained pair's above with 8 sequences in flight
  # (--max-batch 8: one batched forward per step), compared line by line with the batch-1 files below.
  for temp in 0 1; do
    for mode in ar ddtree16 ddtree64; do
      case $mode in ddtree*) m="--mode ddtree --budget ${mode#ddtree}";; *) m="--mode $mode";; esac
      "$dir/kdtree-run" "$e2e/pair1" --prompts examples/heldout.jsonl --out "$e2e/batch8-$mode-t$temp.jsonl" --device cuda --check-weights=device $m \
        --temperature $temp --seed 1 --max-batch 8 --summary "$e2e/batch8-$mode-t$temp.json" --quiet 2>> "$e2e/batch.err" || status=1
    done
  done
  # Mixed per-line overrides (greedy, nucleus, top-k, stop strings, max_tokens), the same ids: batch 8 vs 1.
  python3 - "$e2e/mixed.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i, l in enumerate(open("examples/heldout.jsonl")):
        x = json.loads(l)
        x.update([{}, {"temperature": 0.8, "top_p": 0.9, "seed": i}, {"temperature": 1.0, "top_k": 20, "seed": 7 * i},
                  {"stop": ["return", "\n\n"], "max_tokens": 20 + i}][i % 4])
        f.write(json.dumps(x) + "\n")
PY
  for b in 1 8; do
    "$dir/kdtree-run" "$e2e/pair1" --prompts "$e2e/mixed.jsonl" --out "$e2e/mixed-b$b.jsonl" --device cuda --check-weights=device --mode ddtree --budget 16 \
      --max-batch $b --summary "$e2e/mixed-b$b.json" --quiet 2>> "$e2e/batch.err" || status=1
  done
  sed 's/^/E2E batch stderr: /' "$e2e/batch.err" | head -20 | tee -a "$log"
  "$dir/kdtree-golden" "$e2e/pair1" --prompts examples/heldout.jsonl --out "$e2e/gold-heldout" --device cuda --max-tokens 64 \
    --full-logits-steps 0 --topk 2 --trace-step 0 --no-ddtree --quiet || status=1
  # Every rank run teacher-forced through the CPU reference of the 1-rank conversion (the same math), with the
  # bound and this run's measured route-flip rule: the second judge of a line that differs from the 1-rank run.
  # The batched greedy runs too: a batch's rows go through GEMMs of other shapes (from 64 rows an expert the
  # grouped W4A16 takes its large-M form), so a line may leave the batch-1 line at a measured route flip.
  "$dir/kdtree-golden" "$e2e/pair1" --prompts examples/heldout.jsonl --score "$e2e"/ranks-*.jsonl "$e2e"/batch8-*-t0.jsonl \
    --bound 0.15 --route-flip "${m_pair:-0},4.0" --out "$e2e/ranks-score.json" --quiet 2>> "$e2e/ranks.err"
  python3 - "$e2e" <<'PY' | tee -a "$log"
import json, os, struct, sys
e2e = sys.argv[1]
def forced_ok():
    """(file name, id) -> whether every gap over the bound of that record is an accepted route flip or after one."""
    try:
        r = json.load(open(f"{e2e}/ranks-score.json"))
    except (OSError, ValueError):
        return {}
    ok_pos = {(os.path.basename(f), i, j) for f, i, j, *_ in r["route_flips"] + r["after_flip"]}
    return {(os.path.basename(x["file"]), x["id"]): all(g <= r["bound"] or (os.path.basename(x["file"]), x["id"], j) in ok_pos
                                                     for j, g in enumerate(x["gaps"])) for x in r["records"]}
forced = forced_ok()
def load(p):
    return {x["id"]: x.get("token_ids") or x.get("error") for x in map(json.loads, open(p))}
def top2(pid):
    raw = open(f"{e2e}/gold-heldout/{pid}.safetensors", "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    def t(name, fmt):
        a, b = h[name]["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        return list(struct.unpack("<%d%s" % (len(buf) // 4, fmt), buf))
    return t("ar.tokens", "i"), t("ar.topk_logits", "f")
def same_lines(stem, label, got, extra=""):
    """The E2E line of the run whose output is {stem}.jsonl / .json against one controller's lines `got`: every
    line must be equal. 1 when not (or no output), else 0."""
    try:
        lines, summ = load(f"{e2e}/{stem}.jsonl"), json.load(open(f"{e2e}/{stem}.json"))
    except (OSError, ValueError) as e:
        print(f"E2E {label}: no output ({e})")
        return 1
    eq = sum(lines.get(k) == v for k, v in got.items())
    print(f"E2E {label} == one controller on {eq} of {len(got)} prompts; {summ.get('tokens_per_s') or 0:.0f} tok/s{extra}")
    return int(eq != len(got) or len(lines) != len(got))
base = load(f"{e2e}/pair-ar-t0.jsonl")
one = json.load(open(f"{e2e}/pair-ar-t0.json"))
bad = 0
for plan in ("tp2", "tp4", "tp8", "ep2", "ep4", "ep8"):
    for mode in ("ar", "ddtree16"):
        try:
            got, summ = load(f"{e2e}/ranks-{plan}-{mode}.jsonl"), json.load(open(f"{e2e}/ranks-{plan}-{mode}.json"))
        except (OSError, ValueError) as e:
            print(f"E2E ranks {plan} {mode}: no output ({e})"); bad += 1; continue
        same, ties, flipped, fails = 0, [], [], []
        for k, a in base.items():
            d = got.get(k)
            if d == a:
                same += 1
                continue
            if not isinstance(d, list):
                fails.append(f"{k}: {d}"); continue
            i = next((j for j, (p, q) in enumerate(zip(a, d)) if p != q), min(len(a), len(d)))
            try:
                toks, lg = top2(k)
                margin = lg[2 * i] - lg[2 * i + 1] if toks[:len(a)] == a and 2 * i + 1 < len(lg) else float("inf")
            except (OSError, KeyError, ValueError) as e:
                margin = float("inf")
            what = f"{k} at token {i} (1-rank top-2 margin {margin:.3g})"
            if margin <= 0.15:
                ties.append(what)
            elif forced.get((f"ranks-{plan}-{mode}.jsonl", k)):
                flipped.append(what)
            else:
                fails.append(what)
        bad += len(fails)
        print(f"E2E ranks {plan} {mode} greedy on one GPU: {same} of {len(base)} prompts == the 1-rank tokens"
              + (f", near-ties {ties}" if ties else "")
              + (f", teacher-forced within the bound but for measured route flips {flipped}" if flipped else "")
              + (f", FAIL {fails}" if fails else "")
              + f"; {summ.get('tokens_per_s') or 0:.0f} tok/s (1 rank AR {one.get('tokens_per_s') or 0:.0f})")
        # R rank groups (--gpus R --share-gpu) against one controller of the same R ranks: the same sums in the
        # same order, so every line must be equal.
        bad += same_lines(f"groups-{plan}-{mode}", f"groups {plan} {mode}: {plan[2:]} rank groups (own threads, streams, graphs)", got,
                          f" (one controller {summ.get('tokens_per_s') or 0:.0f})")
        if (plan, mode) == ("tp8", "ddtree16"):
            bad += same_lines(f"groups-eager-{plan}-{mode}", f"groups {plan} {mode} eager: {plan[2:]} rank groups without graphs", got)
# --max-batch 8 against --max-batch 1 (the same prompts and settings): greedy lines must be equal up to
# near-ties of the 1-rank AR run (a batched GEMM may sum in another order) or a route flip that the teacher-forced
# score accepts (CPU router margin under the measured one); sampled lines are counted.
for temp in (0, 1):
    for mode in ("ar", "ddtree16", "ddtree64"):
        try:
            one_b, got = load(f"{e2e}/pair-{mode}-t{temp}.jsonl"), load(f"{e2e}/batch8-{mode}-t{temp}.jsonl")
            s1, s8 = json.load(open(f"{e2e}/pair-{mode}-t{temp}.json")), json.load(open(f"{e2e}/batch8-{mode}-t{temp}.json"))
        except (OSError, ValueError) as e:
            print(f"E2E batch {mode} T={temp}: no output ({e})"); bad += 1; continue
        same, ties, flipped, fails = 0, [], [], []
        for k, a in one_b.items():
            d = got.get(k)
            if d == a:
                same += 1; continue
            if temp or not isinstance(d, list) or not isinstance(a, list):
                fails.append(f"{k}"); continue
            i = next((j for j, (p, q) in enumerate(zip(a, d)) if p != q), min(len(a), len(d)))
            try:
                toks, lg = top2(k)
                margin = lg[2 * i] - lg[2 * i + 1] if toks[:len(a)] == a and 2 * i + 1 < len(lg) else float("inf")
            except (OSError, KeyError, ValueError):
                margin = float("inf")
            what = f"{k} at token {i} (top-2 margin {margin:.3g})"
            if margin <= 0.15:
                ties.append(what)
            elif forced.get((f"batch8-{mode}-t0.jsonl", k)):
                flipped.append(what)
            else:
                fails.append(what)
        if temp == 0:
            bad += len(fails)
        print(f"E2E batch {mode} T={temp} --max-batch 8 vs 1: {same} of {len(one_b)} lines identical"
              + (f", near-ties {ties}" if ties else "")
              + (f", teacher-forced within the bound but for measured route flips {flipped}" if flipped else "")
              + (f", {'FAIL' if temp == 0 else 'differ'} {fails}" if fails else "")
              + f"; throughput {s8.get('throughput_tok_s') or 0:.0f} vs {s1.get('throughput_tok_s') or 0:.0f} tok/s")
try:
    m1, m8 = load(f"{e2e}/mixed-b1.jsonl"), load(f"{e2e}/mixed-b8.jsonl")
    greedy = {json.loads(l)["id"] for i, l in enumerate(open(f"{e2e}/mixed.jsonl")) if i % 4 in (0, 3)}
    diff = [k for k in m1 if m1[k] != m8.get(k)]
    hard = [k for k in diff if k in greedy]
    bad += len(hard)
    print(f"E2E batch mixed overrides (greedy, top-p, top-k, stop strings, max_tokens) DDTree b16 --max-batch 8 vs 1: "
          f"{len(m1) - len(diff)} of {len(m1)} lines identical" + (f", differ {diff}" if diff else "") + (" FAIL (greedy)" if hard else ""))
except (OSError, ValueError) as e:
    print(f"E2E batch mixed overrides: no output ({e})"); bad += 1
sys.exit(1 if bad else 0)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  tar -C "$e2e" -cf "$out/batch-runs.tar" $(cd "$e2e" && ls batch8-*.json* mixed-*.json* ranks-score.json) 2>/dev/null
  san_pair="$e2e/pair1"
fi
if [ "${KDTREE_GPU_BENCH:-1}" = 1 ] && [ "$san_mode" != only ]; then
  echo "== cuda_bench (timings)"
  # KDTREE_GPU_BENCH_FILTER: only the timings whose test name contains it (e.g. ddtree_tree_stages).
  "$dir/cuda_bench" --ignored --nocapture --test-threads=1 ${KDTREE_GPU_BENCH_FILTER:-} 2>&1 | tee -a "$log" | grep -E "^(BENCH|test result)|panicked"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "${KDTREE_GPU_K26:-0}" = 1 ] && [ -x "$dir/cuda_k26_slice" ]; then
  # The TP8 rank-0 slice of the full K2.6 from dummy weights (~78 GB filled on the GPU): fill, AR step,
  # DDTree rounds at budgets 16, 64, 256 (engine/tests/cuda_k26_slice.rs). Off by default (KDTREE_GPU_K26=1).
  echo "== cuda_k26_slice (timings)"
  "$dir/cuda_k26_slice" --ignored --nocapture --test-threads=1 2>&1 | tee -a "$log" | grep -E "^(BENCH|test result)|panicked"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# compute-sanitizer on the trained pair (issue 24): racecheck, synccheck and initcheck over the AR step, the DDTree
# round and the batched step (--max-batch 2: the two lines and a ghost slot). Prompts of 8 token ids, 4 generated
# tokens: the prefill is not what is checked, and every instrumented kernel costs (run 51: three 70-token lines ran
# past 60 s). Zero errors is the gate. How each tool runs, and why (bench/GPU-RESULTS.md run 52):
# - racecheck checks shared-memory hazards inside each kernel's blocks, which do not depend on how a kernel is
#   launched: it runs eagerly (KDTREE_CUDA_GRAPHS=0, the same kernels with the same arguments), since instrumenting
#   captured graphs took minutes; restricting it to our kernels (--kernel-name) crashed the sanitizer (run 52);
# - synccheck on the captured graphs, as the runs ship;
# - initcheck on the captured graphs with KDTREE_CUDA_POISON=1 (every buffer the ops allocate is filled with NaN
#   bytes by a kernel before its op writes it). Unpoisoned, initcheck reported (run 51 and the diagnostic of
#   run 52) the prefill's latent rows as uninitialised from their first byte: the output of the kv_a cuBLAS GEMM,
#   copied and normed by kv_append_latent, whose values equal the CPU twin's in every parity and end-to-end check.
#   The likeliest reading is that initcheck does not track that cuBLAS kernel's stores; it is not proven (the
#   "initcheck cuBLAS" line below runs cuda_gemm's parity test unpoisoned, whose outputs are uploaded NaN first,
#   so it cannot show it: 0 errors in run 52). Poisoned, initcheck reports reads of memory nothing ever wrote,
#   and a read of an allocated buffer its op left unwritten reads NaN, which the run's tokens would show: they
#   must equal the run without the sanitizer.
# (memcheck runs at real width in scripts/gpu-test-k26.sh.)
if [ "$san_mode" = 0 ]; then
  echo "E2E compute-sanitizer: skipped (KDTREE_GPU_SANITIZE=0; run KDTREE_GPU_SANITIZE=only for them)" | tee -a "$log"
elif [ -n "$sanitizer" ] && [ -n "${san_pair:-}" ]; then
  python3 - "$e2e" <<'PY'
import json, sys
e = sys.argv[1]
ids = [[17, 942, 305, 88, 1203, 64, 9, 511], [3, 77, 1500, 42, 640, 12, 805, 7]]
with open(f"{e}/san2.jsonl", "w") as f2, open(f"{e}/san.jsonl", "w") as f1:
    for i, x in enumerate(ids):
        line = json.dumps({"id": f"san{i}", "prompt_token_ids": x, "max_tokens": 4}) + "\n"
        f2.write(line)
        if i == 0:
            f1.write(line)
PY
  # The reference tokens of the same runs without a sanitizer.
  for run in "ar:--mode ar" "ddtree16:--mode ddtree --budget 16" "batch2:--mode ddtree --budget 16 --max-batch 2"; do
    case $run in batch*) sp="$e2e/san2.jsonl";; *) sp="$e2e/san.jsonl";; esac
    "$dir/kdtree-run" "$san_pair" --prompts "$sp" --out "$e2e/san-ref-${run%%:*}.jsonl" --device cuda --check-weights=device ${run#*:} --quiet || status=1
  done
  s=$(date +%s)
  timeout 120 "$sanitizer" --tool initcheck --print-limit 3 "$dir/cuda_gemm" --test-threads=1 gemm_bf16_parity > "$e2e/san-cublas.log" 2>&1
  echo "E2E initcheck cuBLAS (measured, not gated): cuda_gemm gemm_bf16_parity unpoisoned: exit $?, $(grep -c 'test .* ok$' "$e2e/san-cublas.log") tests ok; $(grep -hE 'ERROR SUMMARY' "$e2e/san-cublas.log" | tail -1); first report: $(grep -m 3 -E 'Uninitialized|at 0x|by cudaMemcpy|Host Frame.*cublas' "$e2e/san-cublas.log" | tr -s ' =' ' ' | tr '\n' ';' | cut -c1-300) ($(( $(date +%s) - s )) s)" | tee -a "$log"
  for tool in racecheck synccheck initcheck; do
    case $tool in racecheck) env=(KDTREE_CUDA_GRAPHS=0);; initcheck) env=(KDTREE_CUDA_POISON=1);; *) env=();; esac
    for run in "ar:--mode ar" "ddtree16:--mode ddtree --budget 16" "batch2:--mode ddtree --budget 16 --max-batch 2"; do
      s=$(date +%s)
      if [ $(( s - suite_start )) -gt "${KDTREE_GPU_DEADLINE_S:-900}" ]; then
        echo "E2E compute-sanitizer $tool trained pair ${run%%:*}: NOT RUN (the suite passed its ${KDTREE_GPU_DEADLINE_S:-900} s deadline): FAIL" | tee -a "$log"; status=1; continue
      fi
      case $run in batch*) sp="$e2e/san2.jsonl";; *) sp="$e2e/san.jsonl";; esac
      rm -f "$e2e/san.out.jsonl"
      if env "${env[@]}" timeout 150 "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 "$dir/kdtree-run" "$san_pair" --prompts "$sp" \
          --out "$e2e/san.out.jsonl" --device cuda ${run#*:} --quiet > "$e2e/san.log" 2>&1 &&
          python3 -c 'import json, sys
a, b = ([{x["id"]: x.get("token_ids") for x in map(json.loads, open(p))} for p in sys.argv[1:3]])
sys.exit(not a or a != b)' "$e2e/san.out.jsonl" "$e2e/san-ref-${run%%:*}.jsonl"; then
        echo "E2E compute-sanitizer $tool trained pair ${run%%:*} (${env[*]:-graphs}): $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$e2e/san.log" | tail -1), tokens == the run without it ($(( $(date +%s) - s )) s)" | tee -a "$log"
      else
        echo "E2E compute-sanitizer $tool trained pair ${run%%:*} (${env[*]:-graphs}): FAIL $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$e2e/san.log" | tail -1) ($(( $(date +%s) - s )) s)" | tee -a "$log"
        grep -m 12 "=========" "$e2e/san.log" | cut -c1-240 | tee -a "$log"
        status=1
      fi
    done
  done
else
  echo "E2E compute-sanitizer: not found: FAIL" | tee -a "$log"; status=1
fi
echo
echo "== summary"
printf '%-100s %s\n' "parity case" "rel (tol)"
grep '^PARITY' "$log" | sed -E 's/^PARITY (.*) max_abs=([^ ]+) rel=([^ ]+) tol=([^ ]+)$/\1|\3 (\4)/; s/^PARITY (.*) exact(.*)$/\1|exact\2/; s/^PARITY (.*) (mismatches .*)$/\1|\2/' | awk -F'|' '{printf "%-100s %s\n", $1, $2}'
grep '^BENCH' "$log" | sed 's/^BENCH //'
grep '^E2E' "$log" | sed 's/^E2E //'
echo "verdict: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
