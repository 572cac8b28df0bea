//! MLA attention core of one TP rank over the latent cache with an ancestor mask (tree verify): for each
//! new node i and head h, scores against every visible latent row (the committed prefix, then node i's
//! ancestors and itself), softmax, weighted sum of values. Two forms that must agree:
//! * **naive** (transformers `DeepseekV3Attention`): rows pre-expanded through kv_b into per-head
//!   `k_nope | v`; score `[q_nope | q_pe] · [k_nope | k_pe]`, weight v;
//! * **absorbed** (FlashMLA-style): `q_lat = W_UK_h^T q_nope` (kv_lora wide), score against the latent rows
//!   directly, average the latents, then apply W_UV_h.
//!
//! Must match: k26-format §4.3 (MLA, softmax scale). Tests: below (naive == absorbed, mask isolation) and
//! engine/tests/target_model.rs (`naive_equals_absorbed`, tree == chain).
//!
//! Letters: T new nodes, S visible rows, Hr heads of the rank, C kv_lora, P rope dims, Dn nope dims,
//! Dv v dims.

use super::{bf16_to_f32, softmax};
pub use crate::backend::MlaDims;
use crate::backend::Visibility;
use half::bf16;
use rayon::prelude::*;

/// What the values come from.
#[derive(Clone, Copy)]
pub enum MlaKv<'a> {
    /// Naive: every cached row expanded through kv_b, `[S_all, Hr·(Dn+Dv)]` f32.
    Expanded(&'a [f32]),
    /// Absorbed: kv_b of this rank, `[Hr·(Dn+Dv), C]` bf16.
    Absorbed(&'a [bf16]),
}

/// Sequential f32 dot product (fixed order).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |s, (&x, &y)| s + x * y)
}

/// Attention output `[T, Hr·Dv]` for roped queries `q` `[T, Hr·(Dn+P)]` (per head `q_nope | q_pe`) over
/// latent rows `lat` `[committed + T, C + P]` (`c_kv | k_pe`); node i sees rows `[0, committed)` and
/// `committed + j` for each j in `mask`'s row i.
pub fn mla_attention(
    d: &MlaDims,
    q: &[f32],
    lat: &[f32],
    committed: usize,
    mask: &Visibility,
    kv: MlaKv<'_>,
) -> Vec<f32> {
    let (t, hr, c, p, dn, dv) = (mask.rows, d.heads, d.kv_lora, d.rope, d.nope, d.v);
    let (qk, kvw, lw) = (dn + p, dn + dv, c + p);
    assert_eq!(
        q.len(),
        t * hr * qk,
        "mla_attention: q has {} values, expected T={t} x Hr={hr} x {qk}",
        q.len()
    );
    assert_eq!(
        lat.len(),
        (committed + t) * lw,
        "mla_attention: {} latent values, expected {} rows x {lw}",
        lat.len(),
        committed + t
    );
    let slot = |s: usize| &lat[s * lw..(s + 1) * lw];
    // Visible slots of each node: the committed prefix, then its ancestors and itself.
    let visible: Vec<Vec<usize>> = (0..t)
        .map(|i| {
            (0..committed)
                .chain(mask.visible_nodes(i).into_iter().map(|j| committed + j))
                .collect()
        })
        .collect();
    (0..t * hr)
        .into_par_iter()
        .flat_map_iter(|ih| {
            let (i, hh) = (ih / hr, ih % hr);
            let qh = &q[i * hr * qk + hh * qk..i * hr * qk + (hh + 1) * qk];
            let vis = &visible[i];
            let mut scores = vec![0f32; vis.len()]; // [S]
            let mut o = vec![0f32; dv]; // [Dv]
            match kv {
                MlaKv::Expanded(expanded) => {
                    for (si, &s) in vis.iter().enumerate() {
                        let e = &expanded[s * hr * kvw + hh * kvw..s * hr * kvw + (hh + 1) * kvw];
                        let score = dot(&qh[..dn], &e[..dn]) + dot(&qh[dn..], &slot(s)[c..]);
                        scores[si] = score * d.scale;
                    }
                    softmax(&mut scores);
                    for (si, &s) in vis.iter().enumerate() {
                        let v = &expanded[s * hr * kvw + hh * kvw + dn..s * hr * kvw + (hh + 1) * kvw];
                        for j in 0..dv {
                            o[j] += scores[si] * v[j];
                        }
                    }
                }
                MlaKv::Absorbed(kvb) => {
                    // q_lat[C] = W_UK_h^T q_nope: Σ_d q_nope[d] · kv_b[h·(Dn+Dv) + d, :].
                    let mut q_lat = vec![0f32; c];
                    for dd in 0..dn {
                        let wr = &kvb[(hh * kvw + dd) * c..(hh * kvw + dd + 1) * c];
                        for k in 0..c {
                            q_lat[k] += qh[dd] * bf16_to_f32(wr[k]);
                        }
                    }
                    for (si, &s) in vis.iter().enumerate() {
                        let row = slot(s);
                        scores[si] = (dot(&q_lat, &row[..c]) + dot(&qh[dn..], &row[c..])) * d.scale;
                    }
                    softmax(&mut scores);
                    let mut o_lat = vec![0f32; c]; // [C]
                    for (si, &s) in vis.iter().enumerate() {
                        let row = slot(s);
                        for k in 0..c {
                            o_lat[k] += scores[si] * row[k];
                        }
                    }
                    // o[j] = W_UV_h[j, :] · o_lat.
                    for (j, oj) in o.iter_mut().enumerate() {
                        let wr = &kvb[(hh * kvw + dn + j) * c..(hh * kvw + dn + j + 1) * c];
                        *oj = wr
                            .iter()
                            .zip(&o_lat)
                            .fold(0f32, |a, (&wv, &ov)| a + bf16_to_f32(wv) * ov);
                    }
                }
            }
            o
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::super::matmul_bf16;
    use super::*;

    fn case(seed: u64) -> (MlaDims, Vec<f32>, Vec<f32>, Vec<bf16>, Vec<f32>) {
        let d = MlaDims {
            heads: 2,
            nope: 4,
            rope: 2,
            v: 3,
            kv_lora: 8,
            scale: 0.4,
        };
        let (committed, t) = (3, 4);
        let mut rng = rng(seed);
        let q = rand_vec(&mut rng, t * d.heads * (d.nope + d.rope));
        let lat = rand_vec(&mut rng, (committed + t) * (d.kv_lora + d.rope));
        let kvb = rand_bf16(&mut rng, d.heads * (d.nope + d.v) * d.kv_lora);
        let latents: Vec<f32> = lat
            .chunks(d.kv_lora + d.rope)
            .flat_map(|r| r[..d.kv_lora].to_vec())
            .collect();
        let expanded = matmul_bf16(&latents, &kvb, committed + t, d.kv_lora, d.heads * (d.nope + d.v));
        (d, q, lat, kvb, expanded)
    }

    #[test]
    fn naive_equals_absorbed_and_the_mask_isolates_branches() {
        let (d, q, mut lat, kvb, expanded) = case(13);
        let mask = Visibility::from_parents(&[-1, 0, 0, 1]).unwrap();
        let a = mla_attention(&d, &q, &lat, 3, &mask, MlaKv::Expanded(&expanded));
        let b = mla_attention(&d, &q, &lat, 3, &mask, MlaKv::Absorbed(&kvb));
        let err = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(err < 1e-5, "naive vs absorbed max abs {err}");
        // Node 2 (child of 0) does not see node 1 or 3: changing their rows leaves node 2's output alone,
        // and node 3's (child of 1) changes.
        let lw = d.kv_lora + d.rope;
        for s in [3 + 1, 3 + 3] {
            lat[s * lw..(s + 1) * lw].iter_mut().for_each(|v| *v += 0.5);
        }
        let b2 = mla_attention(&d, &q, &lat, 3, &mask, MlaKv::Absorbed(&kvb));
        let w = d.heads * d.v;
        assert_eq!(&b2[2 * w..3 * w], &b[2 * w..3 * w]);
        assert_eq!(&b2[..w], &b[..w]);
        assert_ne!(&b2[3 * w..], &b[3 * w..]);
    }
}
