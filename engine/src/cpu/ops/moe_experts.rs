//! Routed-expert apply of one rank: for each expert this rank holds, in ascending expert id, gather its
//! tokens, run the INT4 SwiGLU `down(silu(gate x) ⊙ up x)` and add `weight · y` into each token's row
//! (transformers `DeepseekV3MoE.moe` loops experts in id order, so per-token sums follow that order).
//! Reference: a per-token loop over the same experts (test below, bit-identical by construction).
//!
//! Dimension letters: T tokens, H hidden, Te tokens of one expert, I expert width (of this rank).

use super::{matmul_i4g32, silu_mul};
use half::bf16;

/// One expert's INT4 group-32 matrix `[n, k]`: packed `[n, k/2]` u8, scales `[n, k/32]` bf16.
#[derive(Clone, Copy)]
pub struct ExpertI4<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [bf16],
    pub n: usize,
    pub k: usize,
}

impl ExpertI4<'_> {
    fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        matmul_i4g32(x, self.packed, self.scales, t, self.k, self.n)
    }
}

/// Tokens (and their router weight) per expert, ascending token index: `routes[i]` = token i's
/// (experts, weights).
pub fn tokens_per_expert(routes: &[(Vec<usize>, Vec<f32>)], n_experts: usize) -> Vec<Vec<(usize, f32)>> {
    let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n_experts];
    for (i, (ids, wts)) in routes.iter().enumerate() {
        for (&ex, &wt) in ids.iter().zip(wts) {
            per_expert[ex].push((i, wt));
        }
    }
    per_expert
}

/// This rank's routed partial `[T, H]` for `x` `[T, H]`: `experts(e)` gives expert e's
/// `[gate, up, down]` when this rank holds it (gate/up `[I, H]`, down `[H, I]`), else None.
pub fn moe_experts_i4g32<'a>(
    x: &[f32],
    t: usize,
    h: usize,
    per_expert: &[Vec<(usize, f32)>],
    experts: impl Fn(usize) -> Option<[ExpertI4<'a>; 3]>,
) -> Vec<f32> {
    assert_eq!(
        x.len(),
        t * h,
        "moe_experts_i4g32: x has {} elements, expected T={t} x H={h}",
        x.len()
    );
    let mut part = vec![0f32; t * h]; // [T, H]
    for (ex, toks) in per_expert.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let Some([gate, up, down]) = experts(ex) else { continue };
        let xs: Vec<f32> = toks.iter().flat_map(|&(i, _)| x[i * h..(i + 1) * h].to_vec()).collect(); // [Te, H]
        let te = toks.len();
        let a = silu_mul(&gate.matmul(&xs, te), &up.matmul(&xs, te)); // [Te, I]
        let y = down.matmul(&a, te); // [Te, H]
        for (j, &(i, wt)) in toks.iter().enumerate() {
            for d in 0..h {
                part[i * h + d] += y[j * h + d] * wt;
            }
        }
    }
    part
}

impl crate::backend::I4Stack {
    /// Global expert `e`'s `[n, k]` matrix (must be held).
    pub fn expert(&self, e: usize) -> ExpertI4<'_> {
        assert!(
            self.holds(e),
            "expert {e} not on this rank (holds {}..{})",
            self.first,
            self.first + self.count
        );
        let i = e - self.first;
        let (pb, sb) = (self.n * self.k / 2, self.n * self.k / 32);
        ExpertI4 {
            packed: &self.packed[i * pb..(i + 1) * pb],
            scales: &self.scales[i * sb..(i + 1) * sb],
            n: self.n,
            k: self.k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::*;
    use rand::Rng;

    #[test]
    fn equals_a_per_token_loop_and_skips_experts_not_held() {
        let mut rng = rng(12);
        let (t, h, i, e) = (4, 32, 64, 3);
        let x = rand_vec(&mut rng, t * h);
        let mut mk = |n: usize, k: usize| -> (Vec<u8>, Vec<bf16>) {
            (
                (0..n * k / 2).map(|_| rng.random::<u8>()).collect(),
                rand_bf16(&mut rng, n * k / 32),
            )
        };
        let mats: Vec<[(Vec<u8>, Vec<bf16>); 3]> = (0..e).map(|_| [mk(i, h), mk(i, h), mk(h, i)]).collect();
        let view = |ex: usize| -> [ExpertI4<'_>; 3] {
            let m = &mats[ex];
            [(0, i, h), (1, i, h), (2, h, i)].map(|(j, n, k)| ExpertI4 {
                packed: &m[j].0,
                scales: &m[j].1,
                n,
                k,
            })
        };
        let routes = vec![
            (vec![2, 0], vec![0.5, 0.25]),
            (vec![1, 2], vec![1.0, 2.0]),
            (vec![0, 1], vec![0.1, 0.2]),
            (vec![2, 1], vec![3.0, 0.5]),
        ];
        let per = tokens_per_expert(&routes, e);
        let got = moe_experts_i4g32(&x, t, h, &per, |ex| Some(view(ex)));
        // Per token, experts in ascending id, each y computed alone (a row of a matmul does not depend on
        // the other rows, so this is the same arithmetic).
        for tok in 0..t {
            let mut want = vec![0f32; h];
            let mut ids: Vec<(usize, f32)> = routes[tok]
                .0
                .iter()
                .copied()
                .zip(routes[tok].1.iter().copied())
                .collect();
            ids.sort_by_key(|p| p.0);
            for (ex, wt) in ids {
                let [g, u, d] = view(ex);
                let xs = &x[tok * h..(tok + 1) * h];
                let y = d.matmul(&silu_mul(&g.matmul(xs, 1), &u.matmul(xs, 1)), 1);
                want.iter_mut().zip(&y).for_each(|(a, b)| *a += b * wt);
            }
            assert_eq!(&got[tok * h..(tok + 1) * h], &want[..], "token {tok}");
        }
        // A rank holding only expert 1 contributes only expert 1's terms.
        let only1 = moe_experts_i4g32(&x, t, h, &per, |ex| (ex == 1).then(|| view(ex)));
        let zero_rows = (0..t)
            .filter(|&tok| only1[tok * h..(tok + 1) * h].iter().all(|&v| v == 0.0))
            .count();
        assert_eq!(
            zero_rows, 1,
            "only token 0 (experts 2 and 0) gets nothing from expert 1"
        );
    }
}
