//! MLA attention of one layer over a tree of T new nodes hanging off the committed latent cache, written
//! once against `backend::Backend`, in two selectable forms that must agree:
//! * **naive** (transformers `DeepseekV3Attention`): expand every visible latent row through kv_b into
//!   per-head `k_nope | v`, score `[q_nope | q_pe] · [k_nope | k_pe]`, weight v;
//! * **absorbed** (FlashMLA-style): fold kv_b's key half into q (`q_lat = W_UK^T q_nope`, kv_lora wide),
//!   score against the 576-wide latent rows directly, average the latents, then apply kv_b's value half.
//!
//! The replicated part (q_a, kv_a, the new latent rows) runs once with rank 0's copy; each rank then runs
//! its heads (`Backend::mla_attention`, cpu twin cpu/ops/mla_attention.rs) and o_proj, and the partials go
//! through `Backend::all_reduce` (rank order). Must match: k26-format §4.3-§4.4 (MLA, interleaved YaRN
//! rope, softmax scale). Tests: engine/tests/target_model.rs (`naive_equals_absorbed`, tree/chain, TP
//! partials).
//!
//! Letters: T new nodes, Hr heads of a rank, C kv_lora, P rope dims, Dn nope dims, Dv v dims.

use super::weights::Weights;
use crate::backend::Backend;
use crate::cpu::ops::MlaDims;

/// Which MLA form the forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnMode {
    /// Expand latents through kv_b (transformers' form).
    #[default]
    Naive,
    /// Weight-absorbed form over the latent cache.
    Absorbed,
}

/// Attention output `[T, H]` (after o_proj, ranks reduced) for normed input `x` `[T, H]` of layer `l`;
/// appends the T nodes' latent rows to the cache as scratch. `rope` holds the nodes' positions, `mask` their
/// ancestor bitmask.
#[allow(clippy::too_many_arguments)]
pub fn mla<B: Backend>(w: &Weights<B>, l: usize, x: &B::Act, t: usize, mask: &B::Mask, rope: &B::Rope, kv: &mut B::Kv, mode: AttnMode) -> B::Act {
    let (b, cfg) = (&w.backend, &w.cfg);
    let a0 = &w.ranks[0].layers[l].attn;
    // Query input: normed q_a latent [T, q_lora], or x itself when q_lora_rank is None.
    let q_lat;
    let q_in = match &a0.q_a {
        Some((q_a, q_norm)) => {
            q_lat = b.rms_norm(&b.linear(x, t, q_a), q_norm, cfg.latent_eps);
            &q_lat
        }
        None => x,
    };
    // New latent rows [T, C + P]: rms_norm(c_kv) | rope(k_pe).
    let ckv = b.linear(x, t, &a0.kv_a); // [T, C + P]
    b.kv_append_latent(kv, l, &ckv, &a0.kv_a_norm, cfg.latent_eps, rope);

    let qk = cfg.qk_head_dim();
    let partials: Vec<B::Act> = w
        .ranks
        .iter()
        .map(|rw| {
            let at = &rw.layers[l].attn;
            let hr = b.mat_rows(&at.q) / qk;
            let mut q = b.linear(q_in, t, &at.q); // [T, Hr * qk]: per head q_nope (Dn) | q_pe (P)
            b.rope_q(&mut q, hr, cfg.nope, rope);
            let d = MlaDims { heads: hr, nope: cfg.nope, rope: cfg.rope, v: cfg.v_dim, kv_lora: cfg.kv_lora, scale: cfg.softmax_scale };
            let heads_out = b.mla_attention(&q, t, kv, l, mask, &at.kv_b, &d, mode); // [T, Hr * Dv]
            b.linear(&heads_out, t, &at.o_proj) // [T, H]
        })
        .collect();
    b.all_reduce(partials)
}
