//! The feed-forward half of a layer: dense SwiGLU (layers < first_k_dense_replace) and the MoE
//! (noaux_tc sigmoid router with group-limited selection, INT4 routed experts, shared expert), each computed
//! per TP/EP rank and summed over ranks in rank order, as an all-reduce would.
//!
//! Must match: k26-format §4.5-§4.6 and transformers `DeepseekV3MoE` / `DeepseekV3TopkRouter`:
//! router logits in f32; `s = sigmoid(logits)`; selection on `s + e_score_correction_bias`; groups scored
//! by the sum of their top-2 biased scores, non-selected groups' scores set to 0.0 (masked_fill 0.0, as
//! transformers); top-k with the lowest index first on ties; weights are the unbiased `s`, divided by
//! `sum + 1e-20` when norm_topk_prob, times routed_scaling_factor. Routed outputs are added per token in
//! ascending expert id (transformers loops experts in id order), then the shared expert is added.
//! Tests: engine/src/model/tests.rs (`router_groups_and_ties`, TP/EP partials).

use super::trace::Trace;
use super::weights::{Mlp, ModelConfig, Moe};
use crate::cpu::ops;

/// Per-rank SwiGLU partial `down(silu(gate x) ⊙ up x)` `[T, H]`.
fn swiglu(m: &Mlp, x: &[f32], t: usize) -> Vec<f32> {
    let a = ops::silu_mul(&m.gate.matmul(x, t), &m.up.matmul(x, t)); // [T, I/R]
    m.down.matmul(&a, t)
}

/// Dense MLP `[T, H]`: rank partials summed in rank order.
pub fn dense(ranks: &[Mlp], x: &[f32], t: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()]; // [T, H]
    for m in ranks {
        out.iter_mut().zip(swiglu(m, x, t)).for_each(|(a, b)| *a += b);
    }
    out
}

/// Router decision for one token: selected experts (selection order) and their final weights.
pub fn route(cfg: &ModelConfig, logits: &[f32], bias: Option<&[f32]>) -> (Vec<usize>, Vec<f32>) {
    let e = cfg.n_experts;
    let s: Vec<f32> = logits.iter().map(|&z| ops::sigmoid(z)).collect(); // [E]
    let mut sel: Vec<f32> = match bias {
        Some(b) => s.iter().zip(b).map(|(&a, &b)| a + b).collect(),
        None => s.clone(),
    };
    if cfg.n_group > 1 || cfg.topk_group < cfg.n_group {
        let gs = e / cfg.n_group;
        let group_scores: Vec<f32> = (0..cfg.n_group)
            .map(|g| {
                let grp = &sel[g * gs..(g + 1) * gs];
                ops::topk(grp, gs.min(2)).iter().fold(0f32, |a, &i| a + grp[i])
            })
            .collect();
        let keep = ops::topk(&group_scores, cfg.topk_group);
        for g in 0..cfg.n_group {
            if !keep.contains(&g) {
                sel[g * gs..(g + 1) * gs].iter_mut().for_each(|v| *v = 0.0);
            }
        }
    }
    let idx = ops::topk(&sel, cfg.top_k);
    let mut wts: Vec<f32> = idx.iter().map(|&i| s[i]).collect();
    if cfg.norm_topk_prob {
        let den = wts.iter().fold(0f32, |a, &v| a + v) + 1e-20;
        wts.iter_mut().for_each(|v| *v /= den);
    }
    wts.iter_mut().for_each(|v| *v *= cfg.routed_scaling);
    (idx, wts)
}

/// MoE output `[T, H]` for normed input `x` `[T, H]`. Records router decisions under `layers.{l}.router.*`.
pub fn moe(cfg: &ModelConfig, w: &Moe, l: usize, x: &[f32], t: usize, trace: Option<&mut Trace>) -> Vec<f32> {
    let (h, e) = (cfg.hidden, cfg.n_experts);
    let logits = w.router.matmul(x, t); // [T, E] f32 (bf16 weights widened exactly, as weight.float())
    let bias = w.bias.as_deref();
    let routes: Vec<(Vec<usize>, Vec<f32>)> = (0..t).map(|i| route(cfg, &logits[i * e..(i + 1) * e], bias)).collect();
    if let Some(tr) = trace {
        let k = cfg.top_k;
        tr.i32(format!("layers.{l}.router.topk_ids"), &[t, k], routes.iter().flat_map(|(ids, _)| ids.iter().map(|&i| i as i32)).collect());
        let wts: Vec<f32> = routes.iter().flat_map(|(_, w)| w.iter().copied()).collect();
        tr.f32(format!("layers.{l}.router.topk_weights"), &[t, k], &wts);
    }
    // Tokens (and their weight) per expert, ascending expert id.
    let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for (i, (ids, wts)) in routes.iter().enumerate() {
        for (&ex, &wt) in ids.iter().zip(wts) {
            per_expert[ex].push((i, wt));
        }
    }
    let mut out = vec![0f32; t * h]; // [T, H], ranks summed in order
    for r in 0..w.gate.len() {
        let mut part = vec![0f32; t * h]; // [T, H] this rank's routed experts, ascending id
        for (ex, toks) in per_expert.iter().enumerate() {
            if toks.is_empty() || !w.gate[r].holds(ex) {
                continue;
            }
            let xs: Vec<f32> = toks.iter().flat_map(|&(i, _)| x[i * h..(i + 1) * h].to_vec()).collect(); // [Te, H]
            let te = toks.len();
            let a = ops::silu_mul(&w.gate[r].matmul(ex, &xs, te), &w.up[r].matmul(ex, &xs, te)); // [Te, I_r]
            let y = w.down[r].matmul(ex, &a, te); // [Te, H]
            for (j, &(i, wt)) in toks.iter().enumerate() {
                for d in 0..h {
                    part[i * h + d] += y[j * h + d] * wt;
                }
            }
        }
        if let Some(sh) = w.shared.get(r) {
            part.iter_mut().zip(swiglu(sh, x, t)).for_each(|(a, b)| *a += b);
        }
        out.iter_mut().zip(&part).for_each(|(a, b)| *a += b);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testing::tiny_config;

    fn cfg(top_k: usize) -> ModelConfig {
        let mut t = tiny_config(Some(32)); // 8 experts, n_group 2, topk_group 1
        t.num_experts_per_tok = top_k;
        ModelConfig::from_text(&t, 1).unwrap()
    }
    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn router_groups_and_ties() {
        // Group 1 holds the single best expert (4), but group 0 has the larger top-2 sum (1.6 vs 1.1):
        // group 0 wins; experts 0 and 1 tie exactly, lowest index first.
        let s = [0.8f32, 0.8, 0.1, 0.1, 0.9, 0.2, 0.2, 0.2];
        let logits: Vec<f32> = s.iter().map(|&p| logit(p)).collect();
        let (ids, w) = route(&cfg(2), &logits, None);
        assert_eq!(ids, vec![0, 1]);
        assert!((w[0] - 2.827 / 2.0).abs() < 1e-6 && w[0] == w[1], "{w:?}");
    }

    #[test]
    fn router_bias_selects_but_does_not_weight_and_masked_groups_score_zero() {
        // All s = 0.5; the bias alone makes selection scores [.5,.4,-.1,-.2 | .3,.3,.1,0]. Group 0 wins
        // (0.9 vs 0.6); group 1 is masked to 0.0 (transformers masked_fill 0.0), which outranks the negative
        // scores of experts 2 and 3, so the third pick is expert 4 (lowest index among the zeros).
        let sel = [0.5f32, 0.4, -0.1, -0.2, 0.3, 0.3, 0.1, 0.0];
        let bias: Vec<f32> = sel.iter().map(|v| v - 0.5).collect();
        let (ids, w) = route(&cfg(3), &[0.0; 8], Some(&bias));
        assert_eq!(ids, vec![0, 1, 4]);
        for x in &w {
            assert!((x - 2.827 / 3.0).abs() < 1e-6, "weights use the unbiased sigmoid: {w:?}");
        }
    }
}
