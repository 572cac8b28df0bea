//! kdtree-kernels: CUDA kernel sources (kernels/cuda/*.cu, one op per file) and their embedded fatbin.
//!
//! This crate knows no model layer: each kernel is one op with a CPU twin in the engine's CPU backend;
//! the wrappers that check shapes and launch live in `kdtree-engine::cuda`. Without the `cuda` feature it
//! builds to nothing but the list of kernel names, so the workspace builds with no CUDA toolkit. With it,
//! build.rs compiles all sources into one fatbin (sm_90a + sm_120a + compute_90 PTX) that [`FATBIN`] embeds;
//! the engine loads it with the driver API (`cuModuleLoadData`) and looks kernels up by name.
//! The kernel index (op | CPU twin | CUDA wrapper | .cu | test | bench | shapes) is kernels/README.md.

/// The fatbin holding every kernel (built by build.rs with nvcc; load it as one module).
#[cfg(feature = "cuda")]
pub static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kdtree_kernels.fatbin"));

/// Every `extern "C"` kernel the fatbin exports, by source file. The engine's loader resolves all of them at
/// context creation, so a missing or renamed kernel fails at start, naming the kernel.
pub const KERNELS: &[(&str, &str)] = &[
    ("act_f32.cu", "kdtree_f32_to_bf16"),
    ("act_f32.cu", "kdtree_bf16_to_f32"),
    ("act_f32.cu", "kdtree_add_f32"),
    ("act_f32.cu", "kdtree_silu_mul_f32"),
    ("act_f32.cu", "kdtree_silu_mul_f32_bf16"),
    ("act_f32.cu", "kdtree_kv_latent_rows_bf16"),
    ("act_f32.cu", "kdtree_rms_norm_f32"),
    ("act_f32.cu", "kdtree_add_rms_norm_bf16"),
    ("act_f32.cu", "kdtree_rope_table_f32"),
    ("act_f32.cu", "kdtree_copy_rows_f32"),
    ("argmax.cu", "kdtree_argmax_f32"),
    ("argmax.cu", "kdtree_argmax_bf16"),
    ("argmax.cu", "kdtree_argmax_pair_f32"),
    ("argmax.cu", "kdtree_argmax_merge_pairs"),
    ("copy_rows.cu", "kdtree_copy_rows_bf16"),
    ("ddtree_build.cu", "kdtree_ddtree_build"),
    ("ddtree_build.cu", "kdtree_ddtree_build_segs"),
    ("ddtree_walk.cu", "kdtree_ddtree_walk"),
    ("ddtree_walk.cu", "kdtree_ddtree_walk_segs"),
    ("embed.cu", "kdtree_embed_gather_bf16"),
    ("embed.cu", "kdtree_embed_gather_shard_bf16"),
    ("fill.cu", "kdtree_fill_uniform_bf16"),
    ("fill.cu", "kdtree_fill_uniform_f32"),
    ("fill.cu", "kdtree_fill_bytes_u8"),
    ("fill.cu", "kdtree_zero_bytes"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_f32_m1"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_f32_m2"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_f32_m4"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_f32_m8"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_bf16_m1"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_bf16_m2"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_bf16_m4"),
    ("gemm_small_bf16.cu", "kdtree_gemm_small_bf16_bf16_m8"),
    ("gather_rows.cu", "kdtree_gather_rows_f32"),
    ("gqa_attention.cu", "kdtree_gqa_attention_split_f32"),
    ("gqa_attention.cu", "kdtree_gqa_attention_split_segs_f32"),
    ("gqa_attention.cu", "kdtree_gqa_attention_merge_f32"),
    ("group_all_reduce.cu", "kdtree_group_all_reduce_f32"),
    ("kv_compact.cu", "kdtree_kv_compact_bf16"),
    ("kv_compact.cu", "kdtree_kv_compact_segs_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_split_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_merge_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_split_seg_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_split_small_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_split_seg_small_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_split_heads_bf16"),
    ("mla_attention.cu", "kdtree_mla_attention_split_heads_small_bf16"),
    ("mla_invariant.cu", "kdtree_mla_inv_absorb_bf16"),
    ("mla_invariant.cu", "kdtree_mla_inv_uv_bf16"),
    ("mla_invariant.cu", "kdtree_mla_inv_partial_bf16"),
    ("mla_invariant.cu", "kdtree_mla_inv_merge_bf16"),
    ("mla_decode.cu", "kdtree_mla_decode_bf16"),
    ("mla_prefill.cu", "kdtree_mla_prefill_bf16_q192_v128"),
    ("mla_prefill.cu", "kdtree_mla_prefill_bf16_q192_v128_p1"),
    ("mla_prefill.cu", "kdtree_mla_prefill_bf16_q64_v32"),
    ("mla_prefill.cu", "kdtree_mla_prefill_bf16_q48_v32"),
    ("moe_align.cu", "kdtree_moe_align_i32"),
    ("moe_combine.cu", "kdtree_moe_combine_f32"),
    ("moe_router.cu", "kdtree_moe_router_f32"),
    ("moe_router.cu", "kdtree_moe_router_warp4_f32"),
    ("moe_router.cu", "kdtree_moe_router_warp12_f32"),
    ("moe_router.cu", "kdtree_moe_router_warp32_f32"),
    ("residual_add.cu", "kdtree_residual_add_bf16"),
    ("rms_norm.cu", "kdtree_rms_norm_bf16"),
    ("rope.cu", "kdtree_rope_interleaved_bf16"),
    ("round_state.cu", "kdtree_pos_add"),
    ("round_state.cu", "kdtree_pos_add_segs"),
    ("round_state.cu", "kdtree_round_advance"),
    ("round_state.cu", "kdtree_round_advance_segs"),
    ("round_state.cu", "kdtree_rope_at_f32"),
    ("round_state.cu", "kdtree_store_rows_bf16"),
    ("round_state.cu", "kdtree_store_rows_f32"),
    ("round_state.cu", "kdtree_store_rows_seg_bf16"),
    ("round_state.cu", "kdtree_store_rows_seg_f32"),
    ("round_state.cu", "kdtree_rope_at_segs_f32"),
    ("round_state.cu", "kdtree_ids_blocks"),
    ("round_state.cu", "kdtree_stash_rows_seg_f32"),
    ("round_state.cu", "kdtree_path_rows_f32"),
    ("round_state.cu", "kdtree_path_rows_segs_f32"),
    ("round_state.cu", "kdtree_copy_segs_u32"),
    ("sample_rows.cu", "kdtree_sample_rows_f32"),
    ("silu_mul.cu", "kdtree_silu_mul_bf16"),
    ("topk_logprobs.cu", "kdtree_topk_max_f32"),
    ("topk_logprobs.cu", "kdtree_topk_partial_f32"),
    ("topk_logprobs.cu", "kdtree_topk_merge_f32"),
    ("visibility.cu", "kdtree_visibility_from_parents"),
    ("w4a16_gemm.cu", "kdtree_w4a16_gemm_i4g32_m1"),
    ("w4a16_gemm.cu", "kdtree_w4a16_gemm_i4g32_m2"),
    ("w4a16_gemm.cu", "kdtree_w4a16_gemm_i4g32_m4"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_m1"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_m2"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_m4"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_silu_m1"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_silu_m2"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_silu_m4"),
    ("w4a16_gemm.cu", "kdtree_moe_w4a16_gemm_i4g32_large"),
    ("xxh3.cu", "kdtree_xxh3_init"),
    ("xxh3.cu", "kdtree_xxh3_deltas"),
    ("xxh3.cu", "kdtree_xxh3_chain"),
    ("xxh3.cu", "kdtree_xxh3_finish"),
];

/// The kernels/README.md section that lists every exported kernel by file, generated from [`KERNELS`] (the
/// test `readme_lists_every_kernel` fails when the README's copy is stale and prints the text to paste).
pub fn kernel_index_markdown() -> String {
    let mut out = String::from("| .cu | kernels |\n|---|---|\n");
    let mut files: Vec<&str> = KERNELS.iter().map(|(f, _)| *f).collect();
    files.dedup();
    for f in files {
        let names: Vec<String> = KERNELS
            .iter()
            .filter(|(g, _)| *g == f)
            .map(|(_, n)| format!("`{n}`"))
            .collect();
        out.push_str(&format!("| `{f}` | {} |\n", names.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::KERNELS;

    /// kernels/README.md's generated section equals [`super::kernel_index_markdown`].
    #[test]
    fn readme_lists_every_kernel() {
        let readme =
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
        let (begin, end) = (
            "<!-- kernel-index:begin (generated: kernels/src/lib.rs kernel_index_markdown) -->\n",
            "<!-- kernel-index:end -->",
        );
        let a = readme.find(begin).expect("README.md has no kernel-index section") + begin.len();
        let b = readme[a..]
            .find(end)
            .expect("README.md's kernel-index section has no end")
            + a;
        let want = super::kernel_index_markdown();
        assert!(
            readme[a..b] == want,
            "kernels/README.md's kernel index is stale; the section should read:\n{want}"
        );
    }

    /// Every listed kernel is defined in the file it names, and every `extern "C" __global__` kernel in
    /// kernels/cuda is listed (macro-generated ones through their `_m##MT` stem).
    #[test]
    fn kernel_list_matches_sources() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        for (file, name) in KERNELS {
            let src = std::fs::read_to_string(dir.join(file)).unwrap();
            let stem = name
                .trim_end_matches(|c: char| c.is_ascii_digit())
                .trim_end_matches("_m");
            assert!(
                src.contains(name) || src.contains(&format!("{stem}_m##MT")),
                "{name} not defined in {file}"
            );
        }
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("cu") {
                continue;
            }
            let src = std::fs::read_to_string(&path).unwrap();
            let file = path.file_name().unwrap().to_str().unwrap();
            for line in src.lines() {
                if let Some(rest) = line.split("__global__ void ").nth(1) {
                    // `__launch_bounds__(N) name(` -> `name(`
                    let rest = match rest.strip_prefix("__launch_bounds__(") {
                        Some(r) => r.split_once(") ").map_or(r, |(_, after)| after),
                        None => rest,
                    };
                    let name = rest.split('(').next().unwrap().trim();
                    let listed = KERNELS
                        .iter()
                        .any(|(f, n)| *f == file && (n == &name || n.starts_with(name.trim_end_matches("##MT"))));
                    assert!(listed, "kernel {name} in {file} is missing from KERNELS");
                }
            }
        }
    }

    /// Every kernel the engine looks up by name (`gpu.func("kdtree_...")` in engine/src/cuda) is listed: the
    /// loader resolves only the listed ones.
    #[test]
    fn every_kernel_the_engine_launches_is_listed() {
        fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().and_then(|x| x.to_str()) == Some("rs") {
                    out.push(p);
                }
            }
        }
        let mut files = Vec::new();
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/src/cuda"),
            &mut files,
        );
        let mut seen = 0;
        for f in files {
            let src = std::fs::read_to_string(&f).unwrap();
            for part in src.split("func(\"").skip(1) {
                let name = part.split('"').next().unwrap();
                if !name.starts_with("kdtree_") {
                    continue;
                }
                seen += 1;
                assert!(
                    KERNELS.iter().any(|(_, n)| *n == name),
                    "{} launches {name}, which is not in KERNELS",
                    f.display()
                );
            }
        }
        assert!(seen > 20, "found only {seen} kernel lookups under engine/src/cuda");
    }
}
