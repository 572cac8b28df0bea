//! The feed-forward half of a layer, written once against `backend::Backend`: dense SwiGLU (layers <
//! first_k_dense_replace) and the MoE (noaux_tc sigmoid router with group-limited selection, INT4 routed
//! experts, shared expert), each computed per TP/EP rank and reduced over ranks in rank order
//! (`Backend::all_reduce`). The router runs once with rank 0's replicated gate.
//!
//! Must match: k26-format §4.5-§4.6 and transformers `DeepseekV3MoE`: the router decision is
//! cpu::ops::moe_route, the routed experts cpu::ops::moe_experts_i4g32 (per token in ascending expert id),
//! then the shared expert is added. Tests: the ops' own (router groups and ties, expert order) and
//! engine/tests/target_model.rs (`tp_and_ep_plans_agree`), engine/tests/target_reference.rs (f64 spec).

use super::trace::Trace;
use super::weights::{Ffn, Mlp, Weights};
use crate::backend::{Backend, Cols};

/// Per-rank SwiGLU partial `down(silu(gate x) ⊙ up x)` `[T, H]`, `x` made ready for the linears once; gate and
/// up as one linear (stacked at load), or their blocks `gu` of a linear already run with them in it.
fn swiglu<B: Backend>(b: &B, m: &Mlp<B>, x: &B::LinIn, t: usize, gu: Option<(&B::Act, [Cols; 2])>) -> B::Act {
    let a = match gu {
        Some((y, [g, u])) => b.silu_mul_in_cols(y, g, u, t),
        None => {
            let y = b.linear_in_cat(x, t, &[&m.gate, &m.up]);
            let [g, u] = gate_up(b, m);
            b.silu_mul_in_cols(&y, g, u, t)
        }
    }; // [T, I/R]
    b.linear_in(&a, t, &m.down)
}

/// The gate and up blocks of a [gate | up] linear.
fn gate_up<B: Backend>(b: &B, m: &Mlp<B>) -> [Cols; 2] {
    let c = Cols::split(&[b.mat_rows(&m.gate), b.mat_rows(&m.up)]);
    [c[0], c[1]]
}

/// FFN output `[T, H]` of layer `l` for normed input `xi` `[T, H]`, made ready for the linears
/// ([`crate::backend::Compute::rms_norm_in`]): one conversion for the router, the experts and the shared expert.
/// The router and rank 0's shared gate and up run as one linear (stacked at load).
/// Records MoE router decisions under `layers.{l}.router.*`.
pub fn ffn<B: Backend>(w: &Weights<B>, l: usize, xi: &B::LinIn, t: usize, trace: Option<&mut Trace>) -> B::Act {
    let (b, cfg) = (&w.backend, &w.cfg);
    let Ffn::Moe(m0) = &w.ranks[0].layers[l].ffn else {
        let partials = w.ranks.iter().map(|rw| match &rw.layers[l].ffn {
            Ffn::Dense(m) => swiglu(b, m, xi, t, None),
            Ffn::Moe(_) => unreachable!("layer {l}: rank 0 is dense, every rank loads the same plan"),
        });
        return b.all_reduce(partials.collect());
    };
    // [T, E | I/R | I/R] f32: the logits (bf16 weights widened exactly, as weight.float()), then rank 0's shared
    // gate and up.
    let e = cfg.n_experts;
    let (y0, blocks) = match &m0.shared {
        Some(sh) => {
            let c = Cols::split(&[e, b.mat_rows(&sh.gate), b.mat_rows(&sh.up)]);
            (b.linear_in_cat(xi, t, &[&m0.router, &sh.gate, &sh.up]), c)
        }
        None => (b.linear_in(xi, t, &m0.router), Cols::split(&[e])),
    };
    let routes = b.moe_route_cols(&y0, blocks[0], t, &cfg.router(), m0.bias.as_ref());
    if let Some(tr) = trace {
        let (ids, wts) = b.routes_to_host(&routes);
        tr.i32(format!("layers.{l}.router.topk_ids"), &[t, cfg.top_k], ids);
        tr.f32(format!("layers.{l}.router.topk_weights"), &[t, cfg.top_k], &wts);
        let logits = b.cols(&y0, blocks[0].ld, 0, e, t);
        tr.f32(format!("layers.{l}.router.logits"), &[t, e], &b.to_host(&logits));
    }
    let partials = w.ranks.iter().enumerate().map(|(r, rw)| {
        let Ffn::Moe(m) = &rw.layers[l].ffn else {
            unreachable!("layer {l}: rank 0 is MoE, every rank loads the same plan")
        };
        // [T, H] this rank's routed experts, ascending id, then its shared-expert slice.
        let mut part = b.moe_experts(xi, t, cfg.hidden, &routes, &m.gate, &m.up, &m.down);
        if let Some(sh) = &m.shared {
            let gu = (r == 0).then(|| (&y0, [blocks[1], blocks[2]]));
            b.add(&mut part, &swiglu(b, sh, xi, t, gu));
        }
        part
    });
    b.all_reduce(partials.collect())
}
