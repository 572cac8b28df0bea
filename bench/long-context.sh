#!/usr/bin/env bash
# The long-context table (issue 27): on the GPU machine, the TP8 rank-0 slice of the full 61-layer K2.6 from dummy
# weights (`kdtree-run --load-format dummy --ranks 8 --rank 0`), one prompt of seeded random token ids per length,
# 16 tokens greedy: time to first token, the AR step, and the DDTree rounds at budgets 16 and 64 (random drafter: its
# acceptance means nothing, the round's cost does). Each run answers a 1,024-token warm-up prompt first, so the
# figures are a warm process's (kernels loaded, cuBLAS's heuristics for most shapes chosen), as a server's are; the
# figures of bench/GPU-RESULTS.md runs <= 80 were the process's first prompt. Prints one `LONGCTX` line per
# length and a table last.
# Each row also gives its floors (below). Usage: bench/long-context.sh DIR [LENGTH...] (DIR: the staged .dev-gpu/;
# lengths default 1024 4096 16384 32768).
# Exit 0 when every run answered, 1 when one failed, 2 on bad usage.
set -uo pipefail
dir="${1:?usage: bench/long-context.sh DIR [LENGTH...]}"
shift
lens=("$@")
[ ${#lens[@]} -gt 0 ] || lens=(1024 4096 16384 32768)
for n in "${lens[@]}"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "long-context: length '$n' is not a positive integer" >&2; exit 2; }
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$dir/kdtree-convert" synth k26 "$tmp/k26cfg" --drafter --config-only --quiet || exit 1
commit="$(cat "$dir/COMMIT" 2>/dev/null || echo unknown)"
# Floors of the rank-0 slice at the device's rates (KDTREE_BF16_PEAK_TFLOPS, default 815: cuBLAS 8192^3 measured
# 809-823 on the H200 in runs 80-86; KDTREE_COPY_GBPS, default 4200: device copy 4150-4300): the prefill's FLOPs
# (every matrix a token meets, on this rank's shard as formats/FORMAT.md splits them, plus the causal attention in
# the expanded form: (192 + 128) multiply-adds a visible (row, key) pair and head) at the peak; the AR step's bytes
# (those matrices once, 8 routed experts' INT4 slices, the lm_head shard, the latent cache of n rows) at the copy rate.
floors() { # N -> "ttft_floor_ms step_floor_ms"
  python3 - "$tmp/k26cfg/config.json" "$1" "${KDTREE_BF16_PEAK_TFLOPS:-815}" "${KDTREE_COPY_GBPS:-4200}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c = c.get("text_config", c)
n, peak, copy = int(sys.argv[2]), float(sys.argv[3]) * 1e12, float(sys.argv[4]) * 1e9
R = 8
h, hr = c["hidden_size"], c["num_attention_heads"] // R
ql, kl, rope, nope, dv = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
mi, di, topk, ne = c["moe_intermediate_size"] // R, c["intermediate_size"] // R, c["num_experts_per_tok"], c["n_routed_experts"]
shared, layers, dense = c.get("n_shared_experts", 1), c["num_hidden_layers"], c.get("first_k_dense_replace", 1)
vocab = c["vocab_size"] // R
attn = h * ql + ql * hr * (nope + rope) + h * (kl + rope) + kl * hr * (nope + dv) + hr * dv * h  # bf16 params
moe_bf16 = 3 * h * mi * shared + h * ne  # shared expert slice, router
moe_i4 = 3 * h * mi * topk  # the routed experts a token meets (their TP slices)
dense_mlp = 3 * h * di
per_tok = layers * attn + (layers - dense) * (moe_bf16 + moe_i4) + dense * dense_mlp
flops = 2 * per_tok * n + 2 * layers * hr * (nope + rope + dv) * (n * (n + 1) / 2)
step_bytes = 2 * (layers * attn + (layers - dense) * moe_bf16 + dense * dense_mlp + vocab * h) \
    + (layers - dense) * moe_i4 * 9 / 16 + layers * 2 * (kl + rope) * n
print("%.1f %.3f" % (flops / peak * 1e3, step_bytes / copy * 1e3))
PY
}
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
status=0
rows=()
for n in "${lens[@]}"; do
  # Token ids below V / 8 (the rank's vocab shard of dummy weights), seeded by the length.
  python3 -c 'import json, random, sys
n = int(sys.argv[1]); r = random.Random(n)
w = random.Random(1)
print(json.dumps({"id": "warmup", "prompt_token_ids": [w.randrange(20480) for _ in range(1024)]}))
print(json.dumps({"id": f"ctx{n}", "prompt_token_ids": [r.randrange(20480) for _ in range(n)]}))' "$n" > "$tmp/p$n.jsonl"
  line="$n"
  for run in ar b16 b64; do
    mode=ddtree extra=()
    case $run in ar) mode=ar;; b16) extra=(--budget 16);; b64) extra=(--budget 64);; esac
    if "$dir/kdtree-run" "$tmp/k26cfg" --load-format dummy --ranks 8 --rank 0 --device cuda --mode "$mode" "${extra[@]}" \
        --max-tokens 16 --prompts "$tmp/p$n.jsonl" --out "$tmp/o-$run-$n.jsonl" --quiet 2> "$tmp/err"; then
      # AR: decode time per generated token after the first; DDTree: per verify round.
      line+=" $(python3 -c 'import json, sys
r = next(r for r in map(json.loads, open(sys.argv[1])) if r["id"] == sys.argv[3])
t = r["timing"]; n = len(r["token_ids"])
steps = r["spec"]["verify_steps"] if sys.argv[2] == "ddtree" else n - 1
print("%.1f %.2f" % (t["ttft_ms"], t["decode_ms"] / max(steps, 1)))' "$tmp/o-$run-$n.jsonl" "$mode" "ctx$n")"
    else
      echo "long-context: $run at $n tokens failed:" >&2
      tail -5 "$tmp/err" >&2
      line+=" - -"
      status=1
    fi
  done
  # n ttft_ar step_ar ttft_b16 round_b16 ttft_b64 round_b64 ttft_floor step_floor
  set -- $line $(floors "$n")
  echo "LONGCTX ctx=$1 ttft_ms=$2 ar_step_ms=$3 ddtree_b16_round_ms=$5 ddtree_b64_round_ms=$7 ttft_floor_ms=$8" \
    "ar_step_floor_ms=$9 gpu=\"$gpu\" commit=$commit"
  rows+=("| $1 | $2 | $8 | $3 | $9 | $5 | $7 |")
done
echo
echo "Long context, K2.6 TP8 rank-0 slice (dummy weights), $gpu, commit $commit"
echo "| prompt tokens | TTFT ms (warm) | TTFT FLOP floor ms | AR step ms | AR step byte floor ms | DDTree b16 round ms | DDTree b64 round ms |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
