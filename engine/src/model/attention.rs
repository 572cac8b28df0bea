//! MLA attention of one layer over a tree of T new nodes hanging off the committed latent cache, in two
//! selectable forms that must agree:
//! * **naive** (transformers `DeepseekV3Attention`): expand every visible latent row through kv_b into
//!   per-head `k_nope | v`, score `[q_nope | q_pe] · [k_nope | k_pe]`, weight v;
//! * **absorbed** (FlashMLA-style): fold kv_b's key half into q (`q_lat = W_UK^T q_nope`, kv_lora wide),
//!   score against the 576-wide latent rows directly, average the latents, then apply kv_b's value half.
//!
//! Both run per TP rank over that rank's heads (the scores/softmax/values core is cpu::ops::mla_attention);
//! each rank's o_proj partial `[T, H]` is summed in rank order.
//! Must match: k26-format §4.3-§4.4 (MLA, interleaved YaRN rope, softmax scale). Tests:
//! engine/tests/target_model.rs (`naive_equals_absorbed`, tree/chain, TP partials).
//!
//! Letters: T new nodes, S visible rows (committed prefix + ancestors + self), Hr heads of a rank,
//! C kv_lora, P rope dims, Dn nope dims, Dv v dims.

use super::cache::{LatentCache, TreeMask};
use super::weights::{Attn, ModelConfig};
use crate::cpu::ops;

/// Which MLA form the forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnMode {
    /// Expand latents through kv_b (transformers' form).
    #[default]
    Naive,
    /// Weight-absorbed form over the latent cache.
    Absorbed,
}

/// Attention output `[T, H]` (after o_proj, ranks summed) for normed input `x` `[T, H]`; appends the T
/// nodes' latent rows to layer `l` of `cache` as scratch. `positions[i]` is node i's absolute position.
#[allow(clippy::too_many_arguments)]
pub fn mla(
    cfg: &ModelConfig,
    w: &Attn,
    l: usize,
    x: &[f32],
    mask: &TreeMask,
    positions: &[usize],
    cache: &mut LatentCache,
    mode: AttnMode,
) -> Vec<f32> {
    let (t, h, c, p) = (mask.n, cfg.hidden, cfg.kv_lora, cfg.rope);
    let (dn, dv, qk) = (cfg.nope, cfg.v_dim, cfg.qk_head_dim());
    let cos_sin: Vec<(Vec<f32>, Vec<f32>)> =
        positions.iter().map(|&pos| ops::rope_cos_sin(&cfg.inv_freq, pos, cfg.rope_attention_factor)).collect();

    // Query input: normed q_a latent [T, q_lora], or x itself when q_lora_rank is None.
    let q_in = match &w.q_a {
        Some((q_a, q_norm)) => ops::rms_norm(&q_a.matmul(x, t), q_norm, cfg.latent_eps),
        None => x.to_vec(),
    };

    // New latent rows [T, C + P]: rms_norm(c_kv) | rope(k_pe).
    let ckv = w.kv_a.matmul(x, t); // [T, C + P]
    let mut rows = vec![0f32; t * (c + p)];
    for i in 0..t {
        let src = &ckv[i * (c + p)..(i + 1) * (c + p)];
        let dst = &mut rows[i * (c + p)..(i + 1) * (c + p)];
        dst[..c].copy_from_slice(&ops::rms_norm(&src[..c], &w.kv_a_norm, cfg.latent_eps));
        dst[c..].copy_from_slice(&src[c..]);
        ops::rope_interleaved(&mut dst[c..], &cos_sin[i].0, &cos_sin[i].1);
    }
    cache.append(l, &rows);
    let committed = cache.committed;
    let lat = &cache.rows[l]; // [committed + T, C + P]

    let mut out = vec![0f32; t * h]; // [T, H], ranks summed in order
    for rw in &w.ranks {
        let hr = rw.q.rows / qk;
        let mut q = rw.q.matmul(&q_in, t); // [T, Hr * qk]: per head q_nope (Dn) | q_pe (P)
        for i in 0..t {
            for hh in 0..hr {
                let base = i * hr * qk + hh * qk + dn;
                ops::rope_interleaved(&mut q[base..base + p], &cos_sin[i].0, &cos_sin[i].1);
            }
        }
        let d = ops::MlaDims { heads: hr, nope: dn, rope: p, v: dv, kv_lora: c, scale: cfg.softmax_scale };
        let heads_out = match mode {
            AttnMode::Naive => {
                // k_nope | v of every cached row, [S_all, Hr * (Dn + Dv)].
                let n_all = committed + t;
                let latents: Vec<f32> = lat.chunks(c + p).take(n_all).flat_map(|r| r[..c].to_vec()).collect();
                let expanded = rw.kv_b.matmul(&latents, n_all);
                ops::mla_attention(&d, &q, lat, committed, mask, ops::MlaKv::Expanded(&expanded))
            }
            AttnMode::Absorbed => ops::mla_attention(&d, &q, lat, committed, mask, ops::MlaKv::Absorbed(&rw.kv_b.w)),
        }; // [T, Hr * Dv]
        let part = rw.o_proj.matmul(&heads_out, t); // [T, H]
        ops::add_assign(&mut out, &part);
    }
    out
}
