//! The MoE router decision of one token: noaux_tc sigmoid scoring with group-limited selection.
//!
//! Must match k26-format §4.5-§4.6 and transformers `DeepseekV3TopkRouter`: `s = sigmoid(logits)` (f32);
//! selection on `s + e_score_correction_bias`; groups scored by the sum of their top-2 biased scores,
//! non-selected groups' scores set to 0.0 (masked_fill 0.0, as transformers); top-k with the lowest index
//! first on ties; weights are the unbiased `s`, divided by `sum + 1e-20` when norm_topk_prob, times
//! routed_scaling_factor. Tests below (group choice, ties, bias selects but does not weight).
//!
//! Dimension letters: E experts.

use super::sigmoid;
pub use crate::backend::Router;
use crate::sampling::top_k;

/// The `k` best indices (value desc, lowest index on ties; the engine's one top-K) as usize.
fn best(x: &[f32], k: usize) -> Vec<usize> {
    top_k(x, k).into_iter().map(|i| i as usize).collect()
}

/// Selected experts (selection order) and their final weights for one token's router `logits` `[E]`
/// (f32, bf16 gate weights widened exactly, as `weight.float()`); `bias` `[E]` when noaux_tc.
pub fn moe_route(r: &Router, logits: &[f32], bias: Option<&[f32]>) -> (Vec<usize>, Vec<f32>) {
    let (s, sel, _) = selection(r, logits, bias);
    let idx = best(&sel, r.top_k);
    let mut wts: Vec<f32> = idx.iter().map(|&i| s[i]).collect();
    if r.norm_topk_prob {
        let den = wts.iter().fold(0f32, |a, &v| a + v) + 1e-20;
        wts.iter_mut().for_each(|v| *v /= den);
    }
    wts.iter_mut().for_each(|v| *v *= r.routed_scaling);
    (idx, wts)
}

/// How far one token's decision is from changing: the smallest score difference that decides it, i.e.
/// the last selected expert's selection score minus the best unselected one's and, with group-limited
/// selection, the last kept group's score minus the best dropped group's. A decision whose margin is below
/// the router's logit error (another engine's bf16 forward) may come out with another expert set there: a
/// route flip (`kdtree-golden --score` reports it per position). Infinite when nothing competes.
pub fn route_margin(r: &Router, logits: &[f32], bias: Option<&[f32]>) -> f32 {
    let (_, sel, groups) = selection(r, logits, bias);
    let idx = best(&sel, r.top_k);
    let last = idx.last().map_or(f32::INFINITY, |&i| sel[i]);
    let rest = (0..sel.len())
        .filter(|i| !idx.contains(i))
        .map(|i| sel[i])
        .fold(f32::NEG_INFINITY, f32::max);
    let mut m = last - rest;
    if let Some(g) = groups {
        let keep = best(&g, r.topk_group);
        let lastg = keep.last().map_or(f32::INFINITY, |&i| g[i]);
        let restg = (0..g.len())
            .filter(|i| !keep.contains(i))
            .map(|i| g[i])
            .fold(f32::NEG_INFINITY, f32::max);
        m = m.min(lastg - restg);
    }
    m
}

/// (sigmoid scores, selection scores after the bias and the group mask, group scores when groups limit
/// the selection) of one token.
fn selection(r: &Router, logits: &[f32], bias: Option<&[f32]>) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let e = r.n_experts;
    assert_eq!(logits.len(), e, "moe_route: {} logits for {e} experts", logits.len());
    let s: Vec<f32> = logits.iter().map(|&z| sigmoid(z)).collect(); // [E]
    let mut sel: Vec<f32> = match bias {
        Some(b) => s.iter().zip(b).map(|(&a, &b)| a + b).collect(),
        None => s.clone(),
    };
    let mut groups = None;
    if r.n_group > 1 || r.topk_group < r.n_group {
        let gs = e / r.n_group;
        let group_scores: Vec<f32> = (0..r.n_group)
            .map(|g| {
                let grp = &sel[g * gs..(g + 1) * gs];
                best(grp, gs.min(2)).iter().fold(0f32, |a, &i| a + grp[i])
            })
            .collect();
        let keep = best(&group_scores, r.topk_group);
        for g in 0..r.n_group {
            if !keep.contains(&g) {
                sel[g * gs..(g + 1) * gs].iter_mut().for_each(|v| *v = 0.0);
            }
        }
        groups = Some(group_scores);
    }
    (s, sel, groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny test model's router (8 experts, n_group 2, topk_group 1).
    fn router(top_k: usize) -> Router {
        Router {
            n_experts: 8,
            n_group: 2,
            topk_group: 1,
            top_k,
            norm_topk_prob: true,
            routed_scaling: 2.827,
        }
    }
    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn route_margin_is_the_deciding_difference() {
        // Selection 0.9, 0.8 | 0.3, 0.1 with top-2 from one group of 4: margin 0.8 - 0.3; a tie is margin 0.
        let r = Router {
            n_experts: 4,
            n_group: 1,
            topk_group: 1,
            top_k: 2,
            norm_topk_prob: true,
            routed_scaling: 1.0,
        };
        let lg: Vec<f32> = [0.9f32, 0.8, 0.3, 0.1].iter().map(|&p| logit(p)).collect();
        assert!((route_margin(&r, &lg, None) - 0.5).abs() < 1e-5);
        let tie: Vec<f32> = [0.9f32, 0.8, 0.8, 0.1].iter().map(|&p| logit(p)).collect();
        assert_eq!(route_margin(&r, &tie, None), 0.0);
        // Groups: group 0's top-2 sum 1.6 vs group 1's 1.1 decide by 0.5 unless experts do by less.
        let g = router(2);
        let lg8: Vec<f32> = [0.8f32, 0.8, 0.1, 0.1, 0.9, 0.2, 0.2, 0.2]
            .iter()
            .map(|&p| logit(p))
            .collect();
        let m = route_margin(&g, &lg8, None);
        assert!((m - 0.5).abs() < 1e-5, "{m}");
    }

    #[test]
    fn router_groups_and_ties() {
        // Group 1 holds the single best expert (4), but group 0 has the larger top-2 sum (1.6 vs 1.1):
        // group 0 wins; experts 0 and 1 tie exactly, lowest index first.
        let s = [0.8f32, 0.8, 0.1, 0.1, 0.9, 0.2, 0.2, 0.2];
        let logits: Vec<f32> = s.iter().map(|&p| logit(p)).collect();
        let (ids, w) = moe_route(&router(2), &logits, None);
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
        let (ids, w) = moe_route(&router(3), &[0.0; 8], Some(&bias));
        assert_eq!(ids, vec![0, 1, 4]);
        for x in &w {
            assert!(
                (x - 2.827 / 3.0).abs() < 1e-6,
                "weights use the unbiased sigmoid: {w:?}"
            );
        }
    }
}
