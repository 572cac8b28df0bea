//! DFlash drafter (engine/src/drafter/) on a tiny random drafter held in memory:
//! * the draft does not depend on how the context was appended (one call of n rows, n calls of 1 row,
//!   uneven chunks) and leaves the context cache untouched;
//! * it matches a naive f64 reference written here from ddtree.md §1 that recomputes the context K/V
//!   and everything else from scratch on every call (own YaRN frequencies, rotate_half, GQA, no mask);
//! * attention inside the block is non-causal: the first returned row changes with the block size
//!   (a causal drafter's row 1 could not see later block positions).

use half::bf16;
use kdtree_engine::api::Drafter;
use kdtree_engine::drafter::{DFlashDrafter, DenseTables, DrafterDims, DrafterWeights, TargetTables};
use kdtree_formats::config::DrafterConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

mod drafter_common;

use drafter_common::{config, tables, weights, H, N_TAPS, V};

/// f32 drafter vs f64 reference, max |Δlogit|: measured 1.1e-6 over the 5 drafts below; ~20x margin.
const REF_TOL: f64 = 2e-5;

fn drafter(block: usize) -> DFlashDrafter {
    let cfg = config(block);
    let d = DrafterDims::from_config(&cfg).unwrap();
    DFlashDrafter::new(&cfg, weights(&d), Arc::new(tables())).unwrap()
}

fn taps(rows: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    (0..rows * N_TAPS * H).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

#[test]
fn draft_is_independent_of_context_chunking() {
    let (n, w) = (11, N_TAPS * H);
    let t = taps(n);
    let mut one = drafter(4);
    one.extend_context(&t, n).unwrap();
    let mut rows = drafter(4);
    for r in 0..n {
        rows.extend_context(&t[r * w..(r + 1) * w], 1).unwrap();
    }
    let mut uneven = drafter(4);
    for (a, b) in [(0, 3), (3, 3), (3, 10), (10, 11)] {
        uneven.extend_context(&t[a * w..b * w], b - a).unwrap();
    }
    let want = one.draft(7, n).unwrap();
    assert_eq!(want.len(), 3 * V);
    assert!(want.iter().all(|x| x.is_finite()));
    assert_eq!(rows.draft(7, n).unwrap(), want);
    assert_eq!(uneven.draft(7, n).unwrap(), want);
    // Drafting leaves the context alone: same answer twice, context length unchanged.
    assert_eq!(one.draft(7, n).unwrap(), want);
    assert_eq!(one.context_len(), n);
    assert_ne!(one.draft(8, n).unwrap(), want, "the bonus token must matter");
}

#[test]
fn draft_checks_its_start_and_reset_clears_the_context() {
    let mut d = drafter(4);
    d.extend_context(&taps(5), 5).unwrap();
    assert!(d.draft(1, 4).is_err());
    assert!(d.extend_context(&taps(5)[..10], 1).is_err());
    let with_ctx = d.draft(1, 5).unwrap();
    d.reset();
    assert_eq!(d.context_len(), 0);
    let empty = d.draft(1, 0).unwrap();
    assert_ne!(empty, with_ctx);
    d.extend_context(&taps(5), 5).unwrap();
    assert_eq!(d.draft(1, 5).unwrap(), with_ctx);
}

#[test]
fn block_attention_is_non_causal() {
    let t = taps(6);
    let (mut b4, mut b6) = (drafter(4), drafter(6));
    b4.extend_context(&t, 6).unwrap();
    b6.extend_context(&t, 6).unwrap();
    let (r4, r6) = (b4.draft(3, 6).unwrap(), b6.draft(3, 6).unwrap());
    assert_eq!((r4.len(), r6.len()), (3 * V, 5 * V));
    let diff = r4[..V]
        .iter()
        .zip(&r6[..V])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff > 1e-3, "row 1 must see later block positions (max diff {diff})");
}

// ---- naive f64 reference (ddtree.md §1.3-1.6) ----

fn f(x: bf16) -> f64 {
    x.to_f64()
}

fn lin(w: &[bf16], x: &[f64], out: usize) -> Vec<f64> {
    let k = x.len();
    (0..out).map(|o| (0..k).map(|i| f(w[o * k + i]) * x[i]).sum()).collect()
}

fn rms(x: &[f64], w: &[bf16], eps: f64) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * f(*g)).collect()
}

/// YaRN inverse frequencies (transformers `_compute_yarn_parameters`, truncate = true).
fn inv_freq(dim: usize, base: f64, factor: f64, orig: f64, beta_fast: f64, beta_slow: f64) -> Vec<f64> {
    let corr = |r: f64| dim as f64 * (orig / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    let low = corr(beta_fast).floor().max(0.0);
    let high = corr(beta_slow).ceil().min(dim as f64 - 1.0);
    (0..dim / 2)
        .map(|i| {
            let extra = base.powf(-((2 * i) as f64) / dim as f64);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            extra / factor * ramp + extra * (1.0 - ramp)
        })
        .collect()
}

fn rope(x: &mut [f64], pos: usize, freq: &[f64]) {
    let half = x.len() / 2;
    let orig = x.to_vec();
    for i in 0..half {
        let (c, s) = ((pos as f64 * freq[i]).cos(), (pos as f64 * freq[i]).sin());
        x[i] = orig[i] * c - orig[i + half] * s;
        x[i + half] = orig[i + half] * c + orig[i] * s;
    }
}

fn reference(
    cfg: &DrafterConfig,
    w: &DrafterWeights,
    t: &DenseTables,
    taps: &[f32],
    ctx: usize,
    bonus: u32,
) -> Vec<f64> {
    let (nh, nkv, hd, inter, eps) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.rms_norm_eps,
    );
    let b = cfg.block_size().unwrap();
    let rs = cfg.rope_scaling.as_ref().unwrap();
    let freq = inv_freq(
        hd,
        cfg.rope_theta,
        rs.factor,
        rs.original_max_position_embeddings as f64,
        rs.beta_fast,
        rs.beta_slow,
    );
    let w_taps = N_TAPS * H;
    let c: Vec<Vec<f64>> = (0..ctx)
        .map(|i| {
            rms(
                &lin(
                    &w.fc,
                    &taps[i * w_taps..(i + 1) * w_taps]
                        .iter()
                        .map(|&v| v as f64)
                        .collect::<Vec<_>>(),
                    H,
                ),
                &w.hidden_norm,
                eps,
            )
        })
        .collect();
    let ids: Vec<u32> = (0..b)
        .map(|j| if j == 0 { bonus } else { cfg.dflash_config.mask_token_id })
        .collect();
    let mut x: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| (0..H).map(|i| f(t.embed_tokens[id as usize * H + i])).collect())
        .collect();
    let heads = |v: Vec<f64>, n: usize, norm: &[bf16], pos: usize| -> Vec<Vec<f64>> {
        (0..n)
            .map(|h| {
                let mut e = rms(&v[h * hd..(h + 1) * hd], norm, eps);
                rope(&mut e, pos, &freq);
                e
            })
            .collect()
    };
    for l in &w.layers {
        let hn: Vec<Vec<f64>> = x.iter().map(|r| rms(r, &l.input_layernorm, eps)).collect();
        // keys/values: context rows at positions 0..ctx, then block rows at ctx..ctx+b
        let mut keys = Vec::new();
        let mut vals = Vec::new();
        for (p, src) in c.iter().chain(hn.iter()).enumerate() {
            keys.push(heads(lin(&l.k_proj, src, nkv * hd), nkv, &l.k_norm, p));
            vals.push(lin(&l.v_proj, src, nkv * hd));
        }
        for j in 0..b {
            let q = heads(lin(&l.q_proj, &hn[j], nh * hd), nh, &l.q_norm, ctx + j);
            let mut att = vec![0.0; nh * hd];
            for h in 0..nh {
                let g = h / (nh / nkv);
                let s: Vec<f64> = keys
                    .iter()
                    .map(|k| q[h].iter().zip(&k[g]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for (p, sv) in s.iter().enumerate() {
                    for d in 0..hd {
                        att[h * hd + d] += (sv - m).exp() / z * vals[p][g * hd + d];
                    }
                }
            }
            let o = lin(&l.o_proj, &att, H);
            x[j].iter_mut().zip(o).for_each(|(a, d)| *a += d);
        }
        for r in x.iter_mut() {
            let h2 = rms(r, &l.post_attention_layernorm, eps);
            let (g, u) = (lin(&l.gate_proj, &h2, inter), lin(&l.up_proj, &h2, inter));
            let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            r.iter_mut().zip(lin(&l.down_proj, &a, H)).for_each(|(a, d)| *a += d);
        }
    }
    x[1..]
        .iter()
        .flat_map(|r| lin(&t.lm_head, &rms(r, &w.norm, eps), V))
        .collect()
}

#[test]
fn draft_matches_a_naive_from_scratch_reference() {
    let cfg = config(5);
    let dims = DrafterDims::from_config(&cfg).unwrap();
    let (w, t) = (weights(&dims), tables());
    let mut d = DFlashDrafter::new(&cfg, weights(&dims), Arc::new(tables())).unwrap();
    assert_eq!(d.rope_attention_factor(), 1.0);
    let all = taps(23);
    let mut ctx = 0;
    // Grow the context over several rounds, as the generation loop does, and compare every draft.
    for (step, add) in [7usize, 1, 4, 0, 11].into_iter().enumerate() {
        d.extend_context(&all[ctx * N_TAPS * H..(ctx + add) * N_TAPS * H], add)
            .unwrap();
        ctx += add;
        let bonus = (step * 7 % V) as u32;
        let got = d.draft(bonus, ctx).unwrap();
        let want = reference(&cfg, &w, &t, &all, ctx, bonus);
        assert_eq!(got.len(), want.len());
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        eprintln!("step {step} ctx {ctx}: max |dlogit| {err:e}");
        assert!(
            err < REF_TOL,
            "step {step} (ctx {ctx}): max |Δlogit| {err:e} > {REF_TOL:e}"
        );
        let spread = want.iter().cloned().fold(f64::MIN, f64::max) - want.iter().cloned().fold(f64::MAX, f64::min);
        assert!(spread > 0.1, "logits too flat to be a meaningful comparison: {spread}");
    }
    let _ = t.vocab_size();
}

#[test]
fn mask_token_outside_the_vocabulary_is_a_config_error() {
    // vocab_size 40: mask ids 40 and 1000 are outside it; 39 (the last id) is fine.
    for bad in [V as u32, 1000] {
        let mut cfg = config(4);
        cfg.dflash_config.mask_token_id = bad;
        let err = DrafterDims::from_config(&cfg)
            .expect_err("out-of-vocab mask_token_id must be refused")
            .to_string();
        assert!(
            err.contains(&format!("mask_token_id {bad}")) && err.contains(&format!("vocab_size {V}")),
            "{err}"
        );
    }
    let mut cfg = config(4);
    cfg.dflash_config.mask_token_id = V as u32 - 1;
    assert!(DrafterDims::from_config(&cfg).is_ok());
}

/// A batch's flush of its drafters' stashes (one forward for many sessions, `DFlashDrafter::flush_batch`) writes
/// what each session's own flush writes, bit for bit on the CPU: 5 sessions, and 90 (2,404 stashed rows, more
/// than one forward of FLUSH_ROWS).
#[test]
fn a_batch_flush_equals_each_flush_alone() {
    let base = drafter(4);
    for n in [5, 90] {
        drafter_common::flush_batch_equals_each_flush(
            &base,
            &kdtree_engine::cpu::CpuBackend::default(),
            n,
            "cpu drafter",
        );
    }
}
