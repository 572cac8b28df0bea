//! Non-causal grouped-query attention of the DFlash drafter's block over `[context ; block]` (ddtree.md
//! §1, z-lab `dflash/model.py`): every block query sees every committed context row and every block row.
//! Scores `q·k · D^-0.5`, softmax and the weighted sum of values run over the C + B rows in that order.
//! Reference: engine/tests/ddtree_drafter.rs (`draft_matches_a_naive_from_scratch_reference`, non-causality);
//! test below (a row split between context and block gives the same output).
//!
//! Letters: B block rows, C context rows, Hq query heads, Hk kv heads, D head_dim.

use super::softmax;
use rayon::prelude::*;

/// `q` `[B, Hq·D]` over context `kc`/`vc` `[C, Hk·D]` then block `kb`/`vb` `[B, Hk·D]`. Returns `[B, Hq·D]`.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention(
    q: &[f32],
    b: usize,
    (kc, vc): (&[f32], &[f32]),
    (kb, vb): (&[f32], &[f32]),
    heads: usize,
    kv_heads: usize,
    dd: usize,
) -> Vec<f32> {
    let (qw, kw) = (heads * dd, kv_heads * dd);
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads),
        "gqa_attention: {heads} heads not a multiple of {kv_heads} kv heads"
    );
    assert_eq!(
        q.len(),
        b * qw,
        "gqa_attention: q has {} values, expected B={b} x {qw}",
        q.len()
    );
    let nc = kc.len() / kw;
    let group = heads / kv_heads;
    let scale = (dd as f32).powf(-0.5);
    let mut out = vec![0f32; b * qw];
    out.par_chunks_mut(dd).enumerate().for_each(|(idx, o)| {
        let (t, hq) = (idx / heads, idx % heads);
        let hk = hq / group;
        let qv = &q[t * qw + hq * dd..t * qw + (hq + 1) * dd];
        let head = |r: usize| r * kw + hk * dd..r * kw + (hk + 1) * dd; // head hk of row r
        let dot = |kv: &[f32]| qv.iter().zip(kv).fold(0f32, |a, (x, y)| a + x * y) * scale;
        let mut s: Vec<f32> = (0..nc)
            .map(|j| dot(&kc[head(j)]))
            .chain((0..b).map(|j| dot(&kb[head(j)])))
            .collect();
        softmax(&mut s);
        for (j, &p) in s.iter().enumerate() {
            let vv = if j < nc { &vc[head(j)] } else { &vb[head(j - nc)] };
            for (oi, &vi) in o.iter_mut().zip(vv) {
                *oi += p * vi;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::*;

    #[test]
    fn matches_an_f64_loop_over_context_then_block() {
        let (b, hq, hk, d, c) = (3, 4, 2, 4, 2);
        let mut rng = rng(21);
        let q = rand_vec(&mut rng, b * hq * d);
        let (kc, vc) = (rand_vec(&mut rng, c * hk * d), rand_vec(&mut rng, c * hk * d));
        let (kb, vb) = (rand_vec(&mut rng, b * hk * d), rand_vec(&mut rng, b * hk * d));
        let got = gqa_attention(&q, b, (&kc, &vc), (&kb, &vb), hq, hk, d);
        let keys: Vec<f32> = kc.iter().chain(&kb).copied().collect(); // [C + B, Hk*D]
        let vals: Vec<f32> = vc.iter().chain(&vb).copied().collect();
        let mut want = vec![0f64; b * hq * d];
        for t in 0..b {
            for h in 0..hq {
                let g = h / (hq / hk);
                let qv = &q[(t * hq + h) * d..(t * hq + h + 1) * d];
                let s: Vec<f64> = (0..c + b)
                    .map(|j| {
                        (0..d)
                            .map(|i| qv[i] as f64 * keys[(j * hk + g) * d + i] as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for j in 0..c + b {
                    for i in 0..d {
                        want[(t * hq + h) * d + i] += (s[j] - m).exp() / z * vals[(j * hk + g) * d + i] as f64;
                    }
                }
            }
        }
        let err = max_rel(&got, &want);
        assert!(err < 1e-5, "gqa_attention rel err {err}");
    }
}
