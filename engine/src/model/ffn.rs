//! The feed-forward half of a layer: dense SwiGLU (layers < first_k_dense_replace) and the MoE
//! (noaux_tc sigmoid router with group-limited selection, INT4 routed experts, shared expert), each computed
//! per TP/EP rank and summed over ranks in rank order, as an all-reduce would.
//!
//! Must match: k26-format §4.5-§4.6 and transformers `DeepseekV3MoE`: the router decision is
//! cpu::ops::moe_route, the routed experts cpu::ops::moe_experts_i4g32 (per token in ascending expert id),
//! then the shared expert is added. Tests: the ops' own (router groups and ties, expert order) and
//! engine/tests/target_model.rs (`tp_and_ep_plans_agree`), engine/tests/target_reference.rs (f64 spec).

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
    let partials: Vec<Vec<f32>> = ranks.iter().map(|m| swiglu(m, x, t)).collect(); // R x [T, H]
    ops::all_reduce_sum(&partials, x.len())
}

/// MoE output `[T, H]` for normed input `x` `[T, H]`. Records router decisions under `layers.{l}.router.*`.
pub fn moe(cfg: &ModelConfig, w: &Moe, l: usize, x: &[f32], t: usize, trace: Option<&mut Trace>) -> Vec<f32> {
    let (h, e) = (cfg.hidden, cfg.n_experts);
    let logits = w.router.matmul(x, t); // [T, E] f32 (bf16 weights widened exactly, as weight.float())
    let bias = w.bias.as_deref();
    let router = cfg.router();
    let routes: Vec<(Vec<usize>, Vec<f32>)> = (0..t).map(|i| ops::moe_route(&router, &logits[i * e..(i + 1) * e], bias)).collect();
    if let Some(tr) = trace {
        let k = cfg.top_k;
        tr.i32(format!("layers.{l}.router.topk_ids"), &[t, k], routes.iter().flat_map(|(ids, _)| ids.iter().map(|&i| i as i32)).collect());
        let wts: Vec<f32> = routes.iter().flat_map(|(_, w)| w.iter().copied()).collect();
        tr.f32(format!("layers.{l}.router.topk_weights"), &[t, k], &wts);
    }
    let per_expert = ops::tokens_per_expert(&routes, e); // ascending expert id
    let mut partials = Vec::with_capacity(w.gate.len());
    for r in 0..w.gate.len() {
        // [T, H] this rank's routed experts, ascending id, then its shared-expert slice.
        let (g, u, d) = (&w.gate[r], &w.up[r], &w.down[r]);
        let mut part = ops::moe_experts_i4g32(x, t, h, &per_expert, |ex| {
            g.holds(ex).then(|| [g.expert(ex), u.expert(ex), d.expert(ex)])
        });
        if let Some(sh) = w.shared.get(r) {
            ops::add_assign(&mut part, &swiglu(sh, x, t));
        }
        partials.push(part);
    }
    ops::all_reduce_sum(&partials, t * h)
}
