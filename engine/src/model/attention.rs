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
pub use crate::backend::AttnMode;
use crate::backend::{Backend, Cols};
use crate::cpu::ops::MlaDims;

/// One sequence's part of a forward: its latent cache, its `t` nodes (consecutive rows of the forward, in
/// segment order), their ancestor mask and positions. A forward over several segments is a batch: every
/// projection and the MoE see all rows at once, the attention runs per segment over its own cache (the mask
/// is block-diagonal by construction: a node never sees another sequence's nodes).
pub struct Seg<'s, B: Backend> {
    pub kv: &'s mut B::Kv,
    pub t: usize,
    pub mask: &'s B::Mask,
    /// Its rows' RoPE table. A forward of one segment reads it; a batch reads the segments' tables stacked (the
    /// forward's `rope_all`), and a segment's own may then be that stacked table.
    pub rope: &'s B::Rope,
}

/// Attention output `[T, H]` (after o_proj, ranks reduced) for normed input `x` `[T, H]` of layer `l`, made ready
/// for the linears ([`crate::backend::Compute::rms_norm_in`]: one conversion for q_a and kv_a),
/// `T` = the segments' nodes; appends each segment's latent rows to its cache as scratch. With one segment
/// no row is copied (the single-sequence forward).
/// `rope_all`: the segments' tables stacked ([`crate::backend::Compute::rope_at_segs`]), for a batch of several
/// segments (each segment's own `rope` is then not read).
pub fn mla<B: Backend>(
    w: &Weights<B>,
    l: usize,
    x: &B::LinIn,
    t: usize,
    segs: &mut [Seg<'_, B>],
    rope_all: Option<&B::Rope>,
    mode: AttnMode,
) -> B::Act {
    let (b, cfg) = (&w.backend, &w.cfg);
    let a0 = &w.ranks[0].layers[l].attn;
    // q_a and kv_a of the one input as one linear (their matrices stacked at load): `[T, q_lora | C + P]`, or
    // `[T, C + P]` when q_lora_rank is None (the query's input is x itself then).
    let lw = cfg.latent_width();
    let (ckv_all, q_cols, ckv_cols) = match &a0.q_a {
        Some((q_a, _)) => {
            let c = Cols::split(&[b.mat_rows(q_a), lw]);
            (b.linear_in_cat(x, t, &[q_a, &a0.kv_a]), Some(c[0]), c[1])
        }
        None => (b.linear_in(x, t, &a0.kv_a), None, Cols::split(&[lw])[0]),
    };
    // Query input: the normed q_a latent [T, q_lora], or x (both ready for the linears).
    let q_lat;
    let q_in = match (&a0.q_a, q_cols) {
        (Some((_, q_norm)), Some(c)) => {
            q_lat = b.rms_norm_in_cols(&ckv_all, c, t, q_norm, cfg.latent_eps);
            &q_lat
        }
        _ => x,
    };
    // New latent rows [T, C + P]: rms_norm(c_kv) | rope(k_pe), each segment's into its own cache.
    let rope_all = match &*segs {
        [_] => None,
        _ => Some(rope_all.expect("several segments have their stacked table")),
    };
    match (&mut *segs, rope_all) {
        ([seg], _) => b.kv_append_latent_cols(
            seg.kv,
            l,
            &ckv_all,
            ckv_cols,
            t,
            &a0.kv_a_norm,
            cfg.latent_eps,
            seg.rope,
        ),
        (many, rope) => {
            let rope = rope.expect("several segments have their stacked table");
            let ckv = match q_cols {
                Some(_) => b.cols(&ckv_all, ckv_cols.ld, ckv_cols.off, lw, t),
                None => ckv_all,
            };
            let mut parts: Vec<(&mut B::Kv, usize)> = many.iter_mut().map(|s| (&mut *s.kv, s.t)).collect();
            b.kv_append_latent_segs(&mut parts, l, &ckv, &a0.kv_a_norm, cfg.latent_eps, lw, rope);
        }
    }

    let qk = cfg.qk_head_dim();
    let partials: Vec<B::Act> = w
        .ranks
        .iter()
        .map(|rw| {
            let at = &rw.layers[l].attn;
            let hr = b.mat_rows(&at.q) / qk;
            let d = MlaDims {
                heads: hr,
                nope: cfg.nope,
                rope: cfg.rope,
                v: cfg.v_dim,
                kv_lora: cfg.kv_lora,
                scale: cfg.softmax_scale,
            };
            let mut q = b.linear_in(q_in, t, &at.q); // [T, Hr * qk]: per head q_nope (Dn) | q_pe (P)
            let heads_out = match (&*segs, rope_all) {
                ([seg], _) => {
                    b.rope_q(&mut q, hr, cfg.nope, seg.rope);
                    b.mla_attention_in(&q, t, seg.kv, l, seg.mask, &at.kv_b, &d, mode)
                    // [T, Hr * Dv]
                }
                (many, rope) => {
                    let rope = rope.expect("several segments have their stacked table");
                    b.rope_q(&mut q, hr, cfg.nope, rope);
                    let parts: Vec<(&B::Kv, &B::Mask, usize)> = many.iter().map(|s| (&*s.kv, s.mask, s.t)).collect();
                    b.mla_attention_segs_in(&q, &parts, l, &at.kv_b, &d, mode)
                }
            };
            b.linear_in(&heads_out, t, &at.o_proj) // [T, H]
        })
        .collect();
    b.all_reduce(partials)
}
