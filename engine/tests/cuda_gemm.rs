//! Parity of the CUDA GEMMs against their CPU twins: W4A16 group-32 (dense and grouped-MoE forms, the
//! converter's INT4 layout) and the cuBLAS bf16 GEMM, at small shapes and at K2.6 shapes (expert
//! projections 4096x7168 and 7168x2048, their TP8 slices 512x7168 and 7168x256, 384 experts, hidden 7168,
//! lm_head 163840x7168). Seeded inputs (seed printed), NaN-poisoned outputs, rel = max abs / max |ref|.
//! Needs a GPU: skips without one unless KDTREE_REQUIRE_GPU=1. Run: scripts/gpu-test.sh.
#![cfg(feature = "cuda")]

mod cuda_common;

// CPU twins (one block, so the paths are easy to fix when engine/src/cpu/ops splits one op per file).
use kdtree_engine::cpu::ops::{matmul_bf16, matmul_i4g32};

use cuda_common::*;
use half::bf16;
use kdtree_engine::cuda::ops;
use kdtree_engine::cuda::Gpu;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::RngCore;
use rand_chacha::ChaCha8Rng;

/// W4A16 vs the exact-f32 twin: each weight rounded once to bf16(q·s) and the output rounded to bf16
/// (up to 2^-8 of max |y|), plus f32 order. Measured on the H200 (2026-12-01, one seed per case): max
/// 3.7e-3 over 14 dense and 5 grouped cases; 1.6x.
const W4A16_TOL: f64 = 6.0e-3;
/// bf16 GEMM with f32 output: only the f32 summation order differs from the twin. Measured: max 9.4e-6
/// (lm_head 163840x7168) over 3 cases; 3x.
const GEMM_F32_TOL: f64 = 3.0e-5;
/// bf16 GEMM with bf16 output: one output rounding (2^-8 of max |y|) plus f32 order. Measured: max 2.4e-3
/// over 4 cases; bound 3.9e-3 + order.
const GEMM_BF16_TOL: f64 = 4.5e-3;

/// Random INT4 weights `[experts, n, k]`: packed bytes (all 256 values) and bf16 scales in ±[2^-9, 2^-6).
fn int4_weights(r: &mut ChaCha8Rng, experts: usize, n: usize, k: usize) -> (Vec<u8>, Vec<bf16>) {
    let mut packed = vec![0u8; experts * n * k / 2];
    r.fill_bytes(&mut packed);
    let scales = rand_bf16(r, experts * n * k / 32, 1.0 / 512.0, 1.0 / 64.0);
    (packed, scales)
}

/// Fast random bf16 (sign random, magnitude in [2^-9, 1)), for the multi-GB lm_head weight.
fn fast_bf16(r: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            let u = r.next_u32();
            let exp = 118 + (u >> 24) % 9; // 2^-9 .. 2^-1
            bf16::from_bits(((u & 0x8000) as u16) | ((exp as u16) << 7) | ((u & 0x7f) as u16))
        })
        .collect()
}

fn run_dense(g: &Gpu, x: &[bf16], m: usize, packed: &[u8], scales: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    let plan = ops::w4a16_gemm::plan_dense(g, m, n, k);
    let dx = g.upload(x).unwrap();
    let dp = g.upload(packed).unwrap();
    let ds = g.upload(scales).unwrap();
    let mut ws = g.upload(&nan_f32(plan.workspace_len(m, n).max(1))).unwrap();
    let mut out = g.upload(&nan_bf16(m * n)).unwrap();
    ops::w4a16_gemm::w4a16_gemm(
        g,
        &dx.as_view(),
        k,
        m,
        &dp.as_view(),
        &ds.as_view(),
        n,
        k,
        &mut ws.as_view_mut(),
        &mut out.as_view_mut(),
        n,
    )
    .unwrap();
    g.download(&out).unwrap()
}

#[test]
fn w4a16_gemm_parity() {
    let Some(g) = gpu() else { return };
    // (M, N, K): small shapes (incl. N not a multiple of 128, M over one 32-row tile), then K2.6 expert
    // projections (gate+up fused 4096x7168, down 7168x2048) and their TP8 slices (512x7168, 7168x256).
    let cases = [
        (1, 32, 128),
        (3, 64, 256),
        (17, 160, 384),
        (40, 96, 512),
        (70, 128, 1024),
        (1, 4096, 7168),
        (8, 4096, 7168),
        (33, 4096, 7168),
        (1, 7168, 2048),
        (64, 7168, 2048),
        (1, 512, 7168),
        (16, 512, 7168),
        (5, 7168, 256),
        (200, 512, 2048),
    ];
    for (i, &(m, n, k)) in cases.iter().enumerate() {
        let plan = ops::w4a16_gemm::plan_dense(&g, m, n, k);
        let case = format!(
            "w4a16_gemm(M={m},N={n},K={k},i4g32) [tile {} rows, {} splits]",
            plan.tile_rows(),
            plan.splits
        );
        let mut r = rng(1000 + i as u64);
        let x = rand_bf16(&mut r, m * k, 0.01, 1.0);
        let (packed, scales) = int4_weights(&mut r, 1, n, k);
        let got = run_dense(&g, &x, m, &packed, &scales, n, k);
        let want = matmul_i4g32(&widen(&x), &packed, &scales, m, k, n);
        check_bf16(&case, &got, &want, W4A16_TOL);
    }
}

#[test]
fn w4a16_gemm_rejects_bad_shapes() {
    let Some(g) = gpu() else { return };
    let x = g.upload(&vec![bf16::ONE; 7168]).unwrap();
    let p = g.upload(&vec![0u8; 512 * 3584]).unwrap();
    let s = g.upload(&vec![bf16::ONE; 512 * 224 - 1]).unwrap();
    let mut ws = g.upload(&vec![0f32; 1 << 20]).unwrap();
    let mut out = g.upload(&vec![bf16::ZERO; 512]).unwrap();
    let e = ops::w4a16_gemm::w4a16_gemm(
        &g,
        &x.as_view(),
        7168,
        1,
        &p.as_view(),
        &s.as_view(),
        512,
        7168,
        &mut ws.as_view_mut(),
        &mut out.as_view_mut(),
        512,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("w4a16_gemm") && e.contains("114687") && e.contains("224"),
        "{e}"
    );
}

/// Grouped MoE GEMM: ids (token, slot) -> expert; the ids go through moe_align on the device.
/// `per_pair_x`: x is `[P, K]` (down projection, x_row_div 1), else `[T, K]` (gate/up, x_row_div top_k).
#[allow(clippy::too_many_arguments)]
fn moe_case(
    g: &Gpu,
    case: &str,
    r: &mut ChaCha8Rng,
    t: usize,
    top_k: usize,
    e: usize,
    used: usize,
    n: usize,
    k: usize,
    per_pair_x: bool,
    ids_on_device: Option<Vec<i32>>,
) {
    let p = t * top_k;
    let ids = ids_on_device.unwrap_or_else(|| {
        let mut pool: Vec<i32> = (0..e as i32).collect();
        pool.shuffle(r);
        pool.truncate(used);
        (0..t)
            .flat_map(|_| pool.choose_multiple(r, top_k).copied().collect::<Vec<_>>())
            .collect()
    });
    let xrows = if per_pair_x { p } else { t };
    let x = rand_bf16(r, xrows * k, 0.01, 1.0);
    let (packed, scales) = int4_weights(r, e, n, k);
    let plan = ops::w4a16_gemm::plan_moe(g, p, e, n, k);
    let tile = plan.tile_rows();
    let mt = ops::moe_align::max_tiles(p, e, tile);
    let di = g.upload(&ids).unwrap();
    let mut sorted = g.upload(&vec![-1i32; p]).unwrap();
    let mut tiles = g.upload(&vec![-1i32; 3 * mt]).unwrap();
    let mut nt = g.upload(&[-1i32]).unwrap();
    ops::moe_align::moe_align(
        g,
        &di.as_view(),
        e,
        tile,
        &mut sorted.as_view_mut(),
        &mut tiles.as_view_mut(),
        &mut nt.as_view_mut(),
    )
    .unwrap();
    let dx = g.upload(&x).unwrap();
    let dp = g.upload(&packed).unwrap();
    let ds = g.upload(&scales).unwrap();
    let mut ws = g.upload(&nan_f32(plan.workspace_len(p, n))).unwrap();
    let mut out = g.upload(&nan_bf16(p * n)).unwrap();
    let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), nt.as_view());
    let routing = ops::w4a16_gemm::Routing {
        sorted: &sv,
        tiles: &tv,
        max_tiles: mt,
        n_tiles: &nv,
        tile_rows: tile,
    };
    let div = if per_pair_x { 1 } else { top_k };
    ops::w4a16_gemm::moe_w4a16(
        g,
        ops::w4a16_gemm::MoeX::Rows {
            x: &dx.as_view(),
            ld: k,
            row_div: div,
        },
        &routing,
        &[(&dp.as_view(), &ds.as_view())],
        ops::w4a16_gemm::MoeDims {
            pairs: p,
            n_experts: e,
            n,
            k,
        },
        &mut ws.as_view_mut(),
        (&mut out.as_view_mut(), n),
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    let xf = widen(&x);
    let (eb, es) = (n * k / 2, n * k / 32);
    let mut want = Vec::with_capacity(p * n);
    for (q, &ex) in ids.iter().enumerate() {
        let xr = if per_pair_x { q } else { q / top_k };
        let ex = ex as usize;
        want.extend(matmul_i4g32(
            &xf[xr * k..(xr + 1) * k],
            &packed[ex * eb..(ex + 1) * eb],
            &scales[ex * es..(ex + 1) * es],
            1,
            k,
            n,
        ));
    }
    check_bf16(
        &format!("{case} [tile {tile} rows, {} splits]", plan.splits),
        &got,
        &want,
        W4A16_TOL,
    );
}

#[test]
fn moe_w4a16_gemm_parity() {
    let Some(g) = gpu() else { return };
    // (T, top_k, E, experts used, N, K, x per pair)
    let cases = [
        (3, 2, 8, 8, 64, 256, false),
        (6, 4, 16, 5, 96, 384, true),
        (1, 8, 384, 384, 256, 7168, false),
        (40, 8, 384, 24, 256, 7168, false),
        (9, 8, 384, 384, 7168, 256, true),
    ];
    for (i, &(t, k, e, used, n, kk, pp)) in cases.iter().enumerate() {
        let case = format!("moe_w4a16_gemm(T={t},top_k={k},E={e},used={used},N={n},K={kk},x_per_pair={pp})");
        let mut r = rng(1100 + i as u64);
        moe_case(&g, &case, &mut r, t, k, e, used, n, kk, pp, None);
    }
}

/// The device chain router -> align -> grouped GEMM with the expert ids never leaving the device (they are
/// read back only to build the reference afterwards).
#[test]
fn moe_chain_ids_stay_on_device() {
    let Some(g) = gpu() else { return };
    let (t, e, top_k, n, k) = (4, 384, 8, 256, 7168);
    let mut r = rng(1200);
    let logits = rand_f32(&mut r, t * e, -6.0, 6.0);
    let rc = ops::moe_router::RouterCfg {
        n_experts: e,
        n_group: 1,
        topk_group: 1,
        top_k,
        norm_topk_prob: true,
        routed_scaling: 2.827,
    };
    let dl = g.upload(&logits).unwrap();
    let mut di = g.upload(&vec![-1i32; t * top_k]).unwrap();
    let mut dw = g.upload(&nan_f32(t * top_k)).unwrap();
    ops::moe_router::moe_router(
        &g,
        &dl.as_view(),
        None,
        t,
        rc,
        &mut di.as_view_mut(),
        &mut dw.as_view_mut(),
    )
    .unwrap();
    let ids = g.download(&di).unwrap();
    moe_case(
        &g,
        "moe_chain(router->align->moe_w4a16_gemm,T=4,E=384,N=256,K=7168)",
        &mut r,
        t,
        top_k,
        e,
        e,
        n,
        k,
        false,
        Some(ids),
    );
}

#[test]
fn gemm_bf16_parity() {
    let Some(g) = gpu() else { return };
    // (T, K, N, f32 out): q_a 7168->1536, kv_a 7168->576, q_b 1536->12288, router 7168->384 (f32),
    // o_proj 8192->7168, lm_head 7168->163840 (f32 logits), a small odd shape (K % 8 != 0: cuBLAS only).
    // Each case runs through the small-M tensor-core GEMM (kernels/cuda/gemm_small_bf16.cu) and through cuBLAS
    // (`set_small_gemm_rows(0)`). Extra small-GEMM shapes: every token tile (1..8, 9..16, 17..32, 33..64 rows and
    // several groups), N not a multiple of the CTA's 64 columns, K not a multiple of its 64-k step, a split count
    // of 1 (lm_head-wide N) and many (the router), rows past one launch's workspace (the router at 257 rows).
    let cases = [
        (1, 7168, 1536, false),
        (8, 7168, 576, false),
        (5, 1536, 12288, false),
        (3, 7168, 384, true),
        (2, 8192, 7168, false),
        (1, 7168, 163_840, true),
        (7, 100, 33, true),
        (2, 7168, 384, true),
        (4, 7168, 1536, false),
        (1, 2048, 7168, false),
        (3, 1032, 96, true),
        (4, 256, 4352, true),
        (17, 7168, 2112, false),
        (33, 1024, 7168, false),
        (65, 7168, 384, true),
        (129, 1536, 1000, false),
        (257, 7168, 384, true),
        (11, 8, 40, true),
    ];
    let small0 = g.small_gemm_rows();
    for (i, &(t, k, n, f32_out)) in cases.iter().enumerate() {
        for small in [true, false] {
            if small && k % 8 != 0 {
                continue; // the small GEMM needs 16-byte rows
            }
            g.set_small_gemm_rows(if small { usize::MAX } else { 0 });
            let path = if small { "small" } else { "cublas" };
            let case = format!(
                "gemm_bf16(T={t},K={k},N={n},out={},{path})",
                if f32_out { "f32" } else { "bf16" }
            );
            let mut r = rng(1300 + i as u64);
            let x = rand_bf16(&mut r, t * k, 0.01, 1.0);
            let w = fast_bf16(&mut r, n * k);
            let dx = g.upload(&x).unwrap();
            let dw = g.upload(&w).unwrap();
            let want = matmul_bf16(&widen(&x), &w, t, k, n);
            if f32_out {
                let mut dy = g.upload(&nan_f32(t * n)).unwrap();
                ops::gemm_bf16::gemm_bf16(&g, &dx.as_view(), &dw.as_view(), &mut dy.as_view_mut(), t, k, n).unwrap();
                check(&case, &g.download(&dy).unwrap(), &want, GEMM_F32_TOL);
            } else {
                let mut dy = g.upload(&nan_bf16(t * n)).unwrap();
                ops::gemm_bf16::gemm_bf16(&g, &dx.as_view(), &dw.as_view(), &mut dy.as_view_mut(), t, k, n).unwrap();
                check_bf16(&case, &g.download(&dy).unwrap(), &want, GEMM_BF16_TOL);
            }
        }
    }
    // Output rows ld_y apart (a vocab shard's logits in its columns of the merged rows): the columns outside
    // [col0, col0 + N) keep their poison.
    for small in [true, false] {
        g.set_small_gemm_rows(if small { usize::MAX } else { 0 });
        let (t, k, n, ld, col0) = (3usize, 7168usize, 1000usize, 2560usize, 640usize);
        let mut r = rng(1390);
        let x = rand_bf16(&mut r, t * k, 0.01, 1.0);
        let w = fast_bf16(&mut r, n * k);
        let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let mut dy = g.upload(&nan_f32(t * ld)).unwrap();
        ops::gemm_bf16::gemm_bf16_ld(&g, &dx.as_view(), &dw.as_view(), &mut dy.slice_mut(col0..), t, k, n, ld).unwrap();
        let got = g.download(&dy).unwrap();
        let want = matmul_bf16(&widen(&x), &w, t, k, n);
        let mine: Vec<f32> = (0..t)
            .flat_map(|m| got[m * ld + col0..m * ld + col0 + n].to_vec())
            .collect();
        check(
            &format!("gemm_bf16_ld(T={t},N={n},ld={ld},small={small})"),
            &mine,
            &want,
            GEMM_F32_TOL,
        );
        for m in 0..t {
            for c in (0..ld).filter(|c| *c < col0 || *c >= col0 + n) {
                assert!(
                    got[m * ld + c].is_nan(),
                    "row {m} column {c} outside the shard was written"
                );
            }
        }
    }
    g.set_small_gemm_rows(small0);
}

/// The small-M GEMM's rows do not depend on the row count (a decode step of 1 row, a tree verify of 17 or 65 and a
/// batched round of hundreds sum their shared rows alike): every row of a T-row call, bit for bit, equals that row
/// alone, for T across the token tiles (8, 16, 32, 64), several token groups and several launches (the router's and
/// q_a|kv_a's split-K workspace holds 192 and 64 rows a launch), on K2.6 TP8 rank-0 shapes, f32 and bf16 out; and
/// within the bf16 bound of the CPU.
#[test]
fn small_gemm_rows_do_not_depend_on_the_row_count() {
    let Some(g) = gpu() else { return };
    let small0 = g.small_gemm_rows();
    g.set_small_gemm_rows(usize::MAX);
    // (K, N, f32 out): q_a|kv_a, o_proj, the router (f32 logits), the shared expert's down, q_b.
    for (i, &(k, n, f32_out)) in [
        (7168, 2112, false),
        (1024, 7168, false),
        (7168, 384, true),
        (256, 7168, false),
        (1536, 1536, false),
    ]
    .iter()
    .enumerate()
    {
        let t_max = 300;
        let mut r = rng(1400 + i as u64);
        let x = rand_bf16(&mut r, t_max * k, -1.0, 1.0);
        let w = fast_bf16(&mut r, n * k);
        let dw = g.upload(&w).unwrap();
        let run = |rows: &[usize]| -> Vec<u32> {
            // Rows `rows` of x as one call; each output row's bits (f32 bits, or bf16 bits widened).
            let xs: Vec<bf16> = rows
                .iter()
                .flat_map(|&row| x[row * k..(row + 1) * k].to_vec())
                .collect();
            let dxs = g.upload(&xs).unwrap();
            let t = rows.len();
            if f32_out {
                let mut dy = g.upload(&nan_f32(t * n)).unwrap();
                ops::gemm_bf16::gemm_bf16(&g, &dxs.as_view(), &dw.as_view(), &mut dy.as_view_mut(), t, k, n).unwrap();
                g.download(&dy).unwrap().iter().map(|v| v.to_bits()).collect()
            } else {
                let mut dy = g.upload(&nan_bf16(t * n)).unwrap();
                ops::gemm_bf16::gemm_bf16(&g, &dxs.as_view(), &dw.as_view(), &mut dy.as_view_mut(), t, k, n).unwrap();
                g.download(&dy).unwrap().iter().map(|v| v.to_bits() as u32).collect()
            }
        };
        let alone: Vec<Vec<u32>> = (0..t_max).map(|row| run(&[row])).collect();
        for t in [2usize, 3, 8, 9, 16, 17, 31, 33, 64, 65, 130, 257, 300] {
            // Rows taken out of order (a batch's rows are not the first ones), so tile boundaries move.
            let rows: Vec<usize> = (0..t).map(|j| (j * 37 + 11 * t) % t_max).collect();
            let got = run(&rows);
            for (j, &row) in rows.iter().enumerate() {
                assert_eq!(
                    &got[j * n..(j + 1) * n],
                    &alone[row][..],
                    "K={k} N={n}: row {row} at position {j} of a {t}-row call differs from the row alone"
                );
            }
        }
        let want = matmul_bf16(&widen(&x[..17 * k]), &w, 17, k, n);
        let got17: Vec<f32> = run(&(0..17).collect::<Vec<_>>())
            .iter()
            .map(|&b| {
                if f32_out {
                    f32::from_bits(b)
                } else {
                    bf16::from_bits(b as u16).to_f32()
                }
            })
            .collect();
        let tol = if f32_out { GEMM_F32_TOL } else { GEMM_BF16_TOL };
        check(&format!("small gemm(T=17,K={k},N={n}) vs the CPU"), &got17, &want, tol);
        let (splits, per) = ops::gemm_bf16::small_plan_on(&g, n, k);
        println!(
            "PARITY small gemm rows (K={k},N={n},f32_out={f32_out},splits={splits}x{per} steps): T = 2 .. 300, every \
             row == the row alone, bit for bit"
        );
    }
    g.set_small_gemm_rows(small0);
}

/// With `batch_invariant` on, a W4A16 row's bits do not depend on the call's rows: every token of a T-token grouped
/// call (K2.6 TP8 gate|up and down, the trained pair's gate|up) equals that token alone, bit for bit, for T from 1
/// to 257 (a budget-256 tree) — one k-split per shape, the small form throughout; and a dense call's rows likewise.
#[test]
fn w4a16_rows_do_not_depend_on_the_row_count_when_invariant() {
    let Some(g) = gpu() else { return };
    g.set_batch_invariant(true);
    // (T max, top_k, E, used, N, K, matrices, x per pair)
    let cases: [LargeCase; 3] = [
        (257, 8, 384, 384, 256, 7168, 2, false),
        (257, 8, 384, 384, 7168, 256, 1, true),
        (257, 4, 32, 32, 256, 256, 2, false),
    ];
    for (ci, &c) in cases.iter().enumerate() {
        let (t_max, top_k, e, _used, n, k, nmat, per_pair) = c;
        let (ids, x, _mats, dm, _pool) = large_case(&g, 1900 + ci as u64, c);
        let xrow = |t: usize| {
            if per_pair {
                t * top_k * k..(t + 1) * top_k * k
            } else {
                t * k..(t + 1) * k
            }
        };
        let width = nmat * n;
        let alone: Vec<(Vec<bf16>, usize)> = (0..t_max)
            .map(|t| {
                let (o, plan) = moe_run(
                    &g,
                    &ids[t * top_k..(t + 1) * top_k],
                    top_k,
                    &x[xrow(t)],
                    per_pair,
                    e,
                    (n, k),
                    &dm,
                );
                (o, plan.splits)
            })
            .collect();
        let splits = alone[0].1;
        for tt in [2usize, 9, 65, 257] {
            let (o, plan) = moe_run(
                &g,
                &ids[..tt * top_k],
                top_k,
                &x[xrow(0).start..xrow(tt - 1).end],
                per_pair,
                e,
                (n, k),
                &dm,
            );
            assert!(
                !plan.large && plan.splits == splits,
                "T={tt}: {plan:?}, one token's splits {splits}"
            );
            for (t, (a, _)) in alone.iter().enumerate().take(tt) {
                let got = &o[t * top_k * width..(t + 1) * top_k * width];
                let differ = got.iter().zip(a).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                assert_eq!(
                    differ, 0,
                    "case {ci} (N={n},K={k}): token {t} of {tt} differs from the token alone in {differ} outputs"
                );
            }
        }
        println!(
            "PARITY w4a16 invariant (E={e},top_k={top_k},N={n},K={k},mats={nmat}): {splits} splits; \
             T = 2 .. {t_max}, every token == the token alone, bit for bit"
        );
    }
    // Dense: rows 1 .. 130 against each row alone.
    let (n, k) = (2048, 7168);
    let mut r = rng(1950);
    let (packed, scales) = int4_weights(&mut r, 1, n, k);
    let x = rand_bf16(&mut r, 130 * k, 0.01, 1.0);
    let alone: Vec<Vec<bf16>> = (0..130)
        .map(|row| run_dense(&g, &x[row * k..(row + 1) * k], 1, &packed, &scales, n, k))
        .collect();
    for m in [3usize, 17, 130] {
        let o = run_dense(&g, &x[..m * k], m, &packed, &scales, n, k);
        for (row, a) in alone.iter().enumerate().take(m) {
            assert!(
                o[row * n..(row + 1) * n]
                    .iter()
                    .zip(a)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "dense N={n} K={k}: row {row} of {m} differs from the row alone"
            );
        }
    }
    println!("PARITY w4a16 invariant dense (N={n},K={k}): M = 3, 17, 130, every row == the row alone, bit for bit");
    g.set_batch_invariant(false);
}

/// A decode-step-shaped chain of every custom op (embed → rms_norm → W4A16 gate+up → silu_mul → W4A16
/// down → residual add → rope → router → align → grouped W4A16 → argmax) captured into one CUDA graph and
/// replayed: bit-identical to the eager run, which shows the launches do no host sync and no allocation.
#[test]
fn op_chain_is_graph_capturable() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(g) = gpu() else { return };
    let (v, h, i, t, e, top_k, ni) = (1000usize, 512usize, 256usize, 2usize, 16usize, 4usize, 128usize);
    let mut r = rng(1400);
    let table = g.upload(&rand_bf16(&mut r, v * h, 0.01, 1.0)).unwrap();
    let ids = g.upload(&[7i32, 993]).unwrap();
    let norm_w = g.upload(&rand_bf16(&mut r, h, 0.5, 1.5)).unwrap();
    let (p13, s13) = int4_weights(&mut r, 1, 2 * i, h);
    let (p2, s2) = int4_weights(&mut r, 1, h, i);
    let (pe, se) = int4_weights(&mut r, e, ni, h);
    let (p13, s13, p2, s2, pe, se) = (
        g.upload(&p13).unwrap(),
        g.upload(&s13).unwrap(),
        g.upload(&p2).unwrap(),
        g.upload(&s2).unwrap(),
        g.upload(&pe).unwrap(),
        g.upload(&se).unwrap(),
    );
    let logits = g.upload(&rand_f32(&mut r, t * e, -4.0, 4.0)).unwrap();
    let pos = g.upload(&[3i32, 70_000]).unwrap();
    let inv = g
        .upload(&kdtree_engine::cpu::ops::yarn_inv_freq(64, 50000.0, None))
        .unwrap();
    let rc = ops::moe_router::RouterCfg {
        n_experts: e,
        n_group: 1,
        topk_group: 1,
        top_k,
        norm_topk_prob: true,
        routed_scaling: 2.827,
    };
    let p = t * top_k;
    let plan13 = ops::w4a16_gemm::plan_dense(&g, t, 2 * i, h);
    let plan2 = ops::w4a16_gemm::plan_dense(&g, t, h, i);
    let plane = ops::w4a16_gemm::plan_moe(&g, p, e, ni, h);
    let mt = ops::moe_align::max_tiles(p, e, plane.tile_rows());
    let mut hid = g.zeros::<bf16>(t * h).unwrap();
    let mut xn = g.zeros::<bf16>(t * h).unwrap();
    let mut gu = g.zeros::<bf16>(t * 2 * i).unwrap();
    let mut act = g.zeros::<bf16>(t * i).unwrap();
    let mut down = g.zeros::<bf16>(t * h).unwrap();
    let mut ws = g
        .zeros::<f32>(
            [
                plan13.workspace_len(t, 2 * i),
                plan2.workspace_len(t, h),
                plane.workspace_len(p, ni),
            ]
            .into_iter()
            .max()
            .unwrap(),
        )
        .unwrap();
    let mut rid = g.zeros::<i32>(p).unwrap();
    let mut rw = g.zeros::<f32>(p).unwrap();
    let mut sorted = g.zeros::<i32>(p).unwrap();
    let mut tiles = g.zeros::<i32>(3 * mt).unwrap();
    let mut nt = g.zeros::<i32>(1).unwrap();
    let mut eo = g.zeros::<bf16>(p * ni).unwrap();
    let mut am = g.zeros::<u32>(p).unwrap(); // argmax of each of the P expert-output rows
    let mut step = || {
        ops::embed::embed_gather(&g, &ids.as_view(), &table.as_view(), &mut hid.as_view_mut(), v, h).unwrap();
        ops::rms_norm::rms_norm(
            &g,
            &hid.as_view(),
            &norm_w.as_view(),
            &mut xn.as_view_mut(),
            t,
            h,
            h,
            h,
            1e-5,
        )
        .unwrap();
        ops::w4a16_gemm::w4a16_gemm(
            &g,
            &xn.as_view(),
            h,
            t,
            &p13.as_view(),
            &s13.as_view(),
            2 * i,
            h,
            &mut ws.as_view_mut(),
            &mut gu.as_view_mut(),
            2 * i,
        )
        .unwrap();
        ops::silu_mul::silu_mul(&g, &gu.slice(0..), &gu.slice(i..), &mut act.as_view_mut(), t, i, 2 * i).unwrap();
        ops::w4a16_gemm::w4a16_gemm(
            &g,
            &act.as_view(),
            i,
            t,
            &p2.as_view(),
            &s2.as_view(),
            h,
            i,
            &mut ws.as_view_mut(),
            &mut down.as_view_mut(),
            h,
        )
        .unwrap();
        ops::residual_add::residual_add(&g, &mut hid.as_view_mut(), &down.as_view()).unwrap();
        let l = ops::rope::RopeLayout {
            tokens: t,
            heads: 1,
            ld_token: h,
            ld_head: h,
            offset: h - 64,
            dim: 64,
        };
        ops::rope::rope_interleaved(&g, &mut hid.as_view_mut(), &pos.as_view(), &inv.as_view(), l, 1.0).unwrap();
        ops::moe_router::moe_router(
            &g,
            &logits.as_view(),
            None,
            t,
            rc,
            &mut rid.as_view_mut(),
            &mut rw.as_view_mut(),
        )
        .unwrap();
        ops::moe_align::moe_align(
            &g,
            &rid.as_view(),
            e,
            plane.tile_rows(),
            &mut sorted.as_view_mut(),
            &mut tiles.as_view_mut(),
            &mut nt.as_view_mut(),
        )
        .unwrap();
        let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), nt.as_view());
        let routing = ops::w4a16_gemm::Routing {
            sorted: &sv,
            tiles: &tv,
            max_tiles: mt,
            n_tiles: &nv,
            tile_rows: plane.tile_rows(),
        };
        ops::w4a16_gemm::moe_w4a16(
            &g,
            ops::w4a16_gemm::MoeX::Rows {
                x: &hid.as_view(),
                ld: h,
                row_div: top_k,
            },
            &routing,
            &[(&pe.as_view(), &se.as_view())],
            ops::w4a16_gemm::MoeDims {
                pairs: p,
                n_experts: e,
                n: ni,
                k: h,
            },
            &mut ws.as_view_mut(),
            (&mut eo.as_view_mut(), ni),
        )
        .unwrap();
        ops::argmax::argmax(&g, &eo.as_view(), p, ni, ni, &mut am.as_view_mut()).unwrap();
    };
    step();
    g.sync().unwrap();
    g.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    step();
    let graph = g
        .stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    let eager = (
        g.download(&hid).unwrap(),
        g.download(&eo).unwrap(),
        g.download(&am).unwrap(),
        g.download(&rid).unwrap(),
    );
    assert!(
        eager.0.iter().chain(&eager.1).all(|x| !x.is_nan()),
        "eager chain produced NaN"
    );
    // Poison the outputs, replay the graph, and demand the same bits.
    g.stream.memcpy_htod(&nan_bf16(t * h), &mut hid).unwrap();
    g.stream.memcpy_htod(&nan_bf16(p * ni), &mut eo).unwrap();
    graph.launch().unwrap();
    let replay = (
        g.download(&hid).unwrap(),
        g.download(&eo).unwrap(),
        g.download(&am).unwrap(),
        g.download(&rid).unwrap(),
    );
    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&eager.0),
        bits(&replay.0),
        "hidden state differs between eager and graph replay"
    );
    assert_eq!(
        bits(&eager.1),
        bits(&replay.1),
        "expert outputs differ between eager and graph replay"
    );
    assert_eq!(
        (eager.2, eager.3),
        (replay.2, replay.3),
        "argmax / router ids differ between eager and graph replay"
    );
    println!("PARITY op_chain(graph replay == eager) exact");
}

/// The fused MoE forms: gate and up in one launch (`moe_w4a16` with two matrices, `[gate | up]` rows) against the CPU
/// twin, and the down projection with the SwiGLU in its x staging (`MoeX::SiluGateUp`) bit for bit
/// against `silu_mul` followed by the plain grouped GEMM (same plan, same rounding), and against the twin.
#[test]
fn moe_fused_gate_up_and_silu_down() {
    let Some(g) = gpu() else { return };
    // (T, top_k, E, mi, h)
    for (ci, &(t, top_k, e, mi, h)) in [
        (5usize, 4usize, 16usize, 256usize, 512usize),
        (1, 8, 384, 256, 7168),
        (33, 8, 64, 512, 1024),
    ]
    .iter()
    .enumerate()
    {
        let case = format!("moe_fused(T={t},top_k={top_k},E={e},mi={mi},h={h})");
        let mut r = rng(1500 + ci as u64);
        let p = t * top_k;
        let ids: Vec<i32> = (0..p).map(|_| (r.next_u32() % e as u32) as i32).collect();
        let x = rand_bf16(&mut r, t * h, 0.01, 1.0);
        let ((pg, sg), (pu, su), (pd, sd)) = (
            int4_weights(&mut r, e, mi, h),
            int4_weights(&mut r, e, mi, h),
            int4_weights(&mut r, e, h, mi),
        );
        let plan_gu = ops::w4a16_gemm::plan_moe(&g, p, e, 2 * mi, h);
        let plan_d = ops::w4a16_gemm::plan_moe(&g, p, e, h, mi);
        assert_eq!(
            plan_gu.tile_rows(),
            plan_d.tile_rows(),
            "{case}: one routing serves both"
        );
        let tile = plan_gu.tile_rows();
        let mt = ops::moe_align::max_tiles(p, e, tile);
        let di = g.upload(&ids).unwrap();
        let (mut sorted, mut tiles, mut nt) = (
            g.upload(&vec![-1i32; p]).unwrap(),
            g.upload(&vec![-1i32; 3 * mt]).unwrap(),
            g.upload(&[-1i32]).unwrap(),
        );
        ops::moe_align::moe_align(
            &g,
            &di.as_view(),
            e,
            tile,
            &mut sorted.as_view_mut(),
            &mut tiles.as_view_mut(),
            &mut nt.as_view_mut(),
        )
        .unwrap();
        let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), nt.as_view());
        let routing = ops::w4a16_gemm::Routing {
            sorted: &sv,
            tiles: &tv,
            max_tiles: mt,
            n_tiles: &nv,
            tile_rows: tile,
        };
        let up = |v: &[u8]| g.upload(v).unwrap();
        let ub = |v: &[bf16]| g.upload(v).unwrap();
        let (dpg, dsg, dpu, dsu, dpd, dsd) = (up(&pg), ub(&sg), up(&pu), ub(&su), up(&pd), ub(&sd));
        let dx = ub(&x);
        let wsl = plan_gu.workspace_len(p, 2 * mi).max(plan_d.workspace_len(p, h));
        let mut ws = g.upload(&nan_f32(wsl)).unwrap();
        let mut gu = g.upload(&nan_bf16(p * 2 * mi)).unwrap();
        ops::w4a16_gemm::moe_w4a16(
            &g,
            ops::w4a16_gemm::MoeX::Rows {
                x: &dx.as_view(),
                ld: h,
                row_div: top_k,
            },
            &routing,
            &[(&dpg.as_view(), &dsg.as_view()), (&dpu.as_view(), &dsu.as_view())],
            ops::w4a16_gemm::MoeDims {
                pairs: p,
                n_experts: e,
                n: mi,
                k: h,
            },
            &mut ws.as_view_mut(),
            (&mut gu.as_view_mut(), 2 * mi),
        )
        .unwrap();
        let gu_host = g.download(&gu).unwrap();
        let xf = widen(&x);
        let (eb, es) = (mi * h / 2, mi * h / 32);
        let (mut want_g, mut want_u, mut got_g, mut got_u) = (vec![], vec![], vec![], vec![]);
        for (q, &ex) in ids.iter().enumerate() {
            let (xr, ex) = (q / top_k, ex as usize);
            want_g.extend(matmul_i4g32(
                &xf[xr * h..(xr + 1) * h],
                &pg[ex * eb..(ex + 1) * eb],
                &sg[ex * es..(ex + 1) * es],
                1,
                h,
                mi,
            ));
            want_u.extend(matmul_i4g32(
                &xf[xr * h..(xr + 1) * h],
                &pu[ex * eb..(ex + 1) * eb],
                &su[ex * es..(ex + 1) * es],
                1,
                h,
                mi,
            ));
            got_g.extend_from_slice(&gu_host[q * 2 * mi..q * 2 * mi + mi]);
            got_u.extend_from_slice(&gu_host[q * 2 * mi + mi..(q + 1) * 2 * mi]);
        }
        check_bf16(
            &format!("{case} gate [{} splits]", plan_gu.splits),
            &got_g,
            &want_g,
            W4A16_TOL,
        );
        check_bf16(&format!("{case} up"), &got_u, &want_u, W4A16_TOL);
        // Down with the fused SwiGLU vs silu_mul + the plain grouped GEMM: the same bits.
        let mut fused = g.upload(&nan_bf16(p * h)).unwrap();
        ops::w4a16_gemm::moe_w4a16(
            &g,
            ops::w4a16_gemm::MoeX::SiluGateUp {
                gu: &gu.as_view(),
                ld: 2 * mi,
            },
            &routing,
            &[(&dpd.as_view(), &dsd.as_view())],
            ops::w4a16_gemm::MoeDims {
                pairs: p,
                n_experts: e,
                n: h,
                k: mi,
            },
            &mut ws.as_view_mut(),
            (&mut fused.as_view_mut(), h),
        )
        .unwrap();
        let mut act = g.upload(&nan_bf16(p * mi)).unwrap();
        ops::silu_mul::silu_mul(
            &g,
            &gu.as_view(),
            &gu.slice(mi..),
            &mut act.as_view_mut(),
            p,
            mi,
            2 * mi,
        )
        .unwrap();
        let mut twostep = g.upload(&nan_bf16(p * h)).unwrap();
        ops::w4a16_gemm::moe_w4a16(
            &g,
            ops::w4a16_gemm::MoeX::Rows {
                x: &act.as_view(),
                ld: mi,
                row_div: 1,
            },
            &routing,
            &[(&dpd.as_view(), &dsd.as_view())],
            ops::w4a16_gemm::MoeDims {
                pairs: p,
                n_experts: e,
                n: h,
                k: mi,
            },
            &mut ws.as_view_mut(),
            (&mut twostep.as_view_mut(), h),
        )
        .unwrap();
        let (fused, twostep, act) = (
            g.download(&fused).unwrap(),
            g.download(&twostep).unwrap(),
            g.download(&act).unwrap(),
        );
        let same = fused.iter().zip(&twostep).all(|(a, b)| a.to_bits() == b.to_bits());
        println!("PARITY {case} down_silu == silu_mul + moe_w4a16_gemm bit for bit: {same}");
        assert!(same, "{case}: fused SwiGLU down differs from the two-step path");
        let af = widen(&act);
        let (db, ds) = (h * mi / 2, h * mi / 32);
        let mut want_d = Vec::with_capacity(p * h);
        for (q, &ex) in ids.iter().enumerate() {
            let ex = ex as usize;
            want_d.extend(matmul_i4g32(
                &af[q * mi..(q + 1) * mi],
                &pd[ex * db..(ex + 1) * db],
                &sd[ex * ds..(ex + 1) * ds],
                1,
                mi,
                h,
            ));
        }
        check_bf16(
            &format!("{case} down_silu [{} splits]", plan_d.splits),
            &fused,
            &want_d,
            W4A16_TOL,
        );
    }
}

/// Programmatic dependent launch: a chain of dependent dense GEMMs (each reads the one before) gives the same
/// bits with PDL on and off, eager and replayed from a graph, at decode and tree shapes (a GEMM that read
/// its x before the previous one finished, or a split-K counter left dirty, would differ).
#[test]
fn w4a16_chain_same_with_and_without_pdl() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(g) = gpu() else { return };
    let (h, layers) = (2048usize, 6usize);
    let was = g.pdl();
    let mut r = rng(1600);
    let weights: Vec<_> = (0..layers)
        .map(|_| int4_weights(&mut r, 1, h, h))
        .map(|(p, s)| (g.upload(&p).unwrap(), g.upload(&s).unwrap()))
        .collect();
    for m in [1usize, 5, 16, 40] {
        let x = rand_bf16(&mut r, m * h, 0.01, 1.0);
        let plan = ops::w4a16_gemm::plan_dense(&g, m, h, h);
        let run = |pdl: bool, graph: bool| -> Vec<bf16> {
            g.set_pdl(pdl);
            let mut bufs: Vec<_> = (0..=layers).map(|_| g.upload(&nan_bf16(m * h)).unwrap()).collect();
            bufs[0] = g.upload(&x).unwrap();
            let mut ws = g.upload(&nan_f32(plan.workspace_len(m, h))).unwrap();
            let mut chain = |bufs: &mut Vec<cudarc::driver::CudaSlice<bf16>>| {
                for (l, (p, s)) in weights.iter().enumerate() {
                    let (a, b) = bufs.split_at_mut(l + 1);
                    ops::w4a16_gemm::w4a16_gemm(
                        &g,
                        &a[l].as_view(),
                        h,
                        m,
                        &p.as_view(),
                        &s.as_view(),
                        h,
                        h,
                        &mut ws.as_view_mut(),
                        &mut b[0].as_view_mut(),
                        h,
                    )
                    .unwrap();
                }
            };
            if graph {
                g.stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .unwrap();
                chain(&mut bufs);
                let gr = g
                    .stream
                    .end_capture(CUgraphInstantiate_flags(0))
                    .unwrap()
                    .expect("a graph");
                for _ in 0..3 {
                    gr.launch().unwrap();
                }
            } else {
                for _ in 0..3 {
                    chain(&mut bufs);
                }
            }
            g.download(&bufs[layers]).unwrap()
        };
        let base = run(false, false);
        assert!(
            base.iter().all(|v| v.to_f32().is_finite()),
            "m={m}: chain output not finite"
        );
        for (pdl, graph) in [(true, false), (true, true), (false, true)] {
            let got = run(pdl, graph);
            let same = got.iter().zip(&base).all(|(a, b)| a.to_bits() == b.to_bits());
            println!(
                "PARITY w4a16 chain of {layers} (M={m}, {h}x{h}, {} splits) pdl={pdl} graph={graph} == pdl off \
                 eager: {same}",
                plan.splits
            );
            assert!(same, "m={m} pdl={pdl} graph={graph}: the chain differs");
        }
    }
    g.set_pdl(was);
}

/// One grouped launch as the engine makes it: `ids` (token-major (token, slot) pairs, `top_k` a token), x rows
/// (one a token, or one a pair with `per_pair`), weight matrices on the device; the plan `plan_moe` picks for
/// these pairs (returned with the output, which is NaN-poisoned first).
#[allow(clippy::too_many_arguments)]
fn moe_run(
    g: &Gpu,
    ids: &[i32],
    top_k: usize,
    x: &[bf16],
    per_pair: bool,
    e: usize,
    (n, k): (usize, usize),
    dm: &DevMats,
) -> (Vec<bf16>, ops::w4a16_gemm::Plan) {
    let p = ids.len();
    let width = dm.len() * n;
    let plan = ops::w4a16_gemm::plan_moe(g, p, e, width, k);
    let tile = plan.tile_rows();
    let mt = ops::moe_align::max_tiles(p, e, tile);
    let di = g.upload(ids).unwrap();
    let (mut sorted, mut tiles, mut nt) = (
        g.upload(&vec![-1i32; p]).unwrap(),
        g.upload(&vec![-1i32; 3 * mt]).unwrap(),
        g.upload(&[-1i32]).unwrap(),
    );
    ops::moe_align::moe_align(
        g,
        &di.as_view(),
        e,
        tile,
        &mut sorted.as_view_mut(),
        &mut tiles.as_view_mut(),
        &mut nt.as_view_mut(),
    )
    .unwrap();
    let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), nt.as_view());
    let routing = ops::w4a16_gemm::Routing {
        sorted: &sv,
        tiles: &tv,
        max_tiles: mt,
        n_tiles: &nv,
        tile_rows: tile,
    };
    let dx = g.upload(x).unwrap();
    let views: Vec<_> = dm.iter().map(|(pk, sc)| (pk.as_view(), sc.as_view())).collect();
    let refs: Vec<_> = views.iter().map(|(pk, sc)| (pk, sc)).collect();
    let mut ws = g.upload(&nan_f32(plan.workspace_len(p, width).max(1))).unwrap();
    let mut out = g.upload(&nan_bf16(p * width)).unwrap();
    ops::w4a16_gemm::moe_w4a16(
        g,
        ops::w4a16_gemm::MoeX::Rows {
            x: &dx.as_view(),
            ld: k,
            row_div: if per_pair { 1 } else { top_k },
        },
        &routing,
        &refs,
        ops::w4a16_gemm::MoeDims {
            pairs: p,
            n_experts: e,
            n,
            k,
        },
        &mut ws.as_view_mut(),
        (&mut out.as_view_mut(), width),
    )
    .unwrap();
    (g.download(&out).unwrap(), plan)
}

/// Weight matrices (packed, scales) on the host and on the device.
type HostMats = Vec<(Vec<u8>, Vec<bf16>)>;
type DevMats = [(cudarc::driver::CudaSlice<u8>, cudarc::driver::CudaSlice<bf16>)];
/// (T, top_k, E, experts used, N, K, matrices, x per pair).
type LargeCase = (usize, usize, usize, usize, usize, usize, usize, bool);

/// A large-form case -> ids, x, host and device weights, the experts used.
fn large_case(
    g: &Gpu,
    seed: u64,
    (t, top_k, e, used, n, k, nmat, per_pair): LargeCase,
) -> (Vec<i32>, Vec<bf16>, HostMats, Box<DevMats>, Vec<i32>) {
    let mut r = rng(seed);
    let mut pool: Vec<i32> = (0..e as i32).collect();
    pool.shuffle(&mut r);
    pool.truncate(used);
    let ids: Vec<i32> = (0..t)
        .flat_map(|_| pool.choose_multiple(&mut r, top_k).copied().collect::<Vec<_>>())
        .collect();
    let xrows = if per_pair { t * top_k } else { t };
    let x = rand_bf16(&mut r, xrows * k, 0.01, 1.0);
    let mats: HostMats = (0..nmat).map(|_| int4_weights(&mut r, e, n, k)).collect();
    let dm = mats
        .iter()
        .map(|(pk, sc)| (g.upload(pk).unwrap(), g.upload(sc).unwrap()))
        .collect();
    (ids, x, mats, dm, pool)
}

/// The large-M form's cases: K2.6's TP8 gate and gate|up (384 experts, 256 x 7168), its down (7168 x 256, x per
/// pair), an odd small case (N = 96, not a multiple of the 128-row block; 5 of 8 experts used, so tiles end part
/// full), and the trained pair's shapes (32 experts, top-4, 256 x 256 gate|up and down).
const LARGE_CASES: [LargeCase; 6] = [
    (3072, 8, 384, 384, 256, 7168, 1, false),
    (3072, 8, 384, 384, 256, 7168, 2, false),
    (1100, 8, 96, 96, 7168, 256, 1, true),
    (700, 2, 8, 5, 96, 384, 1, false),
    (600, 4, 32, 32, 256, 256, 2, false),
    (600, 4, 32, 32, 256, 256, 1, true),
];

/// The large-M grouped form (prefill: `plan_moe` takes it from `LARGE_MIN_ROWS` rows per expert on) against the
/// CPU twin. Every output row must be written (NaN-poisoned before); the twin is checked on every pair of the
/// first expert and the last, plus 384 random pairs.
#[test]
fn moe_w4a16_large_parity() {
    let Some(g) = gpu() else { return };
    for (ci, &c) in LARGE_CASES.iter().enumerate() {
        let (t, top_k, e, used, n, k, nmat, per_pair) = c;
        let case = format!(
            "moe_w4a16_large(T={t},top_k={top_k},E={e},used={used},N={n},K={k},mats={nmat},x_per_pair={per_pair})"
        );
        let (ids, x, mats, dm, pool) = large_case(&g, 1600 + ci as u64, c);
        let p = t * top_k;
        let width = nmat * n;
        let t0 = std::time::Instant::now();
        let (got, plan) = moe_run(&g, &ids, top_k, &x, per_pair, e, (n, k), &dm);
        let first_ms = t0.elapsed().as_secs_f64() * 1e3;
        assert!(
            plan.large,
            "{case}: {} rows an expert should take the large form",
            p / used
        );
        let unwritten = got.iter().filter(|v| v.is_nan()).count();
        assert_eq!(unwritten, 0, "{case}: {unwritten} outputs never written");
        let (lo_e, hi_e) = (*pool.iter().min().unwrap(), *pool.iter().max().unwrap());
        let mut check: Vec<usize> = (0..p).filter(|&q| ids[q] == lo_e || ids[q] == hi_e).collect();
        let mut r = rng(1700 + ci as u64);
        check.extend((0..384).map(|_| (r.next_u32() as usize) % p));
        let xf = widen(&x);
        let (eb, es) = (n * k / 2, n * k / 32);
        let (mut want, mut got_c) = (Vec::new(), Vec::new());
        for &q in &check {
            let xr = if per_pair { q } else { q / top_k };
            let ex = ids[q] as usize;
            for (m, (pk, sc)) in mats.iter().enumerate() {
                want.extend(matmul_i4g32(
                    &xf[xr * k..(xr + 1) * k],
                    &pk[ex * eb..(ex + 1) * eb],
                    &sc[ex * es..(ex + 1) * es],
                    1,
                    k,
                    n,
                ));
                got_c.extend_from_slice(&got[q * width + m * n..q * width + (m + 1) * n]);
            }
        }
        check_bf16(
            &format!(
                "{case} [tile {}, {} pairs checked, first call {first_ms:.1} ms]",
                plan.tile_rows(),
                check.len()
            ),
            &got_c,
            &want,
            W4A16_TOL,
        );
    }
}

/// Batch invariance across the two grouped forms: every pair's output from the large form (all T tokens in one
/// launch) equals, bit for bit, what the small form gives it when the same tokens come a few at a time (chunks
/// of at most E pairs: one row an expert, so the small form, at one split), in every large-form case. So a
/// sequence's rows do not change when a batch tips the engine's MoE into the large form.
#[test]
fn moe_w4a16_large_equals_small_one_split() {
    let Some(g) = gpu() else { return };
    // At K = 7168 the small form always splits K (its x slice must fit the shared memory), so K2.6's gate|up
    // rows differ between the forms in their last bits; the down projection (K = 256 on a TP8 rank) and the
    // trained pair do not split.
    for (ci, &c) in LARGE_CASES.iter().enumerate().filter(|(_, c)| c.5 <= 512) {
        let (t, top_k, e, _used, n, k, nmat, per_pair) = c;
        let case = format!("large == small (T={t},top_k={top_k},E={e},N={n},K={k},mats={nmat},x_per_pair={per_pair})");
        let (ids, x, _mats, dm, _pool) = large_case(&g, 1800 + ci as u64, c);
        let (big, plan) = moe_run(&g, &ids, top_k, &x, per_pair, e, (n, k), &dm);
        assert!(plan.large, "{case}: not the large form");
        // Tokens a chunk: at most E pairs, and at K = 7168 at least 64 rows (the small form's one-split plan).
        let chunk = (e / top_k).clamp(1, 16);
        let (mut small, mut splits) = (Vec::with_capacity(big.len()), std::collections::BTreeSet::new());
        for t0 in (0..t).step_by(chunk) {
            let t1 = (t0 + chunk).min(t);
            let xs = if per_pair {
                &x[t0 * top_k * k..t1 * top_k * k]
            } else {
                &x[t0 * k..t1 * k]
            };
            let (o, pl) = moe_run(&g, &ids[t0 * top_k..t1 * top_k], top_k, xs, per_pair, e, (n, k), &dm);
            assert!(!pl.large, "{case}: chunk at token {t0} took the large form");
            splits.insert(pl.splits);
            small.extend(o);
        }
        assert_eq!(
            splits.iter().copied().collect::<Vec<_>>(),
            vec![1],
            "{case}: the small form's splits"
        );
        let differ = big
            .iter()
            .zip(&small)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let nan = big.iter().filter(|v| v.is_nan()).count();
        println!(
            "PARITY {case}: {} outputs, {differ} differ in bits from the small form at one split \
             (chunks of {chunk} tokens); {nan} NaN",
            big.len()
        );
        assert_eq!(nan, 0, "{case}: unwritten outputs");
        assert_eq!(differ, 0, "{case}: the large form is not the small form's bits");
    }
}
