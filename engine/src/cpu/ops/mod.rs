//! Plain CPU kernels, one op per file: the spec every faster kernel (CUDA) is checked against.
//!
//! Each file opens with what it computes, the reference it must match and where its test lives. Element
//! ops: matmul_bf16 / matmul_f32 / matmul_i4g32 (shared driver in `matmul`), rms_norm, rope (interleaved,
//! NeoX), yarn, softmax, silu (argmax and top-K are sampling.rs's, the engine's one of each). Model-level ops: fill
//! (seeded dummy weights), mla_attention (latent cache with an ancestor mask), gqa_attention (the drafter's block),
//! moe_route, moe_experts, embedding and lm_head over vocab-parallel shards, residual (add, fixed-order rank sum),
//! kv_compact. The backend seam (engine/src/backend.rs) calls these.
//!
//! Determinism: every reduction runs in one fixed sequential order; rayon only decides which thread runs
//! it, so results are bit-identical for any thread count.

use half::bf16;

mod embedding;
mod fill;
mod gqa_attention;
mod kv_compact;
mod lm_head;
mod matmul;
mod matmul_bf16;
mod matmul_i4g32;
mod mla_attention;
mod moe_experts;
mod moe_route;
mod residual;
mod rms_norm;
mod rope;
mod silu;
mod softmax;
mod yarn;

pub use crate::sampling::argmax;
pub use embedding::embedding_bf16;
pub use fill::{fill_bf16, fill_f32, fill_u8, fill_uniform_f32, fill_word, Fill};
pub use gqa_attention::gqa_attention;
pub use kv_compact::kv_compact;
pub use lm_head::{argmax_pairs, lm_head_argmax_bf16, lm_head_bf16, merge_argmax_pairs};
pub use matmul_bf16::{matmul_bf16, matmul_f32};
pub use matmul_i4g32::{dequant_i4g32_matrix, matmul_i4g32};
pub use mla_attention::{mla_attention, MlaDims, MlaKv};
pub use moe_experts::{moe_experts_i4g32, tokens_per_expert, ExpertI4};
pub use moe_route::{moe_route, route_margin, Router};
pub use residual::{add_assign, all_reduce_sum};
pub use rms_norm::rms_norm;
pub use rope::{rope_cos_sin, rope_interleaved, rope_neox};
pub use silu::{sigmoid, silu, silu_mul};
pub use softmax::softmax;
pub use yarn::{yarn_attention_factor, yarn_get_mscale, yarn_inv_freq};

/// Exact bf16 → f32 widening (bf16 is the top half of an f32).
#[inline]
pub fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Widen a bf16 slice to f32.
pub fn bf16_slice_to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|&v| bf16_to_f32(v)).collect()
}
