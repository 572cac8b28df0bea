//! Parity of the CUDA elementwise, norm, rope, gather, argmax and MoE-routing ops against their CPU twins
//! (kernels/README.md is the index). Random seeded inputs (never zeros; the seed is printed), outputs
//! NaN-poisoned before launch, max abs and rel (max abs / max |reference|) error against the named
//! tolerances below; exact ops (embedding gather, argmax, router ids, align lists) compare bit for bit.
//! Needs a GPU: skips without one unless KDTREE_REQUIRE_GPU=1. Run: scripts/gpu-test.sh.
#![cfg(feature = "cuda")]

mod cuda_common;

// CPU twins (one block, so the paths are easy to fix when engine/src/cpu/ops splits one op per file).
use kdtree_engine::cpu::ops::{moe_route, Router};
use kdtree_engine::cpu::ops::{rms_norm, rope_cos_sin, rope_interleaved, silu_mul, yarn_inv_freq};
use kdtree_engine::sampling::argmax;

use cuda_common::*;
use half::bf16;
use kdtree_engine::cuda::ops;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::Rng;

/// One bf16 rounding of the output: half an ulp, at most 2^-8 of max |y| (3.9e-3, the bound). Measured on
/// the H200 (2026-12-01, one seed per case): silu_mul max 3.5e-3, rope 2.9e-3, residual_add 2.0e-3.
const BF16_OUT_TOL: f64 = 4.0e-3;
/// RMSNorm: bf16 output rounding plus a different f32 summation order of the mean of squares. Measured:
/// max 3.5e-3 over 5 cases; bound 3.9e-3 + order.
const RMS_NORM_TOL: f64 = 4.5e-3;
/// Router weights: sigmoid through expf (<= 2 ulp) vs Rust's exp; ids must match exactly. Measured: max
/// 8.3e-8 over 5 cases (ids identical in all); 12x.
const ROUTER_WEIGHT_TOL: f64 = 1.0e-6;

#[test]
fn rms_norm_parity() {
    let Some(g) = gpu() else { return };
    // (rows, h, ld_x): 576-wide rows with the 512 latent normalised (kv_a_layernorm) and K2.6 hidden 7168.
    for (i, &(rows, h, ld)) in [
        (1, 64, 64),
        (7, 7168, 7168),
        (33, 512, 576),
        (3, 1536, 1536),
        (2, 100, 100),
    ]
    .iter()
    .enumerate()
    {
        let case = format!("rms_norm(rows={rows},h={h},ld_x={ld},bf16)");
        let mut r = rng(100 + i as u64);
        let x = rand_bf16(&mut r, rows * ld, 0.01, 2.0);
        let w = rand_bf16(&mut r, h, 0.5, 1.5);
        let dx = g.upload(&x).unwrap();
        let dw = g.upload(&w).unwrap();
        let mut dy = g.upload(&nan_bf16(rows * h)).unwrap();
        ops::rms_norm::rms_norm(
            &g,
            &dx.as_view(),
            &dw.as_view(),
            &mut dy.as_view_mut(),
            rows,
            h,
            ld,
            h,
            1e-5,
        )
        .unwrap();
        let got = g.download(&dy).unwrap();
        let xs: Vec<f32> = (0..rows).flat_map(|t| widen(&x[t * ld..t * ld + h])).collect();
        let want = rms_norm(&xs, &w, 1e-5);
        check_bf16(&case, &got, &want, RMS_NORM_TOL);
    }
}

/// The f32 RMSNorm of the forward (`act_f32::rms_norm_f32`): the register path (D % 4 == 0, aligned rows,
/// one round of loads: decode's single row) and the strided fallback, against the CPU twin in f32 (only the
/// sum-of-squares order differs: a few ulp).
#[test]
fn rms_norm_f32_parity() {
    let Some(g) = gpu() else { return };
    // (rows, h, ld_x, ld_y): K2.6 hidden at decode (1 row) and a tree, the 512-of-576 latent, q_lora 1536, a
    // width past the register path (32768: 1024 threads x 8 float4), an odd width and an odd stride (fallback).
    for (i, &(rows, h, ld, ldy)) in [
        (1, 7168, 7168, 7168),
        (17, 7168, 7168, 7168),
        (33, 512, 576, 512),
        (1, 1536, 1536, 1536),
        (2, 40000, 40000, 40000),
        (3, 100, 100, 100),
        (2, 64, 66, 64),
    ]
    .iter()
    .enumerate()
    {
        let case = format!("rms_norm_f32(rows={rows},h={h},ld_x={ld},ld_y={ldy})");
        let mut r = rng(150 + i as u64);
        let x = rand_f32(&mut r, rows * ld, -2.0, 2.0);
        let w = rand_bf16(&mut r, h, 0.5, 1.5);
        let dx = g.upload(&x).unwrap();
        let dw = g.upload(&w).unwrap();
        let mut dy = g.upload(&nan_f32(rows * ldy)).unwrap();
        ops::act_f32::rms_norm_f32(
            &g,
            &dx.as_view(),
            ld,
            &dw.as_view(),
            &mut dy.as_view_mut(),
            ldy,
            rows,
            1e-5,
        )
        .unwrap();
        let got: Vec<f32> = g
            .download(&dy)
            .unwrap()
            .chunks(ldy)
            .flat_map(|c| c[..h].to_vec())
            .collect();
        let xs: Vec<f32> = (0..rows).flat_map(|t| x[t * ld..t * ld + h].to_vec()).collect();
        check(&case, &got, &rms_norm(&xs, &w, 1e-5), 1e-5);
    }
}

/// The fused residual add + RMSNorm + bf16 conversion of the decoder layers (`act_f32::add_rms_norm_bf16`, and
/// `rms_norm_bf16_out` without the add) against the three kernels it replaces (`add_f32`, `rms_norm_f32`,
/// `f32_to_bf16`) on the same inputs: the sum written back to x and the bf16 output, bit for bit, on the register
/// path and the strided fallback (odd width, odd strides), at decode's one row and a prefill's many.
#[test]
fn add_rms_norm_bf16_equals_the_three_kernels() {
    let Some(g) = gpu() else { return };
    // (rows, h, ld): K2.6 hidden (decode, a tree, a prefill chunk's worth), q_lora, a width past the register path,
    // an odd width, an odd stride.
    for (i, &(rows, h, ld)) in [
        (1, 7168, 7168),
        (65, 7168, 7168),
        (4096, 7168, 7168),
        (3, 1536, 1536),
        (2, 40000, 40000),
        (5, 100, 100),
        (4, 64, 66),
    ]
    .iter()
    .enumerate()
    {
        let case = format!("add_rms_norm_bf16(rows={rows},h={h},ld={ld})");
        let mut r = rng(170 + i as u64);
        let x = rand_f32(&mut r, rows * ld, -2.0, 2.0);
        let a = rand_f32(&mut r, rows * ld, -1.0, 1.0);
        let w = rand_bf16(&mut r, h, 0.5, 1.5);
        let (da, dw) = (g.upload(&a).unwrap(), g.upload(&w).unwrap());
        // The three kernels.
        let mut dx3 = g.upload(&x).unwrap();
        ops::act_f32::add_f32(&g, &mut dx3.as_view_mut(), &da.as_view()).unwrap();
        let mut dn = g.upload(&nan_f32(rows * ld)).unwrap();
        ops::act_f32::rms_norm_f32(
            &g,
            &dx3.as_view(),
            ld,
            &dw.as_view(),
            &mut dn.as_view_mut(),
            ld,
            rows,
            1e-5,
        )
        .unwrap();
        let mut dy3 = g.upload(&nan_bf16(rows * ld)).unwrap();
        ops::act_f32::f32_to_bf16(&g, &dn.as_view(), &mut dy3.as_view_mut()).unwrap();
        // The fused one, and the norm alone on the sum.
        let mut dx1 = g.upload(&x).unwrap();
        let mut dy1 = g.upload(&nan_bf16(rows * ld)).unwrap();
        ops::act_f32::add_rms_norm_bf16(
            &g,
            &mut dx1.as_view_mut(),
            ld,
            (&da.as_view(), ld),
            &dw.as_view(),
            &mut dy1.as_view_mut(),
            ld,
            rows,
            1e-5,
        )
        .unwrap();
        let mut dy0 = g.upload(&nan_bf16(rows * ld)).unwrap();
        ops::act_f32::rms_norm_bf16_out(
            &g,
            &dx3.as_view(),
            ld,
            &dw.as_view(),
            &mut dy0.as_view_mut(),
            ld,
            rows,
            1e-5,
        )
        .unwrap();
        let cols = |v: Vec<bf16>| -> Vec<u16> {
            v.chunks(ld)
                .flat_map(|c| c[..h].iter().map(|b| b.to_bits()).collect::<Vec<_>>())
                .collect()
        };
        let (x3, x1) = (g.download(&dx3).unwrap(), g.download(&dx1).unwrap());
        let xs = |v: &[f32]| -> Vec<u32> { v.chunks(ld).flat_map(|c| c[..h].iter().map(|f| f.to_bits())).collect() };
        assert_eq!(xs(&x1), xs(&x3), "{case}: the sums written back differ");
        let (y3, y1, y0) = (
            cols(g.download(&dy3).unwrap()),
            cols(g.download(&dy1).unwrap()),
            cols(g.download(&dy0).unwrap()),
        );
        assert_eq!(y1, y3, "{case}: fused output differs from the three kernels");
        assert_eq!(y0, y3, "{case}: the norm alone differs from rms_norm_f32 + f32_to_bf16");
        println!(
            "PARITY {case} exact (sum, fused output and the norm alone, {} values)",
            y1.len()
        );
    }
}

#[test]
fn rope_parity() {
    let Some(g) = gpu() else { return };
    let k26 = kdtree_formats::config::RopeScaling {
        kind: "yarn".into(),
        factor: 64.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 1.0,
    };
    let inv = yarn_inv_freq(64, 50000.0, Some(&k26));
    // (tokens, heads, ld_head, offset, ld_token): q [T, 64, 192] rope at 128; k_rope [T, 576] at 512.
    let layouts = [
        (5, 64, 192, 128, 64 * 192),
        (9, 1, 576, 512, 576),
        (3, 8, 192, 128, 8 * 192),
    ];
    for (i, &(t, heads, ld_head, offset, ld_token)) in layouts.iter().enumerate() {
        let case = format!("rope_interleaved(tokens={t},heads={heads},ld_head={ld_head},offset={offset},D=64,bf16)");
        let mut r = rng(200 + i as u64);
        let x = rand_bf16(&mut r, t * ld_token, 0.01, 2.0);
        let pos: Vec<i32> = (0..t).map(|_| r.random_range(0..200_000)).collect();
        let mut dx = g.upload(&x).unwrap();
        let dpos = g.upload(&pos).unwrap();
        let dinv = g.upload(&inv).unwrap();
        let l = ops::rope::RopeLayout {
            tokens: t,
            heads,
            ld_token,
            ld_head,
            offset,
            dim: 64,
        };
        ops::rope::rope_interleaved(&g, &mut dx.as_view_mut(), &dpos.as_view(), &dinv.as_view(), l, 1.0).unwrap();
        let got = g.download(&dx).unwrap();
        let mut want = widen(&x);
        for (tt, &p) in pos.iter().enumerate().take(t) {
            let (c, s) = rope_cos_sin(&inv, p as usize, 1.0);
            for h in 0..heads {
                let o = tt * ld_token + h * ld_head + offset;
                rope_interleaved(&mut want[o..o + 64], &c, &s);
            }
        }
        check_bf16(&case, &got, &want, BF16_OUT_TOL);
    }
}

#[test]
fn silu_mul_parity() {
    let Some(g) = gpu() else { return };
    // (rows, i, fused): fused = gate and up halves of one [rows, 2i] buffer. 131077 rows: the (token, slot) pairs of a
    // 16K-token prefill chunk on the K2.6 TP8 slice, past the grid's 65535 rows.
    for (n, &(rows, i, fused)) in [
        (1, 2048, true),
        (8, 256, false),
        (64, 18432 / 8, true),
        (3, 100, false),
        (131077, 256, true),
    ]
    .iter()
    .enumerate()
    {
        let case = format!("silu_mul(rows={rows},i={i},fused={fused},bf16)");
        let mut r = rng(300 + n as u64);
        let ld = if fused { 2 * i } else { i };
        let gu = rand_bf16(&mut r, rows * ld + if fused { 0 } else { rows * i }, 0.01, 6.0);
        let dgu = g.upload(&gu).unwrap();
        let mut dout = g.upload(&nan_bf16(rows * i)).unwrap();
        let (gate, up) = if fused {
            (dgu.slice(0..), dgu.slice(i..))
        } else {
            (dgu.slice(0..rows * i), dgu.slice(rows * i..))
        };
        ops::silu_mul::silu_mul(&g, &gate, &up, &mut dout.as_view_mut(), rows, i, ld).unwrap();
        let got = g.download(&dout).unwrap();
        let (mut gv, mut uv) = (Vec::new(), Vec::new());
        for t in 0..rows {
            let (go, uo) = if fused {
                (t * ld, t * ld + i)
            } else {
                (t * i, rows * i + t * i)
            };
            gv.extend(widen(&gu[go..go + i]));
            uv.extend(widen(&gu[uo..uo + i]));
        }
        check_bf16(&case, &got, &silu_mul(&gv, &uv), BF16_OUT_TOL);
    }
}

/// The fused SwiGLU to bf16 (`silu_mul_bf16`, the shared expert's and the drafter's down-projection input) gives the
/// bits of `silu_mul_f32` then `f32_to_bf16`, and the f32 form is within one rounding of the CPU twin.
#[test]
fn silu_mul_bf16_equals_silu_mul_f32_then_bf16() {
    let Some(g) = gpu() else { return };
    // A decode step's shared-expert slice (K2.6 TP8: 256), a dense layer's, an odd length, a 16K chunk's.
    for (n, &len) in [256usize, 18432 / 8, 1001, 16384 * 256].iter().enumerate() {
        let mut r = rng(330 + n as u64);
        let gate = rand_f32(&mut r, len, -8.0, 8.0);
        let up = rand_f32(&mut r, len, -3.0, 3.0);
        let (dg, du) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
        let mut f = g.upload(&nan_f32(len)).unwrap();
        ops::act_f32::silu_mul_f32(&g, &dg.as_view(), &du.as_view(), &mut f.as_view_mut()).unwrap();
        let mut two = g.upload(&nan_bf16(len)).unwrap();
        ops::act_f32::f32_to_bf16(&g, &f.as_view(), &mut two.as_view_mut()).unwrap();
        let mut one = g.upload(&nan_bf16(len)).unwrap();
        ops::act_f32::silu_mul_bf16(&g, &dg.as_view(), &du.as_view(), &mut one.as_view_mut()).unwrap();
        let bits = |v: Vec<bf16>| -> Vec<u16> { v.iter().map(|x| x.to_bits()).collect() };
        let (one, two) = (bits(g.download(&one).unwrap()), bits(g.download(&two).unwrap()));
        let differ = one.iter().zip(&two).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "silu_mul_bf16 (len {len}): {differ} of {len} differ from silu_mul_f32 + f32_to_bf16"
        );
        check(
            &format!("silu_mul_f32(len={len})"),
            &g.download(&f).unwrap(),
            &silu_mul(&gate, &up),
            1e-6,
        );
        println!("PARITY silu_mul_bf16(len={len}) == silu_mul_f32 + f32_to_bf16 exact ({len} values)");
    }
}

/// The latent cache rows in one launch (`kv_latent_rows_bf16`: kv_append_latent's copy, norm of the c_kv part,
/// RoPE of k_pe and the bf16 store at the device's committed row) give the four ops' bits, cache rows around them
/// untouched: K2.6 (576 = 512 + 64) at T = 1 (decode), 65 (a tree) and 300, the trained pair's shape.
#[test]
fn kv_latent_rows_equal_the_four_ops() {
    let Some(g) = gpu() else { return };
    for (i, &(t, w, c, row0)) in [
        (1usize, 576usize, 512usize, 37usize),
        (65, 576, 512, 0),
        (300, 576, 512, 1000),
        (9, 80, 64, 5),
    ]
    .iter()
    .enumerate()
    {
        let case = format!("kv_latent_rows(T={t},w={w},c={c},row0={row0})");
        let mut r = rng(360 + i as u64);
        let ckv = rand_f32(&mut r, t * w, -3.0, 3.0);
        let weight = rand_bf16(&mut r, c, 0.5, 1.5);
        let half = (w - c) / 2;
        let cos = rand_f32(&mut r, t * half, -1.0, 1.0);
        let sin = rand_f32(&mut r, t * half, -1.0, 1.0);
        let cap = row0 + t + 3;
        let (dckv, dw, dcos, dsin) = (
            g.upload(&ckv).unwrap(),
            g.upload(&weight).unwrap(),
            g.upload(&cos).unwrap(),
            g.upload(&sin).unwrap(),
        );
        let dpos = g.upload(&[row0 as i32]).unwrap();
        // The four ops.
        let mut rows = g.upload(&ckv).unwrap();
        ops::act_f32::rms_norm_f32(
            &g,
            &dckv.as_view(),
            w,
            &dw.as_view(),
            &mut rows.as_view_mut(),
            w,
            t,
            1e-6,
        )
        .unwrap();
        let layout = ops::rope::RopeLayout {
            tokens: t,
            heads: 1,
            ld_token: w,
            ld_head: w,
            offset: c,
            dim: w - c,
        };
        ops::act_f32::rope_table_f32(
            &g,
            &mut rows.as_view_mut(),
            &dcos.as_view(),
            &dsin.as_view(),
            layout,
            false,
        )
        .unwrap();
        let mut four = g.upload(&nan_bf16(cap * w)).unwrap();
        ops::round_state::store_rows(
            &g,
            &mut four.as_view_mut(),
            w,
            &dpos.as_view(),
            row0,
            &rows.as_view(),
            t,
        )
        .unwrap();
        // The one launch.
        let mut one = g.upload(&nan_bf16(cap * w)).unwrap();
        ops::act_f32::kv_latent_rows_bf16(
            &g,
            (&dckv.as_view(), w),
            (t, w, c),
            &dw.as_view(),
            1e-6,
            (&dcos.as_view(), &dsin.as_view()),
            &mut one.as_view_mut(),
            (&dpos.as_view(), row0),
        )
        .unwrap();
        let bits = |v: Vec<bf16>| -> Vec<u16> { v.iter().map(|x| x.to_bits()).collect() };
        let (one, four) = (bits(g.download(&one).unwrap()), bits(g.download(&four).unwrap()));
        let differ = one.iter().zip(&four).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "{case}: {differ} of {} cache elements differ from the four ops",
            one.len()
        );
        println!(
            "PARITY {case} == copy + rms_norm_f32 + rope_table_f32 + store_rows exact ({} values)",
            one.len()
        );
    }
}

#[test]
fn embed_gather_parity() {
    let Some(g) = gpu() else { return };
    for (n, &(v, h, t)) in [(163_840, 7168, 9), (96, 64, 5), (1000, 100, 4)].iter().enumerate() {
        let case = format!("embed_gather(V={v},H={h},T={t},bf16)");
        let mut r = rng(400 + n as u64);
        let table = rand_bf16(&mut r, v * h, 0.001, 1.0);
        let mut ids: Vec<i32> = (0..t).map(|_| r.random_range(0..v as i32)).collect();
        ids[0] = v as i32 - 1;
        let dt = g.upload(&table).unwrap();
        let di = g.upload(&ids).unwrap();
        let mut dout = g.upload(&nan_bf16(t * h)).unwrap();
        ops::embed::embed_gather(&g, &di.as_view(), &dt.as_view(), &mut dout.as_view_mut(), v, h).unwrap();
        let got = g.download(&dout).unwrap();
        let want: Vec<bf16> = ids
            .iter()
            .flat_map(|&id| table[id as usize * h..(id as usize + 1) * h].to_vec())
            .collect();
        assert!(
            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{case}: rows differ"
        );
        println!("PARITY {case} exact");
        // An out-of-range id gives a NaN row, never another row.
        let bad = g.upload(&[v as i32, -1]).unwrap();
        let mut dout = g.upload(&vec![bf16::ZERO; 2 * h]).unwrap();
        ops::embed::embed_gather(&g, &bad.as_view(), &dt.as_view(), &mut dout.as_view_mut(), v, h).unwrap();
        assert!(
            g.download(&dout).unwrap().iter().all(|x| x.is_nan()),
            "{case}: out-of-range id must give NaN rows"
        );
    }
}

#[test]
fn residual_add_parity() {
    let Some(g) = gpu() else { return };
    for (n, &len) in [7168usize, 64 * 7168, 1001].iter().enumerate() {
        let case = format!("residual_add(n={len},bf16)");
        let mut r = rng(500 + n as u64);
        let h = rand_bf16(&mut r, len, 0.01, 4.0);
        let d = rand_bf16(&mut r, len, 0.01, 4.0);
        let mut dh = g.upload(&h).unwrap();
        let dd = g.upload(&d).unwrap();
        ops::residual_add::residual_add(&g, &mut dh.as_view_mut(), &dd.as_view()).unwrap();
        let got = g.download(&dh).unwrap();
        // Local reference (the CPU model adds f32 residuals inline): f32 add of the widened inputs.
        let want: Vec<f32> = h.iter().zip(&d).map(|(a, b)| a.to_f32() + b.to_f32()).collect();
        check_bf16(&case, &got, &want, BF16_OUT_TOL);
        // Odd offsets take the unaligned path.
        let mut dh = g.upload(&h).unwrap();
        ops::residual_add::residual_add(&g, &mut dh.slice_mut(1..len), &dd.slice(1..len)).unwrap();
        let got = g.download(&dh).unwrap();
        check_bf16(&format!("{case}+offset1"), &got[1..], &want[1..], BF16_OUT_TOL);
    }
}

#[test]
fn argmax_parity() {
    let Some(g) = gpu() else { return };
    for (n, &(rows, v)) in [(4, 163_840), (3, 1000), (1, 31), (16, 163_840)].iter().enumerate() {
        let mut r = rng(600 + n as u64);
        let mut x = rand_f32(&mut r, rows * v, -20.0, 20.0);
        // Row 0 (when 2+ rows): an exact tie at two indices (lowest wins) and NaNs (never win).
        if rows > 1 {
            x[5] = 100.0;
            x[v - 3] = 100.0;
            x[7] = f32::NAN;
        }
        let want: Vec<u32> = (0..rows).map(|t| argmax(&x[t * v..(t + 1) * v])).collect();
        let dx = g.upload(&x).unwrap();
        let mut dout = g.upload(&vec![u32::MAX; rows]).unwrap();
        ops::argmax::argmax(&g, &dx.as_view(), rows, v, v, &mut dout.as_view_mut()).unwrap();
        assert_eq!(g.download(&dout).unwrap(), want, "argmax(rows={rows},V={v},f32)");
        println!("PARITY argmax(rows={rows},V={v},f32) exact");
        // bf16 logits (ties are common after rounding; the rule is the same, so still bit for bit).
        let xb: Vec<bf16> = x.iter().map(|&f| bf16::from_f32(f)).collect();
        let want: Vec<u32> = (0..rows).map(|t| argmax(&widen(&xb[t * v..(t + 1) * v]))).collect();
        let dx = g.upload(&xb).unwrap();
        let mut dout = g.upload(&vec![u32::MAX; rows]).unwrap();
        ops::argmax::argmax(&g, &dx.as_view(), rows, v, v, &mut dout.as_view_mut()).unwrap();
        assert_eq!(g.download(&dout).unwrap(), want, "argmax(rows={rows},V={v},bf16)");
        println!("PARITY argmax(rows={rows},V={v},bf16) exact");
    }
}

#[test]
fn vocab_parallel_argmax_pairs_merge_to_the_row_argmax() {
    let Some(g) = gpu() else { return };
    // Rows split in `shards` even shards (the pairs of every shard written on this one GPU, as the communicator's
    // sum would leave them), merged: the argmax of the whole row, ties across shards and NaNs included.
    for (n, &(rows, v, shards)) in [(5, 163_840, 8), (3, 1024, 2), (4, 96, 4)].iter().enumerate() {
        let mut r = rng(700 + n as u64);
        let mut x = rand_f32(&mut r, rows * v, -20.0, 20.0);
        let vr = v / shards;
        x[vr + 3] = 100.0; // row 0: a tie of shards 1 and the last; the lower id wins
        x[v - 2] = 100.0;
        x[v + 1] = f32::NAN; // row 1: NaNs never win, and shard 0 of row 2 is all NaN
        x[2 * v..2 * v + vr].iter_mut().for_each(|e| *e = f32::NAN);
        let want: Vec<u32> = (0..rows).map(|t| argmax(&x[t * v..(t + 1) * v])).collect();
        let dx = g.upload(&x).unwrap();
        let mut pairs = g.upload(&vec![0f32; rows * shards * 2]).unwrap();
        for s in 0..shards {
            ops::argmax::argmax_pairs(
                &g,
                &dx.slice(s * vr..),
                rows,
                vr,
                v,
                s * vr,
                &mut pairs.as_view_mut(),
                s,
                shards,
            )
            .unwrap();
        }
        let host_pairs = g.download(&pairs).unwrap();
        let cpu: Vec<u32> = host_pairs
            .chunks(shards * 2)
            .map(kdtree_engine::cpu::ops::merge_argmax_pairs)
            .collect();
        let mut dout = g.upload(&vec![u32::MAX; rows]).unwrap();
        ops::argmax::merge_pairs(&g, &pairs.as_view(), rows, shards, &mut dout.as_view_mut()).unwrap();
        assert_eq!(
            g.download(&dout).unwrap(),
            want,
            "vocab-parallel argmax (rows={rows}, V={v}, {shards} shards)"
        );
        assert_eq!(cpu, want, "the CPU merge of the GPU's pairs");
        println!("PARITY vocab-parallel argmax pairs + merge (rows={rows},V={v},{shards} shards) == row argmax exact");
    }
}

#[test]
fn zero_fill_kernel_clears_every_byte() {
    let Some(g) = gpu() else { return };
    for n in [1usize, 15, 16, 17, 4099, 1_000_003] {
        let mut d = g.upload(&vec![0xA5u8; n]).unwrap();
        ops::fill::zero(&g, &mut d).unwrap();
        let h = g.download(&d).unwrap();
        assert!(h.iter().all(|&b| b == 0), "zero fill of {n} bytes left a byte set");
        let mut f = g.upload(&vec![f32::NAN; n]).unwrap();
        ops::fill::zero(&g, &mut f).unwrap();
        assert!(
            g.download(&f).unwrap().iter().all(|&x| x.to_bits() == 0),
            "zero fill of {n} f32"
        );
    }
    println!("PARITY zero fill kernel (1 .. 1000003 bytes, u8 and f32) exact");
}

/// A batch's feed step stashes row s of the taps into stash s at its count and moves the count (one launch,
/// round_state.cu `kdtree_stash_rows_seg_f32`): twice in a row at K2.6's tap width, up to the table's 64
/// segments, every other row left as it was (NaN-poisoned), and a 65-segment table refused.
#[test]
fn stash_rows_seg_writes_each_row_at_its_count() {
    let Some(g) = gpu() else { return };
    let mut r = rng(31);
    let (w, cap) = (5 * 7168, 6);
    for nseg in [1usize, 3, 64] {
        let at: Vec<usize> = (0..nseg).map(|_| r.random_range(0..cap - 1)).collect();
        let mut dst: Vec<_> = (0..nseg).map(|_| g.upload(&nan_f32(cap * w)).unwrap()).collect();
        let mut pos: Vec<_> = at.iter().map(|&a| g.upload(&[a as i32]).unwrap()).collect();
        let srcs = [
            rand_f32(&mut r, nseg * w, -3.0, 3.0),
            rand_f32(&mut r, nseg * w, -3.0, 3.0),
        ];
        for (k, src) in srcs.iter().enumerate() {
            let dsrc = g.upload(src).unwrap();
            let mut segs: Vec<ops::round_state::StashSeg<'_>> = dst
                .iter_mut()
                .zip(pos.iter_mut())
                .zip(&at)
                .map(|((d, p), &a)| ops::round_state::StashSeg {
                    dst: d.as_view_mut(),
                    pos: p.as_view_mut(),
                    at: a + k,
                })
                .collect();
            ops::round_state::stash_rows_seg_f32(&g, &mut segs, w, &dsrc.as_view()).unwrap();
        }
        for s in 0..nseg {
            let (got, p) = (g.download(&dst[s]).unwrap(), g.download(&pos[s]).unwrap());
            assert_eq!(p[0] as usize, at[s] + 2, "nseg {nseg} segment {s}: the count");
            for row in 0..cap {
                let want: Vec<u32> = match row.checked_sub(at[s]) {
                    Some(k) if k < 2 => srcs[k][s * w..(s + 1) * w].iter().map(|x| x.to_bits()).collect(),
                    _ => vec![f32::NAN.to_bits(); w],
                };
                let have: Vec<u32> = got[row * w..(row + 1) * w].iter().map(|x| x.to_bits()).collect();
                assert!(have == want, "nseg {nseg} segment {s} row {row} (count {})", at[s]);
            }
        }
    }
    let mut dst: Vec<_> = (0..65).map(|_| g.upload(&nan_f32(w)).unwrap()).collect();
    let mut pos: Vec<_> = (0..65).map(|_| g.upload(&[0i32]).unwrap()).collect();
    let src = g.upload(&vec![0f32; 65 * w]).unwrap();
    let mut segs: Vec<_> = dst
        .iter_mut()
        .zip(pos.iter_mut())
        .map(|(d, p)| ops::round_state::StashSeg {
            dst: d.as_view_mut(),
            pos: p.as_view_mut(),
            at: 0,
        })
        .collect();
    assert!(ops::round_state::stash_rows_seg_f32(&g, &mut segs, w, &src.as_view()).is_err());
    println!("PARITY stash_rows_seg_f32 (1, 3, 64 segments of {w}, twice) exact");
}

/// The op profile (`KDTREE_OP_PROFILE`, engine/src/cuda/profile.rs): an op's device time between its events, the
/// GPU's idle time while the host sleeps between two ops, nested ops counted once in the outermost, and nothing
/// timed inside a capture.
#[test]
fn op_profile_times_ops_and_the_gaps_between_them() {
    use kdtree_engine::cuda::profile::OpProfile;
    let Some(g) = gpu() else { return };
    let p = OpProfile::default();
    let mut d = g.upload(&vec![0xA5u8; 256 << 20]).unwrap();
    for _ in 0..3 {
        let probe = p.begin(&g.stream, "zero 256 MB");
        assert!(
            p.begin(&g.stream, "nested").is_none(),
            "a nested op is timed on its own"
        );
        p.end(&g.stream, None);
        ops::fill::zero(&g, &mut d).unwrap();
        p.end(&g.stream, probe);
        g.sync().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    g.stream
        .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = p.begin(&g.stream, "captured");
    p.end(&g.stream, None);
    let _ = g.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
    assert!(captured.is_none(), "an op inside a capture is timed");
    let (t, wall) = p.totals();
    let z = t["zero 256 MB"];
    assert_eq!((t.len(), z.calls), (1, 3), "{t:?}");
    // 256 MB written at <= ~4.3 TB/s takes >= 0.06 ms a call; the host slept 20 ms before each of the last two.
    assert!(z.device_ms > 3.0 * 0.05 && z.device_ms < 3.0 * 20.0, "{z:?}");
    assert!(z.idle_before_ms > 2.0 * 15.0, "{z:?}");
    assert!(wall.as_secs_f64() > 0.04, "{wall:?}");
    let report = p.report();
    assert!(report.contains("zero 256 MB") && report.contains("total"), "{report}");
    println!(
        "PARITY op profile: 3 calls, device {:.3} ms, GPU idle before them {:.1} ms",
        z.device_ms, z.idle_before_ms
    );
}

fn router_cfg(e: usize, n_group: usize, topk_group: usize, top_k: usize) -> Router {
    Router {
        n_experts: e,
        n_group,
        topk_group,
        top_k,
        norm_topk_prob: true,
        routed_scaling: 2.827,
    }
}

#[test]
fn moe_router_parity() {
    let Some(g) = gpu() else { return };
    // (tokens, E, n_group, topk_group, top_k, bias): K2.6 (384, 1 group, top-8), DeepSeek-V3-style groups,
    // the tiny test model's shape.
    let cases = [
        (1, 384, 1, 1, 8, true),
        (64, 384, 1, 1, 8, true),
        (7, 256, 8, 4, 8, true),
        (5, 8, 2, 1, 2, false),
        (33, 384, 1, 1, 8, false),
    ];
    for (n, &(t, e, ng, tg, k, with_bias)) in cases.iter().enumerate() {
        let case = format!("moe_router(T={t},E={e},n_group={ng},topk_group={tg},top_k={k},bias={with_bias})");
        let mut r = rng(700 + n as u64);
        let logits = rand_f32(&mut r, t * e, -6.0, 6.0);
        let bias = with_bias.then(|| rand_f32(&mut r, e, -0.1, 0.1));
        let cfg = router_cfg(e, ng, tg, k);
        let rc = ops::moe_router::RouterCfg {
            n_experts: e,
            n_group: ng,
            topk_group: tg,
            top_k: k,
            norm_topk_prob: true,
            routed_scaling: 2.827,
        };
        let dl = g.upload(&logits).unwrap();
        let db = bias.as_ref().map(|b| g.upload(b).unwrap());
        let mut di = g.upload(&vec![-1i32; t * k]).unwrap();
        let mut dw = g.upload(&nan_f32(t * k)).unwrap();
        let bv = db.as_ref().map(|b| b.as_view());
        ops::moe_router::moe_router(
            &g,
            &dl.as_view(),
            bv.as_ref(),
            t,
            rc,
            &mut di.as_view_mut(),
            &mut dw.as_view_mut(),
        )
        .unwrap();
        let (ids, wts) = (g.download(&di).unwrap(), g.download(&dw).unwrap());
        let (mut want_ids, mut want_w) = (Vec::new(), Vec::new());
        for tt in 0..t {
            let (i, w) = moe_route(&cfg, &logits[tt * e..(tt + 1) * e], bias.as_deref());
            want_ids.extend(i.iter().map(|&x| x as i32));
            want_w.extend(w);
        }
        assert_eq!(ids, want_ids, "{case}: expert ids differ");
        check(&case, &wts, &want_w, ROUTER_WEIGHT_TOL);
    }
}

/// The one-warp-a-token router (taken without expert groups) against the one-block form on the same logits: ids
/// and weights bit for bit, over expert counts that fill 4, 12 and 32 values a lane (and part of one), top-k up
/// to 32, ties (logits quantized to a few values), no bias, no normalisation, NaN logits (fewer valid experts
/// than top_k: both forms write id -1 and weight 0 for the missing ones).
#[test]
fn moe_router_warp_equals_block() {
    let Some(g) = gpu() else { return };
    // (tokens, E, top_k, bias, norm, quantized, NaN logits a token)
    let cases = [
        (1, 384, 8, true, true, false, 0),
        (300, 384, 8, true, true, false, 0),
        (37, 384, 8, false, true, true, 0),
        (9, 100, 4, true, false, false, 0),
        (64, 32, 4, true, true, true, 0),
        (17, 1000, 32, true, true, false, 0),
        (11, 1024, 8, false, true, true, 0),
        (5, 40, 8, true, true, false, 35),
    ];
    for (n, &(t, e, k, with_bias, norm, quant, nans)) in cases.iter().enumerate() {
        let case = format!(
            "moe_router warp == block (T={t},E={e},top_k={k},bias={with_bias},norm={norm},ties={quant},NaN={nans})"
        );
        let mut r = rng(750 + n as u64);
        let mut logits = rand_f32(&mut r, t * e, -6.0, 6.0);
        if quant {
            logits.iter_mut().for_each(|x| *x = (*x).round());
        }
        for tt in 0..t {
            for i in 0..nans {
                logits[tt * e + (i * 7 + tt) % e] = f32::NAN;
            }
        }
        let bias = with_bias.then(|| rand_f32(&mut r, e, -0.1, 0.1));
        let rc = ops::moe_router::RouterCfg {
            n_experts: e,
            n_group: 1,
            topk_group: 1,
            top_k: k,
            norm_topk_prob: norm,
            routed_scaling: 2.827,
        };
        let dl = g.upload(&logits).unwrap();
        let db = bias.as_ref().map(|b| g.upload(b).unwrap());
        let bv = db.as_ref().map(|b| b.as_view());
        let run = |warp: bool| {
            let mut di = g.upload(&vec![-7i32; t * k]).unwrap();
            let mut dw = g.upload(&nan_f32(t * k)).unwrap();
            let f = if warp {
                ops::moe_router::moe_router
            } else {
                ops::moe_router::moe_router_block
            };
            f(
                &g,
                &dl.as_view(),
                bv.as_ref(),
                t,
                rc,
                &mut di.as_view_mut(),
                &mut dw.as_view_mut(),
            )
            .unwrap();
            (g.download(&di).unwrap(), g.download(&dw).unwrap())
        };
        let ((iw, ww), (ib, wb)) = (run(true), run(false));
        let valid = e - nans.min(e);
        let mut compared = 0;
        for tt in 0..t {
            for j in 0..k {
                let at = tt * k + j;
                if j >= valid {
                    assert_eq!(
                        (iw[at], ww[at]),
                        (-1, 0.0),
                        "{case}: token {tt} slot {j} past the valid experts"
                    );
                    continue;
                }
                assert_eq!(iw[at], ib[at], "{case}: token {tt} slot {j}: ids differ");
                if nans == 0 {
                    assert_eq!(
                        ww[at].to_bits(),
                        wb[at].to_bits(),
                        "{case}: token {tt} slot {j}: weights differ"
                    );
                }
                compared += 1;
            }
        }
        println!("PARITY {case} exact ({compared} slots)");
    }
}

#[test]
fn moe_align_parity() {
    let Some(g) = gpu() else { return };
    // (tokens, top_k, E, experts actually used, tile_rows, this rank's first expert and count): decode sizes (warp 0
    // places the pairs), and from 513 pairs on the chunked placement by 8 warps (a 16K-token prefill chunk, few
    // experts taking many pairs, 1024 experts (its largest shared memory), an expert-parallel rank's share).
    let cases: [(usize, usize, usize, usize, usize, usize, usize); 9] = [
        (1, 8, 384, 384, 8, 0, 384),
        (40, 8, 384, 24, 16, 0, 384),
        (256, 8, 384, 384, 32, 0, 384),
        (5, 2, 8, 8, 8, 0, 8),
        (65, 8, 384, 384, 16, 0, 384),
        (16384, 8, 384, 384, 128, 0, 384),
        (3000, 8, 384, 9, 128, 0, 384),
        (700, 8, 1024, 1024, 32, 0, 1024),
        (4100, 8, 384, 384, 128, 48, 48),
    ];
    for (n, &(t, k, e, used, tile, first, local)) in cases.iter().enumerate() {
        let case = format!("moe_align(T={t},top_k={k},E={e},used={used},tile_rows={tile},experts {first}..+{local})");
        let mut r = rng(800 + n as u64);
        let mut pool: Vec<i32> = (0..e as i32).collect();
        pool.shuffle(&mut r);
        pool.truncate(used);
        let ids: Vec<i32> = (0..t)
            .flat_map(|_| pool.choose_multiple(&mut r, k).copied().collect::<Vec<_>>())
            .collect();
        let p = t * k;
        let mt = ops::moe_align::max_tiles(p, local, tile);
        let di = g.upload(&ids).unwrap();
        let mut ds = g.upload(&vec![-1i32; p]).unwrap();
        let mut dt = g.upload(&vec![-1i32; 3 * mt]).unwrap();
        let mut dn = g.upload(&[-1i32]).unwrap();
        ops::moe_align::moe_align_rank(
            &g,
            &di.as_view(),
            first,
            local,
            tile,
            &mut ds.as_view_mut(),
            &mut dt.as_view_mut(),
            &mut dn.as_view_mut(),
        )
        .unwrap();
        // Reference: the per-expert lists of model::ffn::moe (ascending expert, pairs in order), cut in tiles;
        // pairs of experts outside this rank's are in no list.
        let mut want_sorted: Vec<i32> = Vec::new();
        let mut want_tiles = (Vec::new(), Vec::new(), Vec::new());
        let mut by_expert = vec![Vec::new(); local];
        for (q, &id) in ids.iter().enumerate() {
            if (first as i32..(first + local) as i32).contains(&id) {
                by_expert[id as usize - first].push(q as i32);
            }
        }
        for (ex, list) in by_expert.iter().enumerate() {
            let ex = ex as i32;
            let start = want_sorted.len();
            want_sorted.extend(list);
            let c = want_sorted.len() - start;
            for j in (0..c).step_by(tile) {
                want_tiles.0.push(ex);
                want_tiles.1.push((start + j) as i32);
                want_tiles.2.push(tile.min(c - j) as i32);
            }
        }
        let nt = g.download(&dn).unwrap()[0] as usize;
        assert_eq!(nt, want_tiles.0.len(), "{case}: tile count");
        let got_sorted = g.download(&ds).unwrap();
        assert_eq!(
            &got_sorted[..want_sorted.len()],
            &want_sorted[..],
            "{case}: sorted pairs"
        );
        assert!(
            got_sorted[want_sorted.len()..].iter().all(|&x| x == -1),
            "{case}: entries past the rank's pairs"
        );
        let tiles = g.download(&dt).unwrap();
        assert_eq!(&tiles[..nt], &want_tiles.0[..], "{case}: tile experts");
        assert_eq!(&tiles[mt..mt + nt], &want_tiles.1[..], "{case}: tile starts");
        assert_eq!(&tiles[2 * mt..2 * mt + nt], &want_tiles.2[..], "{case}: tile counts");
        println!("PARITY {case} exact ({nt} tiles)");
    }
}

#[test]
fn wrappers_reject_bad_shapes_naming_both_numbers() {
    let Some(g) = gpu() else { return };
    let x = g.upload(&[bf16::ONE; 64]).unwrap();
    let w = g.upload(&[bf16::ONE; 63]).unwrap();
    let mut y = g.upload(&[bf16::ZERO; 64]).unwrap();
    let e = ops::rms_norm::rms_norm(
        &g,
        &x.as_view(),
        &w.as_view(),
        &mut y.as_view_mut(),
        1,
        64,
        64,
        64,
        1e-5,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("rms_norm") && e.contains("63") && e.contains("64"), "{e}");
    let l = g.upload(&[0f32; 16]).unwrap();
    let mut i = g.upload(&[0i32; 8]).unwrap();
    let mut wt = g.upload(&[0f32; 8]).unwrap();
    let rc = ops::moe_router::RouterCfg {
        n_experts: 16,
        n_group: 1,
        topk_group: 1,
        top_k: 40,
        norm_topk_prob: true,
        routed_scaling: 1.0,
    };
    let e = ops::moe_router::moe_router(
        &g,
        &l.as_view(),
        None,
        1,
        rc,
        &mut i.as_view_mut(),
        &mut wt.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("moe_router") && e.contains("40"), "{e}");
}

/// The device round's cos/sin (round_state.cu `rope_at`: positions read from a device counter plus node
/// depths) against the host table the eager forwards upload (`RopeTable::new`, i.e. `rope_cos_sin`): bit for
/// bit, so a captured round and an eager forward rotate alike. K2.6's rope (64 dims, theta 50000, YaRN
/// factor 40 with its attention factor) and the drafter's (128 dims, theta 1e6), positions up to 262k.
#[test]
fn rope_at_equals_the_host_table() {
    use kdtree_engine::backend::RopeTable;
    use kdtree_formats::config::RopeScaling;
    let Some(g) = gpu() else { return };
    let yarn = RopeScaling {
        kind: "yarn".into(),
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 1.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 1.0,
    };
    let mut r = rng(4100);
    let mut total = 0;
    for (name, inv, factor) in [
        (
            "k26 (64, theta 5e4, yarn 40)",
            yarn_inv_freq(64, 50_000.0, Some(&yarn)),
            1.0f64 + 0.1 * 40f64.ln(),
        ),
        ("drafter (128, theta 1e6)", yarn_inv_freq(128, 1_000_000.0, None), 1.0),
    ] {
        let dinv = g.upload(&inv).unwrap();
        for base in [0usize, 4095, 131_072, 262_000] {
            for with_depths in [false, true] {
                let t = if with_depths { 257 } else { 1024 };
                let depths: Vec<u32> = (0..t)
                    .map(|i| if i == 0 { 0 } else { r.random_range(1..8u32) })
                    .collect();
                let want = RopeTable::new(
                    &inv,
                    (0..t).map(|i| base + if with_depths { depths[i] as usize } else { i }),
                    factor,
                );
                let (db, dd) = (g.upload(&[base as i32]).unwrap(), g.upload(&depths).unwrap());
                let (mut c, mut s) = (
                    g.upload(&nan_f32(t * inv.len())).unwrap(),
                    g.upload(&nan_f32(t * inv.len())).unwrap(),
                );
                let ddv = dd.as_view();
                ops::round_state::rope_at(
                    &g,
                    &dinv.as_view(),
                    factor,
                    &db.as_view(),
                    with_depths.then_some(&ddv),
                    t,
                    &mut c.as_view_mut(),
                    &mut s.as_view_mut(),
                )
                .unwrap();
                let (gc, gs) = (g.download(&c).unwrap(), g.download(&s).unwrap());
                let bad = gc
                    .iter()
                    .zip(&want.cos)
                    .chain(gs.iter().zip(&want.sin))
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    bad,
                    0,
                    "rope_at {name} base {base} depths {with_depths}: {bad} of {} values differ from the host table",
                    2 * gc.len()
                );
                total += 2 * gc.len();
            }
        }
    }
    println!(
        "PARITY rope_at(device positions) exact ({total} cos/sin values, positions 0..262k, k26 and drafter ropes)"
    );
}

/// Strided row copies past the grid's 65,535 y limit (a K2.6 tree verify of 1025 nodes x 64 heads places
/// 65,600 q_pe rows), exact.
#[test]
fn copy_rows_beyond_the_grid_limit() {
    let Some(g) = gpu() else { return };
    let (rows, width, ld_src, ld_dst) = (65_600usize, 64usize, 192usize, 576usize);
    let mut r = rng(4200);
    let src = rand_bf16(&mut r, rows * ld_src, 0.01, 2.0);
    let dsrc = g.upload(&src).unwrap();
    let mut ddst = g.upload(&nan_bf16(rows * ld_dst)).unwrap();
    ops::copy_rows::copy_rows(
        &g,
        &dsrc.as_view(),
        ld_src,
        &mut ddst.as_view_mut(),
        ld_dst,
        rows,
        width,
    )
    .unwrap();
    let got = g.download(&ddst).unwrap();
    let bad = (0..rows)
        .filter(|&i| {
            got[i * ld_dst..i * ld_dst + width]
                .iter()
                .zip(&src[i * ld_src..i * ld_src + width])
                .any(|(a, b)| a.to_bits() != b.to_bits())
        })
        .count();
    assert_eq!(bad, 0, "copy_rows: {bad} of {rows} rows differ");
    println!("PARITY copy_rows(rows={rows},width={width}) exact");
}

/// Weights upload through the pinned staging buffers (Gpu::begin_load .. end_load): buffers of many 32 MiB
/// chunks (each staging buffer refilled 20 times, from memory already resident, so the host copy outruns the
/// DMA) plus a remainder, three times over, and a small one, arrive byte for byte; the load counts every byte.
/// Before the fix of issue 24 the host refilled a buffer whose DMA had not run yet (its event was never
/// recorded with event tracking off) and these uploads came back with other chunks' bytes.
#[test]
fn staged_uploads_equal_the_host_bytes() {
    let Some(g) = gpu() else { return };
    let n = 40 * (32 << 20) + 12_345;
    let small: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    for rep in 0..3u64 {
        let big = rand_bytes(4300 + rep, n);
        g.begin_load((n + small.len() * 4) as u64, false).unwrap();
        let (db, ds) = (g.upload(&big).unwrap(), g.upload(&small).unwrap());
        let (bytes, secs) = g.end_load().unwrap();
        assert_eq!(bytes as usize, n + small.len() * 4, "the load counted {bytes} bytes");
        let (hb, hs) = (g.download(&db).unwrap(), g.download(&ds).unwrap());
        assert_eq!(hb.len(), n);
        let chunks_bad = (0..n.div_ceil(32 << 20)).filter(|c| {
            let r = c * (32 << 20)..((c + 1) * (32 << 20)).min(n);
            hb[r.clone()] != big[r]
        });
        let bad: Vec<usize> = chunks_bad.collect();
        assert!(
            bad.is_empty(),
            "rep {rep}: staged upload chunks {bad:?} of {} differ from the host bytes",
            n.div_ceil(32 << 20)
        );
        assert_eq!(hs, small, "the small upload differs");
        println!(
            "PARITY staged upload rep {rep} ({} MB in 40 pinned chunks + a direct tail, {:.2} GB/s) exact",
            n / 1_000_000,
            bytes as f64 / secs / 1e9
        );
    }
}

/// The host load check's copy-and-hash staging (Gpu::upload_hashed within a load, the default of `kdtree-run`
/// on a GPU): every byte arrives and the hash equals xxhash_rust's at every length that changes the path: under
/// the parallel threshold (4 MiB, the reference), at and around it, one staging chunk (32 MiB) exact, one
/// byte over and under, several chunks with a short last one (its block cut by the chain's rule), and one
/// length per rep from a seed; bf16 buffers too. Outside a load the same call hashes before its copy.
#[test]
fn staged_hashed_uploads_equal_the_reference() {
    let Some(g) = gpu() else { return };
    let mb = 1 << 20;
    let mut lens = vec![
        1000,
        4 * mb - 1,
        4 * mb,
        4 * mb + 1,
        32 * mb - 1,
        32 * mb,
        32 * mb + 1,
        32 * mb + 1024,
        32 * mb + 1025,
        3 * 32 * mb + 777,
        5 * 32 * mb,
    ];
    lens.extend(
        (0..3u64).map(|r| 40 * mb + (rand_bytes(4600 + r, 4).iter().map(|&b| b as usize).sum::<usize>() * 997)),
    );
    let total: usize = lens.iter().sum();
    let hosts: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| rand_bytes(4500 + i as u64, n))
        .collect();
    g.begin_load(total as u64, false).unwrap();
    let ups: Vec<_> = hosts.iter().map(|h| g.upload_hashed(h).unwrap()).collect();
    let (bytes, secs) = g.end_load().unwrap();
    assert_eq!(bytes as usize, total, "the load counted {bytes} bytes");
    for (host, (dev, h)) in hosts.iter().zip(&ups) {
        let n = host.len();
        assert_eq!(
            *h,
            kdtree_formats::manifest::xxh3_64(host),
            "{n} bytes: the staged hash"
        );
        assert!(
            g.download(dev).unwrap() == *host,
            "{n} bytes: the staged copy differs from the host bytes"
        );
    }
    let w: Vec<half::bf16> = rand_bytes(4700, 9 * mb + 2)
        .chunks(2)
        .map(|c| half::bf16::from_bits(c[0] as u16 | (c[1] as u16) << 8))
        .collect();
    for in_load in [true, false] {
        if in_load {
            g.begin_load((w.len() * 2) as u64, false).unwrap();
        }
        let (dev, h) = g.upload_hashed(&w).unwrap();
        if in_load {
            g.end_load().unwrap();
        }
        assert_eq!(
            h,
            kdtree_formats::manifest::xxh3_64(bytemuck::cast_slice(&w)),
            "bf16, in a load: {in_load}"
        );
        assert!(g
            .download(&dev)
            .unwrap()
            .iter()
            .zip(&w)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    println!(
        "PARITY staged copy-and-hash uploads ({} lengths, {} MB, {:.2} GB/s) exact, hashes == xxhash_rust",
        lens.len(),
        total / 1_000_000,
        bytes as f64 / secs / 1e9
    );
}

/// XXH3-64 of device bytes (the load check's hash, kernels/cuda/xxh3.cu) == xxhash_rust's: every short-input
/// path (0..=240 bytes), the block and stripe boundaries of the long form, several 64 MiB segments, views that
/// start unaligned, and a buffer past 2^32 bytes (offsets into it are 64-bit; its deltas span segments).
#[test]
fn xxh3_of_device_bytes_equals_the_cpu() {
    let Some(g) = gpu() else { return };
    let cpu = kdtree_formats::manifest::xxh3_64;
    let host = rand_bytes(4400, (2 << 26) + 70_000);
    let dev = g.upload(&host).unwrap();
    let mut lens: Vec<usize> = (0..=260).collect();
    lens.extend([
        511,
        512,
        1023,
        1024,
        1025,
        1087,
        1088,
        1089,
        2047,
        2048,
        2049,
        65_536,
        100_003,
        (1 << 26) - 1,
        1 << 26,
        (1 << 26) + 1025,
    ]);
    lens.push(host.len() - 8);
    let mut cases = 0;
    for &off in &[0usize, 1, 3, 8] {
        for &len in &lens {
            if off + len > host.len() || (off != 0 && len > 1 << 20 && len != host.len() - 8) {
                continue;
            }
            let view = dev.slice(off..off + len);
            let got = ops::xxh3::xxh3_64(&g, &view).unwrap();
            let want = cpu(&host[off..off + len]);
            assert_eq!(
                got, want,
                "xxh3 of {len} bytes at offset {off}: device {got:016x}, cpu {want:016x}"
            );
            cases += 1;
        }
    }
    println!(
        "PARITY xxh3_64 ({cases} lengths and offsets, 0 .. {} bytes) exact",
        host.len()
    );
    // Past 2^32 bytes: filled on the device, read back once for the CPU's hash.
    let n = (1usize << 32) + 3 * 1024 + 17;
    let mut big = g.out::<u8>(n).unwrap();
    ops::fill::fill_u8(
        &g,
        &mut big.as_view_mut(),
        &kdtree_engine::cpu::ops::Fill::Bytes { seed: 77 },
    )
    .unwrap();
    let t = std::time::Instant::now();
    let got = ops::xxh3::xxh3_of(&g, &big.as_view()).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let want = cpu(&g.download(&big).unwrap());
    assert_eq!(got, want, "xxh3 of {n} bytes: device {got:016x}, cpu {want:016x}");
    println!(
        "PARITY xxh3_64 of {n} bytes (past 2^32) exact, {:.1} GB/s on the device",
        n as f64 / secs / 1e9
    );
}

/// The batch forms of the drafter's per-sequence ops (issue 28: one launch per stage for a batch) against their
/// single forms on the same backend, bit for bit: `rope_at_segs` against `rope_at` of each segment (bases from
/// position counters, with and without offsets), `write_rows_at_segs` against `write_rows_at` of each row cache,
/// `ids_blocks` and `cols` against the host; 1, 3, 64 and 70 sequences (more than one launch takes).
#[test]
fn batch_forms_equal_the_single_forms() {
    use kdtree_engine::backend::{Compute, PosOf, Resources, RopeSeg};
    use kdtree_engine::cuda::CudaBackend;
    let Some(g) = gpu() else { return };
    let b = CudaBackend::new(std::sync::Arc::new(g));
    let mut r = rng(2801);
    let inv: Vec<f32> = (0..16).map(|i| 1.0 / 10000f32.powf(i as f32 / 16.0)).collect();
    let inv = b.act_from_host(inv); // VectorF32 and Act are both f32 device buffers
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for n in [1usize, 3, 64, 70] {
        let (t, w) = (8usize, 96usize);
        let at: Vec<usize> = (0..n).map(|_| r.random_range(0..5000)).collect();
        let pos: Vec<_> = at.iter().map(|&a| b.pos_new(a)).collect();
        let offs: Vec<u32> = (0..t as u32).map(|i| 3 * i % 5).collect();
        let offs = b.ids_from_host(&offs);
        // RoPE: odd segments with offsets (a tree's depths), even ones at base + i.
        let segs: Vec<RopeSeg<'_, CudaBackend>> = pos
            .iter()
            .enumerate()
            .map(|(s, p)| (PosOf::Pos(p), (s % 2 == 1).then_some(&offs), t))
            .collect();
        let all = b.rope_at_segs(&inv, 1.25, &segs);
        let (cos, sin) = (b.to_host(&all.cos), b.to_host(&all.sin));
        for (s, p) in pos.iter().enumerate() {
            let one = b.rope_at(&inv, 1.25, PosOf::Pos(p), (s % 2 == 1).then_some(&offs), t);
            let span = s * t * 16..(s + 1) * t * 16;
            assert_eq!(
                bits(&cos[span.clone()]),
                bits(&b.to_host(&one.cos)),
                "n {n} seg {s}: cos"
            );
            assert_eq!(bits(&sin[span]), bits(&b.to_host(&one.sin)), "n {n} seg {s}: sin");
        }
        // Row stores at each cache's count, 1 to 3 rows a cache (a batch of prompts' context rows): the batch form
        // and one store per cache, from NaN-poisoned caches.
        let cap = 6usize;
        let ns: Vec<usize> = (0..n).map(|s| 1 + s % 3).collect();
        let rows_at: Vec<usize> = (0..n).map(|_| r.random_range(0..cap - 3)).collect();
        let cpos: Vec<_> = rows_at.iter().map(|&a| b.pos_new(a)).collect();
        let total: usize = ns.iter().sum();
        let src = b.act_from_host(rand_f32(&mut r, total * w, -3.0, 3.0));
        let mut one: Vec<_> = (0..n).map(|_| b.act_from_host(nan_f32(cap * w))).collect();
        let mut many: Vec<_> = (0..n).map(|_| b.act_from_host(nan_f32(cap * w))).collect();
        let mut row = 0;
        for ((d, p), &k) in one.iter_mut().zip(&cpos).zip(&ns) {
            b.write_rows_at(d, w, p, &b.rows(&src, w, row, row + k), k);
            row += k;
        }
        let mut dsts: Vec<_> = many
            .iter_mut()
            .zip(&cpos)
            .zip(&ns)
            .map(|((d, p), &k)| (d, p, k))
            .collect();
        b.write_rows_at_segs(&mut dsts, w, &src);
        for s in 0..n {
            let (x, y) = (b.to_host(&one[s]), b.to_host(&many[s]));
            assert_eq!(
                bits(&x),
                bits(&y),
                "n {n} cache {s} ({} rows at count {})",
                ns[s],
                rows_at[s]
            );
        }
        // Draft blocks from device roots, and the blocks' tails.
        let roots: Vec<_> = (0..n).map(|s| b.ids_from_host(&[1000 + s as u32])).collect();
        let mut ids = b.ids_from_host(&vec![7; n * t]);
        b.ids_blocks(&mut ids, &roots.iter().collect::<Vec<_>>(), t, 4350);
        let want: Vec<u32> = (0..n)
            .flat_map(|s| (0..t).map(move |i| if i == 0 { 1000 + s as u32 } else { 4350 }))
            .collect();
        assert_eq!(b.ids_to_host(&ids).unwrap(), want, "n {n}: ids_blocks");
        let x = rand_f32(&mut r, n * t * w, -1.0, 1.0);
        let tail = b.to_host(&b.cols(&b.act_from_host(x.clone()), t * w, w, (t - 1) * w, n));
        let want: Vec<f32> = (0..n)
            .flat_map(|s| x[(s * t + 1) * w..(s + 1) * t * w].to_vec())
            .collect();
        assert_eq!(bits(&tail), bits(&want), "n {n}: cols");
        // Counters advanced together (a batched AR step's commits), at most one launch's worth at a time.
        let start: Vec<i32> = (0..n).map(|_| r.random_range(0..9000)).collect();
        let mut cs: Vec<_> = start.iter().map(|&v| b.gpu().upload(&[v]).unwrap()).collect();
        for chunk in cs.chunks_mut(ops::round_state::MAX_SEGS) {
            let mut views: Vec<_> = chunk.iter_mut().map(|c| c.as_view_mut()).collect();
            ops::round_state::pos_add_segs(b.gpu(), &mut views, 3).unwrap();
        }
        for (s, c) in cs.iter().enumerate() {
            assert_eq!(b.gpu().download(c).unwrap(), vec![start[s] + 3], "n {n}: counter {s}");
        }
    }
    b.check().unwrap();
    println!("PARITY rope_at_segs, write_rows_at_segs, ids_blocks, cols, pos_add_segs (1, 3, 64, 70 sequences) exact");
}

/// The strided forms that read one block of a stacked linear's output `[T, ld]` (issue 26: q_a | kv_a and router |
/// shared gate | shared up as one GEMM) give the contiguous forms' bits: the SwiGLU over the gate and up blocks,
/// the latent rows from the kv_a block, the router from its block. The other columns hold NaN, so a read outside
/// the block shows. K2.6 TP8 rank-0 widths (router 384 | gate 256 | up 256; q_a 1536 | kv_a 576), a dense layer's
/// (2304 | 2304), the tiny models' (16 | 256 | 256; 96 | 80), at T = 1, 17 and 300.
#[test]
fn strided_blocks_give_the_contiguous_bits() {
    let Some(g) = gpu() else { return };
    let bits16 = |v: Vec<bf16>| -> Vec<u16> { v.iter().map(|x| x.to_bits()).collect() };
    // The block `[t, width]` of a NaN `[t, ld]` at column `off`, and the block alone.
    let embed = |r: &mut rand_chacha::ChaCha8Rng, t: usize, ld: usize, off: usize, width: usize, lo: f32, hi: f32| {
        let block = rand_f32(r, t * width, lo, hi);
        let mut wide = nan_f32(t * ld);
        for i in 0..t {
            wide[i * ld + off..i * ld + off + width].copy_from_slice(&block[i * width..(i + 1) * width]);
        }
        (wide, block)
    };
    for (n, &t) in [1usize, 17, 300].iter().enumerate() {
        // SwiGLU over [.. | gate | up] blocks.
        for (m, &(lead, w)) in [(384usize, 256usize), (0, 2304), (16, 256)].iter().enumerate() {
            let mut r = rng(3000 + 10 * n as u64 + m as u64);
            let ld = lead + 2 * w;
            let (gw, gate) = embed(&mut r, t, ld, lead, w, -8.0, 8.0);
            let up = rand_f32(&mut r, t * w, -3.0, 3.0);
            let mut wide = gw;
            for i in 0..t {
                wide[i * ld + lead + w..i * ld + ld].copy_from_slice(&up[i * w..(i + 1) * w]);
            }
            let dwide = g.upload(&wide).unwrap();
            let (dg, du) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
            let mut want = g.upload(&nan_bf16(t * w)).unwrap();
            ops::act_f32::silu_mul_bf16(&g, &dg.as_view(), &du.as_view(), &mut want.as_view_mut()).unwrap();
            let mut got = g.upload(&nan_bf16(t * w)).unwrap();
            ops::act_f32::silu_mul_bf16_rows(
                &g,
                (&dwide.slice(lead..), ld),
                (&dwide.slice(lead + w..), ld),
                (t, w),
                &mut got.as_view_mut(),
            )
            .unwrap();
            assert_eq!(
                bits16(g.download(&got).unwrap()),
                bits16(g.download(&want).unwrap()),
                "silu_mul_bf16_rows(T={t}, gate at {lead}, width {w}, ld {ld})"
            );
        }
        // Latent rows from the kv_a block of [q_a | kv_a].
        for (m, &(lead, w, c)) in [(1536usize, 576usize, 512usize), (96, 80, 64)].iter().enumerate() {
            let mut r = rng(3100 + 10 * n as u64 + m as u64);
            let ld = lead + w;
            let (wide, ckv) = embed(&mut r, t, ld, lead, w, -3.0, 3.0);
            let weight = rand_bf16(&mut r, c, 0.5, 1.5);
            let half = (w - c) / 2;
            let (cos, sin) = (
                rand_f32(&mut r, t * half, -1.0, 1.0),
                rand_f32(&mut r, t * half, -1.0, 1.0),
            );
            let (dwide, dckv, dw) = (
                g.upload(&wide).unwrap(),
                g.upload(&ckv).unwrap(),
                g.upload(&weight).unwrap(),
            );
            let (dcos, dsin, dpos) = (
                g.upload(&cos).unwrap(),
                g.upload(&sin).unwrap(),
                g.upload(&[3i32]).unwrap(),
            );
            let run = |src: (&cudarc::driver::CudaView<'_, f32>, usize)| {
                let mut out = g.upload(&nan_bf16((t + 5) * w)).unwrap();
                ops::act_f32::kv_latent_rows_bf16(
                    &g,
                    src,
                    (t, w, c),
                    &dw.as_view(),
                    1e-6,
                    (&dcos.as_view(), &dsin.as_view()),
                    &mut out.as_view_mut(),
                    (&dpos.as_view(), 3),
                )
                .unwrap();
                bits16(g.download(&out).unwrap())
            };
            assert_eq!(
                run((&dwide.slice(lead..), ld)),
                run((&dckv.as_view(), w)),
                "kv_latent_rows_bf16(T={t}, kv_a at {lead}, width {w}, ld {ld})"
            );
        }
        // The router from its block of [router | gate | up].
        for (m, &(e, rest, k)) in [(384usize, 512usize, 8usize), (16, 512, 2)].iter().enumerate() {
            let mut r = rng(3200 + 10 * n as u64 + m as u64);
            let ld = e + rest;
            let (wide, logits) = embed(&mut r, t, ld, 0, e, -6.0, 6.0);
            let bias = g.upload(&rand_f32(&mut r, e, -0.1, 0.1)).unwrap();
            let rc = ops::moe_router::RouterCfg {
                n_experts: e,
                n_group: 1,
                topk_group: 1,
                top_k: k,
                norm_topk_prob: true,
                routed_scaling: 2.827,
            };
            let (dwide, dl) = (g.upload(&wide).unwrap(), g.upload(&logits).unwrap());
            let run = |src: &cudarc::driver::CudaView<'_, f32>, ld: usize| {
                let mut di = g.upload(&vec![-7i32; t * k]).unwrap();
                let mut dw = g.upload(&nan_f32(t * k)).unwrap();
                ops::moe_router::moe_router_ld(
                    &g,
                    src,
                    ld,
                    Some(&bias.as_view()),
                    t,
                    rc,
                    &mut di.as_view_mut(),
                    &mut dw.as_view_mut(),
                )
                .unwrap();
                let wts: Vec<u32> = g.download(&dw).unwrap().iter().map(|x| x.to_bits()).collect();
                (g.download(&di).unwrap(), wts)
            };
            assert_eq!(
                run(&dwide.as_view(), ld),
                run(&dl.as_view(), e),
                "moe_router_ld(T={t}, E={e}, ld {ld})"
            );
        }
        println!("PARITY strided blocks (T={t}): silu_mul, kv_latent_rows, moe_router == contiguous, bit for bit");
    }
}
