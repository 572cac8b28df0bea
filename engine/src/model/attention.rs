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

/// One sequence's part of a forward: its latent cache, its `t` nodes (consecutive rows of the forward, in
/// segment order), their ancestor mask and positions. A forward over several segments is a batch: every
/// projection and the MoE see all rows at once, the attention runs per segment over its own cache (the mask
/// is block-diagonal by construction: a node never sees another sequence's nodes).
pub struct Seg<'s, B: Backend> {
    pub kv: &'s mut B::Kv,
    pub t: usize,
    pub mask: &'s B::Mask,
    pub rope: &'s B::Rope,
}

/// Attention output `[T, H]` (after o_proj, ranks reduced) for normed input `x` `[T, H]` of layer `l`,
/// `T` = the segments' nodes; appends each segment's latent rows to its cache as scratch. With one segment
/// no row is copied (the single-sequence forward).
pub fn mla<B: Backend>(w: &Weights<B>, l: usize, x: &B::Act, t: usize, segs: &mut [Seg<'_, B>], mode: AttnMode) -> B::Act {
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
    // New latent rows [T, C + P]: rms_norm(c_kv) | rope(k_pe), each segment's into its own cache.
    let ckv = b.linear(x, t, &a0.kv_a); // [T, C + P]
    for_segments(b, segs, &ckv, cfg.latent_width(), |seg, rows, _| b.kv_append_latent(seg.kv, l, rows, &a0.kv_a_norm, cfg.latent_eps, seg.rope));

    let qk = cfg.qk_head_dim();
    let partials: Vec<B::Act> = w
        .ranks
        .iter()
        .map(|rw| {
            let at = &rw.layers[l].attn;
            let hr = b.mat_rows(&at.q) / qk;
            let d = MlaDims { heads: hr, nope: cfg.nope, rope: cfg.rope, v: cfg.v_dim, kv_lora: cfg.kv_lora, scale: cfg.softmax_scale };
            let mut q = b.linear(q_in, t, &at.q); // [T, Hr * qk]: per head q_nope (Dn) | q_pe (P)
            let heads_out = if let [seg] = segs {
                b.rope_q(&mut q, hr, cfg.nope, seg.rope);
                b.mla_attention(&q, t, seg.kv, l, seg.mask, &at.kv_b, &d, mode) // [T, Hr * Dv]
            } else {
                let (mut out, mut at_row) = (b.zeros(t * hr * cfg.v_dim), 0);
                for seg in segs.iter_mut() {
                    let mut q_s = b.rows(&q, hr * qk, at_row, at_row + seg.t);
                    b.rope_q(&mut q_s, hr, cfg.nope, seg.rope);
                    let o = b.mla_attention(&q_s, seg.t, seg.kv, l, seg.mask, &at.kv_b, &d, mode);
                    b.set_rows(&mut out, hr * cfg.v_dim, at_row, &o, seg.t);
                    at_row += seg.t;
                }
                out
            };
            b.linear(&heads_out, t, &at.o_proj) // [T, H]
        })
        .collect();
    b.all_reduce(partials)
}

/// `f(segment, its rows of x [T, cols], its first row)` for every segment: `x` itself for a single segment,
/// a copy of the segment's rows otherwise.
pub fn for_segments<B: Backend>(b: &B, segs: &mut [Seg<'_, B>], x: &B::Act, cols: usize, mut f: impl FnMut(&mut Seg<'_, B>, &B::Act, usize)) {
    if let [seg] = segs {
        return f(seg, x, 0);
    }
    let mut at = 0;
    for seg in segs.iter_mut() {
        let rows = b.rows(x, cols, at, at + seg.t);
        f(seg, &rows, at);
        at += seg.t;
    }
}
