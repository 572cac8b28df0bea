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
