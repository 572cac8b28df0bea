//! Parity of the CUDA MLA absorbed attention (kernels/cuda/mla_attn.cu) against the absorbed branch of the
//! CPU model (engine/src/model/attention.rs: scores over the committed prefix plus the node's ancestors,
//! softmax, latent average), for decode (one node), causal prefill (a chain) and tree verification (random
//! trees up to 1024 nodes, so masks of 16 words). Seeded inputs, NaN-poisoned outputs.
//! STATUS: not yet run on a GPU (written after the 2026-12-01 session's device calls were spent).
#![cfg(feature = "cuda")]

mod cuda_common;

// CPU twins (one block, so the paths are easy to fix when engine/src/cpu/ops splits one op per file).
use kdtree_engine::cpu::ops::softmax;
use kdtree_engine::model::cache::TreeMask;

use cuda_common::*;
use half::bf16;
use kdtree_engine::cuda::ops;
use kdtree_engine::cuda::ops::mla_attn::{D, DL};
use rand::Rng;
use rayon::prelude::*;

/// bf16 output rounding (2^-8 of max |o|) plus f32 order and expf; not yet measured on a GPU.
const MLA_TOL: f64 = 5.0e-3;
/// K2.6 softmax scale, 192^-0.5 x mscale^2 (k26-format §4.3).
const SCALE: f32 = 0.144_679_63;

/// The absorbed branch of `model::attention::mla` for one (node, head): f32 dots in index order, the CPU
/// softmax, the latent average.
fn reference(q: &[f32], kv: &[f32], visible: &[usize]) -> Vec<f32> {
    let mut scores: Vec<f32> = visible
        .iter()
        .map(|&s| {
            let row = &kv[s * D..(s + 1) * D];
            let lat = q[..DL].iter().zip(&row[..DL]).fold(0f32, |a, (&x, &y)| a + x * y);
            let pe = q[DL..].iter().zip(&row[DL..]).fold(0f32, |a, (&x, &y)| a + x * y);
            (lat + pe) * SCALE
        })
        .collect();
    softmax(&mut scores);
    let mut o = vec![0f32; DL];
    for (&p, &s) in scores.iter().zip(visible) {
        for k in 0..DL {
            o[k] += p * kv[s * D + k];
        }
    }
    o
}

#[test]
fn mla_attn_parity() {
    let Some(g) = gpu() else { return };
    // (committed, nodes, heads, tree shape): decode, TP8 and full-head decode, chains (causal prefill),
    // random trees up to 1024 nodes.
    let cases = [
        (0, 1, 8, "chain"),
        (1000, 1, 64, "chain"),
        (4096, 1, 8, "chain"),
        (300, 16, 8, "tree"),
        (37, 100, 8, "tree"),
        (0, 512, 2, "chain"),
        (500, 1024, 1, "tree"),
        (64, 7, 13, "tree"),
    ];
    for (n, &(committed, t, h, shape)) in cases.iter().enumerate() {
        let mut r = rng(1500 + n as u64);
        let parents: Vec<i32> = (0..t as i32)
            .map(|j| {
                if shape == "chain" {
                    j - 1
                } else if j == 0 {
                    -1
                } else {
                    r.random_range(-1..j)
                }
            })
            .collect();
        let mask = TreeMask::from_parents(&parents).unwrap();
        let plan = ops::mla_attn::plan(&g, t, h, committed);
        let case =
            format!("mla_attn(committed={committed},nodes={t},heads={h},{shape},mask_words={}) [{} splits]", mask.words, plan.splits);
        let q = rand_bf16(&mut r, t * h * D, 0.01, 1.0);
        let kv = rand_bf16(&mut r, (committed + t) * D, 0.01, 1.0);
        let (dq, dkv, dm) = (g.upload(&q).unwrap(), g.upload(&kv).unwrap(), g.upload(&mask.bits).unwrap());
        let (lo, lm) = plan.workspace_lens(t, h);
        let mut op = g.upload(&nan_f32(lo)).unwrap();
        let mut ml = g.upload(&nan_f32(lm)).unwrap();
        let mut out = g.upload(&nan_bf16(t * h * DL)).unwrap();
        ops::mla_attn::mla_attn(
            &g,
            &dq.as_view(),
            &dkv.as_view(),
            &dm.as_view(),
            t,
            h,
            committed,
            mask.words,
            SCALE,
            &mut op.as_view_mut(),
            &mut ml.as_view_mut(),
            &mut out.as_view_mut(),
        )
        .unwrap();
        let got = g.download(&out).unwrap();
        let (qf, kvf) = (widen(&q), widen(&kv));
        let want: Vec<f32> = (0..t * h)
            .into_par_iter()
            .flat_map_iter(|ih| {
                let i = ih / h;
                let row = mask.row(i);
                let visible: Vec<usize> =
                    (0..committed).chain((0..t).filter(|&j| (row[j / 64] >> (j % 64)) & 1 == 1).map(|j| committed + j)).collect();
                reference(&qf[ih * D..(ih + 1) * D], &kvf, &visible)
            })
            .collect();
        check_bf16(&case, &got, &want, MLA_TOL);
    }
}

#[test]
fn mla_attn_rejects_a_short_mask() {
    let Some(g) = gpu() else { return };
    let q = g.upload(&vec![bf16::ONE; 100 * D]).unwrap();
    let kv = g.upload(&vec![bf16::ONE; 100 * D]).unwrap();
    let m = g.upload(&vec![0u64; 100]).unwrap();
    let mut o = g.upload(&vec![0f32; 1 << 20]).unwrap();
    let mut l = g.upload(&vec![0f32; 1 << 12]).unwrap();
    let mut out = g.upload(&vec![bf16::ZERO; 100 * DL]).unwrap();
    let e = ops::mla_attn::mla_attn(
        &g,
        &q.as_view(),
        &kv.as_view(),
        &m.as_view(),
        100,
        1,
        0,
        1,
        SCALE,
        &mut o.as_view_mut(),
        &mut l.as_view_mut(),
        &mut out.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("mla_attn") && e.contains("words=1") && e.contains("t=100"), "{e}");
}
