//! The causal prefill kernel of MLA's expanded form (`cuda::ops::mla_prefill`, kernels/cuda/mla_prefill.cu)
//! against an f32 reference of the same bf16 inputs, against the split kernel's expanded form
//! (`mla_attention_heads`, causal), and against itself (two runs, the same bits). K2.6's widths (key 192, value
//! 128) at 8 and 64 heads, the trained pair's (64 / 32) and the synthetic tiny model's (48 / 32); odd T, T
//! crossing the 64-row key tiles and the 128-row query tiles, committed prefixes (a second prefill chunk), a
//! head stride past the rows, and a 16,384-row chunk (128 query tiles of 8 heads, checked on sampled rows); at
//! K2.6's widths also the `_p1` kernel (P as one bf16 operand; the default, `KDTREE_MLA_PREFILL_P1=0` off).
//! The output is NaN-poisoned first: every row must be written. Needs a GPU.
#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::*;
use half::bf16;
use kdtree_engine::cuda::ops::mla_attention::{mla_attention_heads, MlaShape, MlaSplit};
use kdtree_engine::cuda::ops::mla_prefill::{mla_prefill, mla_prefill_with, supported};
use kdtree_engine::cuda::Gpu;
use rand::RngCore;

/// Relative to the largest |output| of a case: the output's bf16 rounding (2^-9 of a value) dominates; P keeps
/// ~17 bits, the scores' f32 sums and exp2 add ~1e-6.
const TOL: f64 = 4.0e-3;
/// The `_p1` kernel (P as one bf16 operand, K2.6's widths): P's rounding moves a weight by up to 2^-9 of itself,
/// so an output by up to 2^-9 of the largest |value| it averages (1 here: values in [-1, 1]; the outputs of these
/// peaked softmaxes reach ~0.5-1), on top of the output's own bf16 rounding (2^-9): 2 x (2^-9 + 2^-9) ~ 8e-3.
/// The measured figure is printed with each case.
const TOL_P1: f64 = 8.0e-3;
/// The two GPU forms against each other: both round their outputs to bf16 (one unit each at most) and sum in
/// other orders.
const TOL_FORMS: f64 = 6.0e-3;

/// One case: (T new rows, committed rows, heads, key width QW, value width DV, rows checked on the CPU (0: all)).
type Case = (usize, usize, usize, usize, usize, usize);

const CASES: [Case; 11] = [
    (1, 0, 8, 192, 128, 0),
    (64, 0, 8, 192, 128, 0),
    (129, 0, 8, 192, 128, 0),
    (200, 77, 8, 192, 128, 0),
    (700, 1500, 8, 192, 128, 0),
    (333, 5, 64, 192, 128, 48),
    (4100, 0, 8, 192, 128, 96),
    (16384, 0, 8, 192, 128, 40),
    (100, 3, 8, 64, 32, 0),
    (257, 64, 8, 48, 32, 0),
    (1000, 2000, 4, 64, 32, 64),
];

/// f32 reference of one (row, head): softmax over keys 0 ..= committed + row, then the values.
#[allow(clippy::too_many_arguments)]
fn reference_row(
    q: &[f32],
    kv: &[f32],
    head_stride: usize,
    (hr, qw, dv): (usize, usize, usize),
    committed: usize,
    scale: f32,
    row: usize,
    h: usize,
) -> Vec<f32> {
    let ew = dv + qw;
    let qr = &q[(row * hr + h) * qw..(row * hr + h + 1) * qw];
    let rows = committed + row + 1;
    let kvh = &kv[h * head_stride..];
    let scores: Vec<f32> = (0..rows)
        .map(|s| {
            let k = &kvh[s * ew + dv..(s + 1) * ew];
            scale * qr.iter().zip(k).map(|(a, b)| a * b).sum::<f32>()
        })
        .collect();
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
    let l: f32 = p.iter().sum();
    let mut o = vec![0f32; dv];
    for (s, &w) in p.iter().enumerate() {
        for (x, v) in o.iter_mut().zip(&kvh[s * ew..s * ew + dv]) {
            *x += w * v;
        }
    }
    o.iter().map(|x| x / l).collect()
}

fn run(g: &Gpu, q: &[bf16], kv: &[bf16], head_stride: usize, s: &MlaShape, scale: f32) -> Vec<bf16> {
    run_p(g, q, kv, head_stride, s, scale, false)
}

/// [`run`] with P's form given (`p1`: one bf16 operand).
fn run_p(g: &Gpu, q: &[bf16], kv: &[bf16], head_stride: usize, s: &MlaShape, scale: f32, p1: bool) -> Vec<bf16> {
    let (dq, dkv) = (g.upload(q).unwrap(), g.upload(kv).unwrap());
    let mut out = g.upload(&nan_bf16(s.t * s.heads * s.kv_lora)).unwrap();
    mla_prefill_with(
        g,
        &dq.as_view(),
        &dkv.as_view(),
        head_stride,
        s,
        scale,
        p1,
        &mut out.as_view_mut(),
    )
    .unwrap();
    g.download(&out).unwrap()
}

#[test]
fn mla_prefill_parity() {
    let Some(g) = gpu() else { return };
    for (ci, &(t, committed, hr, qw, dv, sample)) in CASES.iter().enumerate() {
        let case = format!("mla_prefill(T={t},committed={committed},Hr={hr},QW={qw},DV={dv})");
        if !supported(&g, qw, dv) {
            println!("SKIP {case}: not built for these widths or too little shared memory on this device");
            continue;
        }
        let mut r = rng(5200 + ci as u64);
        let rows = committed + t;
        let ew = qw + dv;
        // The head stride sometimes past the rows; queries large enough that the softmax is peaked over a few units
        // (not near uniform).
        let head_stride = rows * ew + 8 * (ci % 3);
        let q = rand_bf16(&mut r, t * hr * qw, -4.0, 4.0); // scores with a spread of ~1.3 (std)
        let kv = rand_bf16(&mut r, hr * head_stride, -1.0, 1.0);
        let scale = 1.0 / (qw as f32).sqrt();
        let s = MlaShape {
            t,
            heads: hr,
            kv_lora: dv,
            rope: qw,
            committed,
        };
        let t0 = std::time::Instant::now();
        let got = run(&g, &q, &kv, head_stride, &s, scale);
        let first_ms = t0.elapsed().as_secs_f64() * 1e3;
        let unwritten = got.iter().filter(|v| v.is_nan()).count();
        assert_eq!(unwritten, 0, "{case}: {unwritten} outputs never written");
        let again = run(&g, &q, &kv, head_stride, &s, scale);
        let differ = got
            .iter()
            .zip(&again)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{case}: two runs differ in {differ} outputs");

        // The rows checked: all, or the first and last of each query tile's edges plus random ones.
        let mut check: Vec<usize> = if sample == 0 {
            (0..t).collect()
        } else {
            let mut v: Vec<usize> = [0, 1, 63, 64, 127, 128, t / 2, t - 2, t - 1]
                .into_iter()
                .filter(|&x| x < t)
                .collect();
            v.extend((0..sample).map(|_| (r.next_u32() as usize) % t));
            v
        };
        check.sort_unstable();
        check.dedup();
        let (qf, kvf) = (widen(&q), widen(&kv));
        let (mut want, mut got_c) = (Vec::new(), Vec::new());
        for &row in &check {
            for h in 0..hr {
                want.extend(reference_row(
                    &qf,
                    &kvf,
                    head_stride,
                    (hr, qw, dv),
                    committed,
                    scale,
                    row,
                    h,
                ));
                got_c.extend_from_slice(&got[(row * hr + h) * dv..(row * hr + h + 1) * dv]);
            }
        }
        check_bf16(
            &format!(
                "{case} [{} rows checked, first call {first_ms:.1} ms, two runs identical]",
                check.len()
            ),
            &got_c,
            &want,
            TOL,
        );
        // P as one bf16 operand (K2.6's widths): poisoned, twice the same bits, against the same reference.
        if (qw, dv) == (192, 128) {
            let p1 = run_p(&g, &q, &kv, head_stride, &s, scale, true);
            let again = run_p(&g, &q, &kv, head_stride, &s, scale, true);
            let unwritten = p1.iter().filter(|v| v.is_nan()).count();
            assert_eq!(unwritten, 0, "{case} p1: {unwritten} outputs never written");
            assert!(
                p1.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{case} p1: two runs differ"
            );
            let p1_c: Vec<bf16> = check
                .iter()
                .flat_map(|&row| p1[row * hr * dv..(row + 1) * hr * dv].iter().copied())
                .collect();
            check_bf16(
                &format!("{case} P as one bf16 [two runs identical]"),
                &p1_c,
                &want,
                TOL_P1,
            );
        }

        // The split kernel's expanded form on the same inputs (causal: no mask), every row.
        let split = MlaSplit::choose_heads(&g, &s);
        let (wo, wml) = split.workspace(&s);
        let (dq, dkv) = (g.upload(&q).unwrap(), g.upload(&kv).unwrap());
        let (mut po, mut pml) = (g.upload(&nan_f32(wo)).unwrap(), g.upload(&nan_f32(wml)).unwrap());
        let mut out = g.upload(&nan_bf16(t * hr * dv)).unwrap();
        mla_attention_heads(
            &g,
            &dq.as_view(),
            &dkv.as_view(),
            head_stride,
            None,
            &s,
            &split,
            scale,
            &mut po.as_view_mut(),
            &mut pml.as_view_mut(),
            &mut out.as_view_mut(),
        )
        .unwrap();
        let split_form = widen(&g.download(&out).unwrap());
        check_bf16(
            &format!("{case} vs the split kernel's expanded form"),
            &got,
            &split_form,
            TOL_FORMS,
        );
    }
}

/// Bad shapes are errors naming the op, not launches: widths without a kernel, a head stride short of the rows,
/// buffers too short.
#[test]
fn mla_prefill_rejects_bad_shapes() {
    let Some(g) = gpu() else { return };
    let s = |t, qw, dv| MlaShape {
        t,
        heads: 2,
        kv_lora: dv,
        rope: qw,
        committed: 3,
    };
    let q = g.upload(&vec![bf16::ZERO; 4 * 2 * 192]).unwrap();
    let kv = g.upload(&vec![bf16::ZERO; 2 * 7 * 320]).unwrap();
    let mut out = g.upload(&vec![bf16::ZERO; 4 * 2 * 128]).unwrap();
    let err = |shape: MlaShape, stride: usize, out: &mut cudarc::driver::CudaSlice<bf16>| {
        mla_prefill(
            &g,
            &q.as_view(),
            &kv.as_view(),
            stride,
            &shape,
            0.1,
            &mut out.as_view_mut(),
        )
        .err()
        .map(|e| e.to_string())
    };
    let e = err(s(4, 96, 128), 7 * 224, &mut out).expect("no kernel for 96/128");
    assert!(e.contains("mla_prefill") && e.contains("no kernel"), "{e}");
    let e = err(s(4, 192, 128), 6 * 320, &mut out).expect("stride short of the rows");
    assert!(e.contains("head stride"), "{e}");
    let e = err(s(5, 192, 128), 8 * 320, &mut out).expect("q too short for T = 5");
    assert!(e.contains("mla_prefill"), "{e}");
    if supported(&g, 192, 128) {
        assert_eq!(err(s(4, 192, 128), 7 * 320, &mut out), None);
    }
    let e = mla_prefill_with(
        &g,
        &q.as_view(),
        &kv.as_view(),
        7 * 96,
        &s(4, 64, 32),
        0.1,
        true,
        &mut out.as_view_mut(),
    )
    .err()
    .map(|e| e.to_string())
    .expect("no P-as-one-bf16 kernel for 64/32");
    assert!(e.contains("no kernel") && e.contains("one bf16"), "{e}");
}
