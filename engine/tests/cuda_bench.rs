//! Timings of the W4A16 GEMM on the K2.6 expert shapes (and the cuBLAS bf16 GEMM on the same shapes, and a
//! device copy, measured in the same run as the bandwidth ceiling), and of the per-row sampler. `#[ignore]`:
//! run explicitly with `--ignored --nocapture --test-threads=1` (scripts/gpu-test.sh does). Weights are random and
//! rotated over more than 200 MB so every call streams from HBM, not the 60 MB L2; CUDA events around many calls
//! after a warm-up; GB/s counts the weight bytes (packed + scales, or bf16) once per call. W4A16 is timed eagerly
//! and replayed from a CUDA graph (which also proves the launches capturable: no host sync, no allocation);
//! the bf16 GEMM replayed from a graph too (cuBLAS, and the small-M tensor-core GEMM). Each W4A16 figure also
//! prints one machine-readable `BENCH w4a16 n=.. k=.. m=..` line (bench/table.py reads it; bench/gpu-bench.sh runs it).
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use cuda_common::timing::{copy_gbps, time_graph_ms, time_ms};
use cuda_common::*;
use half::bf16;
use kdtree_engine::cuda::ops;
use kdtree_engine::cuda::Gpu;
use rand::RngCore;

const ROTATE_BYTES: usize = 256 << 20;

/// Median ms per call of `f(i)`, i < iters, captured once into a CUDA graph and replayed `replays` times
/// (each replay between its own CUDA events) after one warm-up replay: per-call time with no launch gaps.
fn time_graph_median_ms(g: &Gpu, iters: usize, replays: usize, mut f: impl FnMut(usize)) -> f64 {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    g.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    for i in 0..iters {
        f(i);
    }
    let graph = g
        .stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    graph.upload().unwrap();
    graph.launch().unwrap();
    let mut v: Vec<f64> = (0..replays)
        .map(|_| time_ms(g, 0, 1, |_| graph.launch().unwrap()) / iters as f64)
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "timing; run by scripts/gpu-test.sh"]
fn w4a16_bandwidth() {
    let Some(g) = gpu() else { return };
    let copy = copy_gbps(&g);
    println!(
        "\nBENCH device {} copy {:.0} GB/s (read+write, 1 GiB memcpy_dtod)",
        g.describe(),
        copy
    );
    let mut r = rng(2000);
    for &(n, k) in &[(4096usize, 7168usize), (7168, 2048), (512, 7168), (7168, 256)] {
        let bytes = n * k / 2 + n * k / 32 * 2;
        let copies = ROTATE_BYTES.div_ceil(bytes).max(2);
        let mut packed = vec![0u8; copies * n * k / 2];
        r.fill_bytes(&mut packed);
        let scales = rand_bf16(&mut r, copies * n * k / 32, 1.0 / 512.0, 1.0 / 64.0);
        let dp = g.upload(&packed).unwrap();
        let ds = g.upload(&scales).unwrap();
        let wb = bf16_weights(&g, &mut r, n, k);
        for &m in &[1usize, 2, 4, 8, 16, 32, 64] {
            let x = rand_bf16(&mut r, m * k, 0.01, 1.0);
            let dx = g.upload(&x).unwrap();
            let plan = ops::w4a16_gemm::plan_dense(&g, m, n, k);
            let cap0 = g.w4a16_max_splits();
            g.set_w4a16_max_splits(64);
            let widest = ops::w4a16_gemm::plan_dense(&g, m, n, k);
            g.set_w4a16_max_splits(cap0);
            let mut ws = g
                .zeros::<f32>(plan.workspace_len(m, n).max(widest.workspace_len(m, n)))
                .unwrap();
            let mut out = g.zeros::<bf16>(m * n).unwrap();
            let (eb, es) = (n * k / 2, n * k / 32);
            let mut call = |i: usize| {
                let c = i % copies;
                ops::w4a16_gemm::w4a16_gemm(
                    &g,
                    &dx.as_view(),
                    k,
                    m,
                    &dp.slice(c * eb..(c + 1) * eb),
                    &ds.slice(c * es..(c + 1) * es),
                    n,
                    k,
                    &mut ws.as_view_mut(),
                    &mut out.as_view_mut(),
                    n,
                )
                .unwrap();
            };
            let eager = time_ms(&g, copies, 4 * copies.max(10), &mut call);
            let ms = time_graph_median_ms(&g, 4 * copies.max(10), 9, &mut call);
            let gbps = bytes as f64 / (ms * 1e-3) / 1e9;
            println!(
                "BENCH w4a16_gemm N={n} K={k} M={m} splits={} graph {:.2} us {:.0} GB/s {:.0}% of copy (eager \
                 {:.2} us)",
                plan.splits,
                ms * 1e3,
                gbps,
                100.0 * gbps / copy,
                eager * 1e3
            );
            // The same figure for bench/table.py: w_bytes = packed + bf16 scales as stored, xy_bytes = bf16
            // x [M, K] read + bf16 y [M, N] written (the split-K workspace is not counted); gbps over both.
            let xy = 2 * (m * k + m * n);
            println!(
                "BENCH w4a16 n={n} k={k} m={m} splits={} graph_us={:.3} eager_us={:.3} w_bytes={bytes} \
                 xy_bytes={xy} gbps={:.1} copy_gbps={:.1}",
                plan.splits,
                ms * 1e3,
                eager * 1e3,
                (bytes + xy) as f64 / (ms * 1e-3) / 1e9,
                copy
            );
            // The plan's knobs, the same calls: blocks per SM the split count aims at, the split cap, and PDL
            // on or off (the workspace above holds the largest plan: 4 blocks per SM, up to 64 splits).
            let (bps0, cap0, pdl0) = (g.w4a16_blocks_per_sm(), g.w4a16_max_splits(), g.pdl());
            for (bps, cap, pdl) in [(4usize, 16usize, true), (4, 8, true), (2, 64, true), (4, 64, false)] {
                g.set_w4a16_blocks_per_sm(bps);
                g.set_w4a16_max_splits(cap);
                g.set_pdl(pdl && pdl0);
                let p = ops::w4a16_gemm::plan_dense(&g, m, n, k);
                let ms = time_graph_median_ms(&g, 4 * copies.max(10), 5, &mut call);
                println!(
                    "BENCH w4a16_cfg n={n} k={k} m={m} blocks_per_sm={bps} max_splits={cap} pdl={} splits={} \
                     graph_us={:.3} gbps={:.1}",
                    pdl && pdl0,
                    p.splits,
                    ms * 1e3,
                    bytes as f64 / (ms * 1e-3) / 1e9
                );
            }
            g.set_w4a16_blocks_per_sm(bps0);
            g.set_w4a16_max_splits(cap0);
            g.set_pdl(pdl0);
            // The bf16 GEMM on the same shape (4x the weight bytes), rotated the same way: cuBLAS and the small-M
            // tensor-core GEMM that gemm_bf16 takes up to `small_gemm_rows` rows (graph replays, launch-free).
            let mut y = g.zeros::<bf16>(m * n).unwrap();
            let small0 = g.small_gemm_rows();
            for small in [false, true] {
                g.set_small_gemm_rows(if small { usize::MAX } else { 0 });
                let ms = time_bf16_gemm_ms(&g, &dx, &wb, &mut y, m, k, n, 4);
                let gbps = (2 * n * k) as f64 / (ms * 1e-3) / 1e9;
                let what = if small { "small" } else { "cublas" };
                println!(
                    "BENCH gemm_bf16 N={n} K={k} M={m} {what} graph {:.2} us {:.0} GB/s {:.0}% of copy",
                    ms * 1e3,
                    gbps,
                    100.0 * gbps / copy
                );
            }
            g.set_small_gemm_rows(small0);
        }
    }
    // Grouped MoE decode: 1 token x top-8 of 32 distinct experts of the fused gate+up 4096x7168 (rotated over
    // 4 id sets so each call reads 8 experts no other call of the last 3 read), align + GEMM + reduce.
    let (e, n, k, top_k) = (32usize, 4096usize, 7168usize, 8usize);
    let mut packed = vec![0u8; e * n * k / 2];
    r.fill_bytes(&mut packed);
    let scales = rand_bf16(&mut r, e * n * k / 32, 1.0 / 512.0, 1.0 / 64.0);
    let (dp, ds) = (g.upload(&packed).unwrap(), g.upload(&scales).unwrap());
    drop((packed, scales));
    for &t in &[1usize, 8] {
        let p = t * top_k;
        let sets: Vec<_> = (0..4)
            .map(|s| {
                let ids: Vec<i32> = (0..p)
                    .map(|q| ((s * 8 + q % 8) as i32 + (q / 8) as i32) % e as i32)
                    .collect();
                g.upload(&ids).unwrap()
            })
            .collect();
        let plan = ops::w4a16_gemm::plan_moe(&g, p, e, n, k);
        let mt = ops::moe_align::max_tiles(p, e, plan.tile_rows());
        let x = g.upload(&rand_bf16(&mut r, t * k, 0.01, 1.0)).unwrap();
        let mut sorted = g.zeros::<i32>(p).unwrap();
        let mut tiles = g.zeros::<i32>(3 * mt).unwrap();
        let mut nt = g.zeros::<i32>(1).unwrap();
        let mut ws = g.zeros::<f32>(plan.workspace_len(p, n)).unwrap();
        let mut out = g.zeros::<bf16>(p * n).unwrap();
        let ms = time_graph_ms(&g, 64, |i| {
            ops::moe_align::moe_align(
                &g,
                &sets[i % 4].as_view(),
                e,
                plan.tile_rows(),
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
                tile_rows: plan.tile_rows(),
            };
            ops::w4a16_gemm::moe_w4a16(
                &g,
                ops::w4a16_gemm::MoeX::Rows {
                    x: &x.as_view(),
                    ld: k,
                    row_div: top_k,
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
        });
        let experts_read = if t == 1 { 8 } else { 8.min(e) + 7 };
        let bytes = experts_read * (n * k / 2 + n * k / 16);
        let gbps = bytes as f64 / (ms * 1e-3) / 1e9;
        println!(
            "BENCH moe_w4a16_gemm T={t} top_k=8 experts_read={experts_read} N={n} K={k} splits={} \
             graph(align+gemm+reduce) {:.2} us {:.0} GB/s {:.0}% of copy",
            plan.splits,
            ms * 1e3,
            gbps,
            100.0 * gbps / copy
        );
    }
}

/// The per-row token decision (kernels/cuda/sample_rows.cu) on K2.6's vocabulary for a tree's worth of
/// rows (65 = budget 64 + root, 257), depth-keyed positions, replayed from a graph; GB/s counts the logits
/// read once (the kernel makes several passes over each row: see its header).
#[test]
#[ignore = "timing; run by scripts/gpu-test.sh"]
fn sample_rows_time() {
    use kdtree_engine::sampling::Sampling;
    let Some(g) = gpu() else { return };
    let v = 163_840usize;
    let mut r = rng(2100);
    for &rows in &[65usize, 257] {
        let dx = g.upload(&rand_f32(&mut r, rows * v, -8.0, 8.0)).unwrap();
        let dd = g
            .upload(&(0..rows as u32).map(|i| i % 8).collect::<Vec<u32>>())
            .unwrap();
        let mut out = g.zeros::<u32>(rows).unwrap();
        let settings = [
            (
                "T=1,top_p=0.9",
                Sampling {
                    temperature: 1.0,
                    top_p: 0.9,
                    top_k: 0,
                    seed: 1,
                },
            ),
            (
                "T=1,top_k=50",
                Sampling {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: 50,
                    seed: 1,
                },
            ),
            ("greedy", Sampling::greedy()),
        ];
        for (name, s) in settings {
            let mut call = |_: usize| {
                ops::sample_rows::sample_rows(
                    &g,
                    &dx.as_view(),
                    rows,
                    v,
                    v,
                    &s,
                    1000,
                    None,
                    Some(&dd.as_view()),
                    &mut out.as_view_mut(),
                )
                .unwrap()
            };
            let eager = time_ms(&g, 3, 20, &mut call);
            let ms = time_graph_ms(&g, 20, &mut call);
            let gbps = (rows * v * 4) as f64 / (ms * 1e-3) / 1e9;
            println!(
                "BENCH sample_rows rows={rows} V={v} {name} graph {:.2} us {:.0} GB/s of logits (eager {:.2} us)",
                ms * 1e3,
                gbps,
                eager * 1e3
            );
        }
    }
}

/// The bf16 GEMMs of a K2.6 TP8 rank-0 decode step and its tree verifies, cuBLAS against the small-M tensor-core
/// GEMM (kernels/cuda/gemm_small_bf16.cu), M = 1 (AR), 17 (b16), 65 (b64), 129, 257 (b256) rows; weights rotated
/// past L2, graph replays. Floor: the weight bytes at the copy rate measured in the same run (read + write counts
/// each byte twice, so a read-only stream's ceiling is about the copy's GB/s).
#[test]
#[ignore = "timing; run by scripts/gpu-test.sh"]
fn gemm_bf16_step_shapes() {
    let Some(g) = gpu() else { return };
    let copy = copy_gbps(&g);
    let mut r = rng(2100);
    let (small0, cps0) = (g.small_gemm_rows(), g.small_ctas_per_sm());
    // (name, N, K): q_a|kv_a, q_b, o_proj, the router, shared gate|up, shared down, lm_head's vocab shard.
    for &(name, n, k) in &[
        ("q_a|kv_a", 2112usize, 7168usize),
        ("q_b", 1536, 1536),
        ("o_proj", 7168, 1024),
        ("router", 384, 7168),
        ("shared gate|up", 512, 7168),
        ("shared down", 7168, 256),
        ("lm_head/8", 20480, 7168),
    ] {
        let wb = bf16_weights(&g, &mut r, n, k);
        for &m in &[1usize, 17, 65, 129, 257] {
            let dx = g.upload(&rand_bf16(&mut r, m * k, 0.01, 1.0)).unwrap();
            let mut y = g.zeros::<bf16>(m * n).unwrap();
            let mut time = |rows: usize| {
                g.set_small_gemm_rows(rows);
                1e3 * time_bf16_gemm_ms(&g, &dx, &wb, &mut y, m, k, n, 2)
            };
            let cublas = time(0);
            let floor_us = (2 * n * k) as f64 / (copy * 1e9) * 1e6;
            // The small GEMM at split targets of 4, 2 and 1 CTAs an SM (fewer CTAs: fewer splits).
            for cps in [4, 2, 1] {
                g.set_small_ctas_per_sm(cps);
                let (splits, per) = ops::gemm_bf16::small_plan_on(&g, n, k);
                let us = time(usize::MAX);
                println!(
                    "BENCH gemm_step {name} N={n} K={k} M={m} ctas_per_sm={cps} splits={splits}x{per} \
                     cublas_us={cublas:.2} small_us={us:.2} floor_us={floor_us:.2} small/floor={:.2} \
                     small/cublas={:.2}",
                    us / floor_us,
                    us / cublas
                );
            }
            g.set_small_ctas_per_sm(cps0);
        }
    }
    g.set_small_gemm_rows(small0);
}

/// Median ms of `gemm_bf16` over `m` rows of `dx` with the weight copies of `wb` (`[copies, n, k]`, one copy a call
/// in turn), `passes` x the copies (at least 10) calls a graph replay.
#[allow(clippy::too_many_arguments)]
fn time_bf16_gemm_ms(
    g: &Gpu,
    dx: &cudarc::driver::CudaSlice<bf16>,
    wb: &cudarc::driver::CudaSlice<bf16>,
    y: &mut cudarc::driver::CudaSlice<bf16>,
    m: usize,
    k: usize,
    n: usize,
    passes: usize,
) -> f64 {
    let (wcopies, wsz) = (wb.len() / (n * k), n * k);
    time_graph_median_ms(g, passes * wcopies.max(10), 5, |i| {
        let c = i % wcopies;
        let w = wb.slice(c * wsz..(c + 1) * wsz);
        ops::gemm_bf16::gemm_bf16(g, &dx.as_view(), &w, &mut y.as_view_mut(), m, k, n).unwrap();
    })
}

/// bf16 weights `[copies, n, k]` rotated over >= ROTATE_BYTES.
fn bf16_weights(g: &Gpu, r: &mut rand_chacha::ChaCha8Rng, n: usize, k: usize) -> cudarc::driver::CudaSlice<bf16> {
    let copies = ROTATE_BYTES.div_ceil(2 * n * k).max(2);
    let w: Vec<bf16> = (0..copies * n * k)
        .map(|_| bf16::from_bits(0x3c00 | (r.next_u32() as u16 & 0x80ff)))
        .collect();
    g.upload(&w).unwrap()
}

/// The DDTree round's tree stages on the device (engine/src/cuda/tree.rs) at the real drafter's shape (7 draft
/// rows, vocab 163,840) for budgets 64, 256, 1024: top-K log-probs, tree build, ancestor mask, and the
/// greedy walk (argmax over the tree's verify rows + walk), each timed eagerly and the whole chain replayed
/// from one CUDA graph (proves it capturable: no host sync, no allocation, sizes read on the device).
/// Draft logits: two tied dominant tokens per row over random values (deep, branching trees).
#[test]
#[ignore = "timing; run by scripts/gpu-test.sh"]
fn ddtree_tree_stages() {
    use kdtree_engine::cuda::tree::DeviceTree;
    use rand::Rng;
    let Some(g) = gpu() else { return };
    let (rows, v) = (7usize, 163_840usize);
    let mut r = rng(31);
    // "exact ties": two dominant tokens of equal logit per row (every node has a tied score: the builder's
    // tie order decides each pop); "distinct": the second dominant token half a nat lower (no ties).
    for (data, second) in [("exact ties", 14.0f32), ("distinct", 13.5)] {
        let mut logits: Vec<f32> = (0..rows * v).map(|_| r.random_range(-4.0f32..4.0)).collect();
        for d in 0..rows {
            let a = r.random_range(0..v);
            logits[d * v + a] = 14.0;
            logits[d * v + (a + 1 + r.random_range(0..v - 1)) % v] = second;
        }
        let dl = g.upload(&logits).unwrap();
        for budget in [64usize, 256, 1024] {
            let mut dt = DeviceTree::new(&g, budget, rows, v).unwrap();
            dt.set_bonus(&g, 11).unwrap();
            let verify: Vec<f32> = (0..(budget + 1) * v).map(|_| r.random_range(-4.0f32..4.0)).collect();
            let dv = g.upload(&verify).unwrap();
            let (k, n) = (dt.k, budget + 1);
            let topk = time_ms(&g, 3, 20, |_| {
                let (mut lp, mut tok) = (dt.lp.as_view_mut(), dt.tok.as_view_mut());
                ops::topk_logprobs::topk_logprobs(&g, &dl.as_view(), rows, v, v, k, &mut lp, &mut tok, &mut dt.topk)
                    .unwrap()
            });
            let build = time_ms(&g, 3, 20, |_| dt.build_from_top_k(&g).unwrap());
            let mask = time_ms(&g, 3, 20, |_| {
                let (p, nn) = (dt.parents.as_view(), dt.n_nodes.as_view());
                ops::visibility::visibility(&g, &p, Some(&nn), n, dt.words, &mut dt.mask.bits.as_view_mut()).unwrap()
            });
            let walk = time_ms(&g, 3, 20, |_| dt.walk_greedy(&g, &dv.as_view(), v).unwrap());
            let chain = time_graph_ms(&g, 10, |_| {
                dt.build(&g, &dl.as_view(), v).unwrap();
                dt.walk_greedy(&g, &dv.as_view(), v).unwrap();
            });
            let t = dt.to_host(&g).unwrap();
            let depth = t.depths.iter().max().copied().unwrap_or(0);
            println!(
                "BENCH ddtree_tree ({data}) budget={budget} rows={rows} V={v}: topk {:.1} us ({} blocks per row), \
                 build(+mask) {:.1} us, mask {:.1} us, walk(argmax {n} rows + walk) {:.1} us; \
                 graph(topk+build+mask+argmax+walk, 7 kernels) {:.1} us; tree depth {depth}",
                topk * 1e3,
                dt.topk.splits,
                build * 1e3,
                mask * 1e3,
                walk * 1e3,
                chain * 1e3
            );
        }
    }
}

/// The trained pair converted for one rank (in a temporary folder kept alive by the first field), its weights
/// on `g`, and the target layers the drafter taps.
#[allow(clippy::type_complexity)]
fn pair_on(
    g: &std::sync::Arc<Gpu>,
) -> (
    tempfile::TempDir,
    std::sync::Arc<dyn kdtree_engine::model::TensorSource>,
    kdtree_engine::cuda::CudaBackend,
    std::sync::Arc<kdtree_engine::model::Weights<kdtree_engine::cuda::CudaBackend>>,
    Vec<usize>,
) {
    use kdtree_engine::model::{TensorSource, Weights};
    let tmp = tempfile::tempdir().unwrap();
    round_common::convert(&round_common::pair_dir(), &tmp.path().join("pair1"), 1);
    let src: std::sync::Arc<dyn TensorSource> =
        std::sync::Arc::new(kdtree_formats::ModelDir::open(tmp.path().join("pair1")).unwrap());
    let b = kdtree_engine::cuda::CudaBackend::new(g.clone());
    let w = std::sync::Arc::new(Weights::load_on(b.clone(), src.clone()).unwrap());
    let taps = src.drafter_config().unwrap().dflash_config.target_layer_ids.clone();
    (tmp, src, b, w, taps)
}

/// The device round's stages on the trained pair (models/kdtree-tiny, one rank), each between CUDA events
/// over 20 rounds from the same state (median): draft (the drafter's block), top-K + tree + mask, the verify
/// forward over budget + 1 nodes, decisions + walk, the read back, and the commit (latent compaction and the
/// drafter's context; undone after timing so every round starts alike). Eager launches: each figure is the
/// stage's wall time on the GPU, gaps between launches included.
#[test]
#[ignore = "timing; run by scripts/gpu-test.sh"]
fn ddtree_round_stages() {
    use kdtree_engine::api::{Drafter, LogitRows, Target};
    use kdtree_engine::backend::TreeOps;
    use kdtree_engine::drafter::DFlashDrafter;
    use kdtree_engine::generate::Sampling;
    use kdtree_engine::model::{AttnMode, Model, TargetModel};
    use std::sync::Arc;
    let Some(g) = gpu() else { return };
    let g = Arc::new(g);
    let (_tmp, src, b, w, taps) = pair_on(&g);
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    for budget in [16usize, 64, 256] {
        let t = TargetModel::new(w.clone(), taps.clone(), AttnMode::Absorbed).unwrap();
        let d = DFlashDrafter::load_on(b.clone(), &*src, w.clone()).unwrap();
        let mut m = Model::new(t, Some(d));
        // A prompt and three device rounds (Model::round, what a session runs); then the stages by hand.
        let root = {
            let p = [1u32, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11];
            let n = p.len();
            let out = m
                .target
                .forward_rows(&p, &(0..n as i32).map(|i| i - 1).collect::<Vec<_>>(), LogitRows::Last)
                .unwrap();
            m.target.commit(&(0..n).collect::<Vec<_>>()).unwrap();
            m.drafter.as_mut().unwrap().extend_context(&out.taps, n).unwrap();
            let mut last = kdtree_engine::sampling::argmax(&out.logits);
            for _ in 0..3 {
                let r = m.round(last, Some(budget), &Sampling::greedy()).unwrap().unwrap();
                last = *r.walk.decisions.last().unwrap();
            }
            last
        };
        let Model {
            target: ref mut t,
            drafter: Some(ref mut d),
        } = m
        else {
            unreachable!("the model has its drafter")
        };
        let rows = d.block_size() - 1;
        let mut tree = b
            .tree_new(budget, rows, t.info().vocab_size, budget.min(t.info().vocab_size))
            .unwrap();
        let names = [
            "draft",
            "top-K+tree+mask",
            "verify",
            "decide+walk",
            "commit",
            "read back",
        ];
        let mut ms: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        for _ in 0..20 {
            let start = t.committed();
            b.tree_set_root(&mut tree, root).unwrap();
            let mut e = vec![g.stream.record_event(flags).unwrap()];
            let draft = d.draft_from_root(b.tree_root(&tree)).unwrap();
            e.push(g.stream.record_event(flags).unwrap());
            b.tree_build(&mut tree, &draft, 0).unwrap();
            e.push(g.stream.record_event(flags).unwrap());
            let (xn, taps_act) = t.forward_tree(&tree, budget + 1, rows).unwrap();
            let logits = w.lm_head(&xn, budget + 1);
            e.push(g.stream.record_event(flags).unwrap());
            t.walk_tree(&mut tree, &logits, &Sampling::greedy()).unwrap();
            e.push(g.stream.record_event(flags).unwrap());
            t.commit_walk(&mut tree, d, &taps_act).unwrap();
            e.push(g.stream.record_event(flags).unwrap());
            t.read_walk(&mut tree, d, budget + 1).unwrap();
            e.push(g.stream.record_event(flags).unwrap());
            e.last().unwrap().synchronize().unwrap();
            for (k, m) in ms.iter_mut().enumerate() {
                m.push(e[k].elapsed_ms(&e[k + 1]).unwrap() as f64);
            }
            // Back to the round's start (same state every time; the root stays the same).
            t.truncate(start).unwrap();
            d.truncate_context(start).unwrap();
        }
        // The whole round through Model::round: eager, then captured (first call captures, the rest replay),
        // from the same state every time.
        let mut whole = |graphs: bool| {
            b.set_graphs(graphs);
            let mut v = Vec::new();
            for i in 0..21 {
                let start = m.target.committed();
                let e0 = g.stream.record_event(flags).unwrap();
                m.round(root, Some(budget), &Sampling::greedy()).unwrap().unwrap();
                let e1 = g.stream.record_event(flags).unwrap();
                e1.synchronize().unwrap();
                if i > 0 {
                    v.push(e0.elapsed_ms(&e1).unwrap() as f64);
                }
                m.target.truncate(start).unwrap();
                m.drafter.as_mut().unwrap().truncate_context(start).unwrap();
            }
            v
        };
        let (mut eager, mut captured) = (whole(false), whole(true));
        let census = g
            .last_graph()
            .map(|c| c.to_string())
            .unwrap_or_else(|| "no graph captured".into());
        b.set_graphs(true);
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let parts: Vec<String> = names
            .iter()
            .zip(ms.iter_mut())
            .map(|(n, v)| format!("{n} {:.1} us", med(v) * 1e3))
            .collect();
        let total: f64 = ms.iter_mut().map(med).sum();
        println!(
            "BENCH ddtree_round_stages kdtree-tiny pair budget={budget}: {}; sum {:.1} us",
            parts.join(", "),
            total * 1e3
        );
        println!(
            "BENCH ddtree_round kdtree-tiny pair budget={budget}: whole round eager {:.1} us, one CUDA graph {:.1} \
             us (median of 20, host read included); the graph: {census}",
            med(&mut eager) * 1e3,
            med(&mut captured) * 1e3
        );
    }
}

/// The captured AR step and DDTree rounds (budgets 16, 64) of the trained pair: replay time (median of 30,
/// host read included) next to what the graph holds, for the kernels-per-step figures of issue 10. With
/// `KDTREE_PROFILE=ar|dd16|dd64` one replay of that graph runs between cuProfilerStart/Stop, so that
/// `ncu --profile-from-start off --graph-profiling node` (bench/gpu-bench.sh) measures each of its kernels
/// alone: their sum over the replay time is the GPU's busy fraction (the rest is launch gaps and idle).
#[test]
#[ignore = "timing; run by scripts/gpu-test.sh"]
fn step_busy() {
    use kdtree_engine::drafter::DFlashDrafter;
    use kdtree_engine::generate::Sampling;
    use kdtree_engine::model::{AttnMode, Model, TargetModel};
    use kdtree_engine::{Mode, Session};
    use std::sync::Arc;
    let Some(g) = gpu() else { return };
    let g = Arc::new(g);
    let (_tmp, src, b, w, taps) = pair_on(&g);
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let profile = std::env::var("KDTREE_PROFILE").unwrap_or_default();
    for (tag, mode) in [
        ("ar", Mode::Ar),
        ("dd16", Mode::DDTree { budget: 16 }),
        ("dd64", Mode::DDTree { budget: 64 }),
    ] {
        if !profile.is_empty() && profile != tag {
            continue;
        }
        let t = TargetModel::new(w.clone(), taps.clone(), AttnMode::Absorbed).unwrap();
        let d = DFlashDrafter::load_on(b.clone(), &*src, w.clone()).unwrap();
        // The session over the model's views: its rounds and steps run as captured graphs.
        let (t, d) = Model::new(t, Some(d)).into_sessions();
        let mut s = Session::new(t, d, mode).unwrap();
        s.reserve(4096).unwrap();
        s.prefill(&[1, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11], &Sampling::greedy())
            .unwrap();
        for _ in 0..3 {
            s.step().unwrap(); // the first one captures
        }
        let census = g
            .last_graph()
            .map(|c| c.to_string())
            .unwrap_or_else(|| "no graph".into());
        if !profile.is_empty() {
            g.profiled(|| s.step().unwrap()).unwrap();
            println!("BENCH step_busy {tag}: one replay profiled; the graph: {census}");
            continue;
        }
        let (mut us, mut tokens) = (Vec::new(), 0usize);
        for _ in 0..30 {
            let e0 = g.stream.record_event(flags).unwrap();
            tokens += s.step().unwrap().tokens.len();
            let e1 = g.stream.record_event(flags).unwrap();
            e1.synchronize().unwrap();
            us.push(e0.elapsed_ms(&e1).unwrap() as f64 * 1e3);
        }
        us.sort_by(f64::total_cmp);
        println!(
            "BENCH step_busy {tag}: replay {:.1} us (median of 30, host read included), {:.2} tokens a step; the \
             graph: {census}",
            us[us.len() / 2],
            tokens as f64 / 30.0
        );
    }
}
