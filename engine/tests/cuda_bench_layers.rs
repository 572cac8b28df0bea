//! Per-layer timings of K2.6 at full size on one GPU, each configuration captured into one CUDA graph and
//! replayed (median replay), against its byte floor at the copy bandwidth measured in the same run.
//! `moe_layer`: one layer's routed MoE as engine/src/cuda/backend.rs runs it (router GEMM + noaux_tc
//! selection, align, grouped INT4 gate, up and down GEMMs, SwiGLU, combine, then the bf16 shared expert), in
//! three per-rank plans (1 rank, the TP8 and the EP8 rank-0 slices) under uniform and correlated routing;
//! with gate and up as two weight tensors in one launch (`gate_up=split`, the engine's layout and path) and
//! as one `[2I, H]` tensor per expert (`gate_up=fused`); both write `[gate | up]` rows that the down GEMM reads
//! through its fused SwiGLU.
//! `mla_verify`: the latent tree-verify attention (split + merge kernels) at 4K-32K context, 64 and 8 heads.
//! `#[ignore]`: run with `--ignored --nocapture --test-threads=1` (bench/gpu-bench.sh runs every cuda_bench*
//! binary so). Each case prints a human line and a `BENCH <name> key=value ...` line.
#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::fill::{fill, Pools};
use cuda_common::timing::{capture, copy_gbps, graph_nodes, matmul_tflops, replay_median_ms, time_ms};
use cuda_common::*;
use cudarc::driver::CudaSlice;
use half::bf16;
use kdtree_engine::cuda::ops::mla_attention::{MlaShape, MlaSplit};
use kdtree_engine::cuda::ops::moe_router::RouterCfg;
use kdtree_engine::cuda::ops::{
    act_f32, gemm_bf16, mla_attention, mla_decode, moe_align, moe_combine, moe_router, w4a16_gemm,
};
use kdtree_engine::cuda::Gpu;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const H: usize = 7168;
const E: usize = 384;
const TOP_K: usize = 8;
const MI: usize = 2048;
/// Latent row: kv_lora 512 + rope 64.
const LAT: usize = 576;
const KV_LORA: usize = 512;
const LAYERS: usize = 61;
/// Route sets, and calls per captured MoE graph: call i uses route set i and weight copy i % copies.
const SETS: usize = 8;
/// Device memory the weight copies of one MoE plan may take.
const WEIGHT_BUDGET: usize = 30 << 30;
/// Correlated routing: a hot set of HOT experts per route set, each slot drawn from it with P_HOT.
const HOT: usize = 20;
const P_HOT: f64 = 0.8;
/// K2.6's router: 384 experts, one group, top-8, normalised, scaled by 2.827.
const ROUTER: RouterCfg = RouterCfg {
    n_experts: E,
    n_group: 1,
    topk_group: 1,
    top_k: TOP_K,
    norm_topk_prob: true,
    routed_scaling: 2.827,
};

/// Held by each GPU test for its whole run: the two would otherwise share the device (memory, and one
/// test's teardown can invalidate the other's graph capture) when run without `--test-threads=1`.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[derive(Clone, Copy, PartialEq)]
enum Plan {
    Full,
    Tp8,
    Ep8,
}

impl Plan {
    fn name(self) -> &'static str {
        match self {
            Plan::Full => "full",
            Plan::Tp8 => "tp8",
            Plan::Ep8 => "ep8",
        }
    }
    /// Rank 0's (experts held, expert intermediate, shared-expert intermediate). EP8 holds experts 0..48
    /// whole; the shared expert is TP-sliced in both TP8 and EP8 plans (engine model/weights.rs `mlp`).
    fn dims(self) -> (usize, usize, usize) {
        match self {
            Plan::Full => (E, MI, MI),
            Plan::Tp8 => (E, MI / 8, MI / 8),
            Plan::Ep8 => (E / 8, MI, MI / 8),
        }
    }
}

/// Bytes of one expert (gate + up + down, packed nibbles + bf16 group-32 scales) at intermediate `mi`.
fn expert_bytes(mi: usize) -> usize {
    3 * (mi * H / 2 + mi * H / 32 * 2)
}

struct I4 {
    packed: CudaSlice<u8>,
    scales: CudaSlice<bf16>,
}

/// Gate and up projections of the experts: two stacks `[held, I, H]` (the engine's), or one `[held, 2I, H]`
/// (per expert its gate rows, then its up rows).
enum GateUp {
    Split(I4, I4),
    Fused(I4),
}

/// One copy of a layer's MoE weights on rank 0: experts `[held, n, k]` per projection, router `[E, H]`
/// bf16 + bias `[E]` f32, shared expert gate, up `[si, H]` and down `[H, si]` bf16.
struct LayerW {
    gate_up: GateUp,
    down: I4,
    router: CudaSlice<bf16>,
    bias: CudaSlice<f32>,
    shared: [CudaSlice<bf16>; 3],
}

/// Router weights that make the selection follow `x`'s first E entries: W[e, e] = 1, every other entry
/// ±[1e-4, 1e-3) (so logit_e = x[e] ± ~0.01: +1 for the chosen experts, -1 for the rest, a 2.0 gap).
fn router_host(r: &mut ChaCha8Rng) -> Vec<bf16> {
    let mut w = rand_bf16(r, E * H, 1e-4, 1e-3);
    for e in 0..E {
        w[e * H + e] = bf16::ONE;
    }
    w
}

fn layer_weights(g: &Gpu, p: &Pools, plan: Plan, fused: bool, router: &[bf16], bias: &[f32]) -> LayerW {
    let (held, mi, si) = plan.dims();
    let i4 = |n: usize, k: usize| I4 {
        packed: fill(g, &p.bytes, held * n * k / 2),
        scales: fill(g, &p.scales, held * n * k / 32),
    };
    LayerW {
        gate_up: if fused {
            GateUp::Fused(i4(2 * mi, H))
        } else {
            GateUp::Split(i4(mi, H), i4(mi, H))
        },
        down: i4(H, mi),
        router: g.upload(router).unwrap(),
        bias: g.upload(bias).unwrap(),
        shared: [
            fill(g, &p.weights, si * H),
            fill(g, &p.weights, si * H),
            fill(g, &p.weights, H * si),
        ],
    }
}

/// SETS route sets of `t` tokens x TOP_K distinct expert ids (global), seeded by (t, correlated) so every
/// plan sees the same routes. Uniform: 8 distinct experts uniform over 384 per token. Correlated: per set a
/// hot set of HOT experts (uniform over 384); each slot is drawn from it with probability P_HOT, else
/// uniform over 384, redrawn until distinct within the token.
fn route_sets(t: usize, correlated: bool) -> Vec<Vec<usize>> {
    let mut r = ChaCha8Rng::seed_from_u64(3000 + 2 * t as u64 + correlated as u64);
    (0..SETS)
        .map(|_| {
            let mut hot: Vec<usize> = Vec::new();
            while hot.len() < HOT {
                let e = r.random_range(0..E);
                if !hot.contains(&e) {
                    hot.push(e);
                }
            }
            let mut ids = Vec::with_capacity(t * TOP_K);
            for _ in 0..t {
                let mut tok: Vec<usize> = Vec::new();
                while tok.len() < TOP_K {
                    let e = if correlated && r.random_bool(P_HOT) {
                        hot[r.random_range(0..HOT)]
                    } else {
                        r.random_range(0..E)
                    };
                    if !tok.contains(&e) {
                        tok.push(e);
                    }
                }
                ids.extend(tok);
            }
            ids
        })
        .collect()
}

/// The tokens' normed hidden states `[t, H]` f32 that route as `ids` through [`router_host`]'s weights:
/// entry e < E is +1 for the token's experts and -1 otherwise; the rest ±[0.01, 0.1).
fn x_for(r: &mut ChaCha8Rng, ids: &[usize], t: usize) -> Vec<f32> {
    let mut x = vec![0f32; t * H];
    for tok in 0..t {
        let row = &mut x[tok * H..(tok + 1) * H];
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j < E {
                -1.0
            } else {
                r.random_range(0.01f32..0.1) * if r.random::<bool>() { 1.0 } else { -1.0 }
            };
        }
        for &e in &ids[tok * TOP_K..(tok + 1) * TOP_K] {
            row[e] = 1.0;
        }
    }
    x
}

/// What the MoE cases share: the router's host weights and bias (every copy holds the same), the copy
/// bandwidth, and the failures seen so far (checked after every case has printed its timing).
struct MoeRun {
    router: Vec<bf16>,
    bias: Vec<f32>,
    copy: f64,
    failures: Vec<String>,
}

/// Host reference of the layer output `[H]` for one token (normed state `x`) on weight copy `lw`: the
/// router's CPU twin, the held experts through the INT4 CPU matmul with the GPU's bf16 roundings (x, gate
/// and up outputs, SwiGLU, down output), their weighted sum, then the bf16 shared expert.
fn reference(g: &Gpu, lw: &LayerW, plan: Plan, run: &MoeRun, x: &[f32]) -> Vec<f32> {
    use kdtree_engine::cpu::ops::{matmul_bf16, matmul_i4g32, moe_route};
    let (held, mi, si) = plan.dims();
    let rb = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|a| bf16::from_f32(a).to_f32()).collect() };
    let xb = rb(x.to_vec());
    let (ids, wts) = moe_route(&ROUTER, &matmul_bf16(&xb, &run.router, 1, H, E), Some(&run.bias));
    // Rows [r0, r1) of expert e of a stack of `rows`-row experts: (packed, scales) on the host.
    let rows_of = |m: &I4, rows: usize, e: usize, r0: usize, r1: usize| {
        let (a, b) = ((e * rows + r0) * H / 2, (e * rows + r1) * H / 2);
        (
            g.stream.clone_dtoh(&m.packed.slice(a..b)).unwrap(),
            g.stream.clone_dtoh(&m.scales.slice(a / 16..b / 16)).unwrap(),
        )
    };
    let mut out = vec![0f32; H];
    for (&e, &wt) in ids.iter().zip(&wts) {
        if e >= held {
            continue;
        }
        let ((gp, gs), (upk, ups)) = match &lw.gate_up {
            GateUp::Split(gate, up) => (rows_of(gate, mi, e, 0, mi), rows_of(up, mi, e, 0, mi)),
            GateUp::Fused(m) => (rows_of(m, 2 * mi, e, 0, mi), rows_of(m, 2 * mi, e, mi, 2 * mi)),
        };
        let gate = rb(matmul_i4g32(&xb, &gp, &gs, 1, H, mi));
        let up = rb(matmul_i4g32(&xb, &upk, &ups, 1, H, mi));
        let a = rb(kdtree_engine::cpu::ops::silu_mul(&gate, &up));
        let (da, db) = (e * H * mi / 2, (e + 1) * H * mi / 2);
        let (dp, ds) = (
            g.stream.clone_dtoh(&lw.down.packed.slice(da..db)).unwrap(),
            g.stream.clone_dtoh(&lw.down.scales.slice(da / 16..db / 16)).unwrap(),
        );
        let y = rb(matmul_i4g32(&a, &dp, &ds, 1, mi, H));
        for (o, v) in out.iter_mut().zip(&y) {
            *o += wt * v;
        }
    }
    let sh: Vec<Vec<bf16>> = lw.shared.iter().map(|m| g.download(m).unwrap()).collect();
    let (sg, su) = (matmul_bf16(&xb, &sh[0], 1, H, si), matmul_bf16(&xb, &sh[1], 1, H, si));
    let sa = rb(kdtree_engine::cpu::ops::silu_mul(&sg, &su));
    for (o, v) in out.iter_mut().zip(matmul_bf16(&sa, &sh[2], 1, si, H)) {
        *o += v;
    }
    out
}

/// One timed MoE configuration (plan, T, routing) over the plan's weight copies.
fn moe_case(g: &Gpu, w: &[LayerW], plan: Plan, t: usize, correlated: bool, run: &mut MoeRun) {
    let copy = run.copy;
    let (held, mi, si) = plan.dims();
    let fused = matches!(w[0].gate_up, GateUp::Fused(_));
    let p = t * TOP_K;
    let sets = route_sets(t, correlated);
    let mut r = ChaCha8Rng::seed_from_u64(4000 + t as u64);
    let xs_host: Vec<f32> = sets.iter().flat_map(|ids| x_for(&mut r, ids, t)).collect();
    let xs = g.upload(&xs_host).unwrap();
    let n_gu = 2 * mi;
    let plan_gu = w4a16_gemm::plan_moe(g, p, held, n_gu, H);
    let plan_d = w4a16_gemm::plan_moe(g, p, held, H, mi);
    let tile = plan_gu.tile_rows();
    let mt = moe_align::max_tiles(p, held, tile);
    let (mut xb, mut logits) = (g.zeros::<bf16>(t * H).unwrap(), g.zeros::<f32>(t * E).unwrap());
    let (mut ids, mut wts) = (g.zeros::<i32>(SETS * p).unwrap(), g.zeros::<f32>(SETS * p).unwrap());
    let (mut sorted, mut tiles, mut nt) = (
        g.zeros::<i32>(p).unwrap(),
        g.zeros::<i32>(3 * mt).unwrap(),
        g.zeros::<i32>(1).unwrap(),
    );
    let mut ws = g
        .zeros::<f32>(plan_gu.workspace_len(p, n_gu).max(plan_d.workspace_len(p, H)))
        .unwrap();
    // [P, 2I] in gb (gate | up per row), both layouts.
    let mut gb = g.zeros::<bf16>(p * n_gu).unwrap();
    let mut y = g.zeros::<bf16>(p * H).unwrap();
    let mut out = g.zeros::<f32>(SETS * t * H).unwrap();
    let (mut sg, mut su, mut sa) = (
        g.zeros::<f32>(t * si).unwrap(),
        g.zeros::<f32>(t * si).unwrap(),
        g.zeros::<f32>(t * si).unwrap(),
    );
    let (mut sab, mut so) = (g.zeros::<bf16>(t * si).unwrap(), g.zeros::<f32>(t * H).unwrap());
    // The layer, op for op as CudaBackend runs model::ffn::ffn for one rank (x converted to bf16 by each
    // linear, as the engine's gemm_f32 does), into preallocated buffers (the engine allocates them per call).
    let mut call = |i: usize| {
        let (s, lw) = (i % SETS, &w[i % w.len()]);
        let x = xs.slice(s * t * H..(s + 1) * t * H);
        let pr = s * p..(s + 1) * p;
        act_f32::f32_to_bf16(g, &x, &mut xb.as_view_mut()).unwrap();
        gemm_bf16::gemm_bf16(
            g,
            &xb.as_view(),
            &lw.router.as_view(),
            &mut logits.as_view_mut(),
            t,
            H,
            E,
        )
        .unwrap();
        moe_router::moe_router(
            g,
            &logits.as_view(),
            Some(&lw.bias.as_view()),
            t,
            ROUTER,
            &mut ids.slice_mut(pr.clone()),
            &mut wts.slice_mut(pr.clone()),
        )
        .unwrap();
        act_f32::f32_to_bf16(g, &x, &mut xb.as_view_mut()).unwrap();
        moe_align::moe_align_rank(
            g,
            &ids.slice(pr.clone()),
            0,
            held,
            tile,
            &mut sorted.as_view_mut(),
            &mut tiles.as_view_mut(),
            &mut nt.as_view_mut(),
        )
        .unwrap();
        {
            let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), nt.as_view());
            let routing = w4a16_gemm::Routing {
                sorted: &sv,
                tiles: &tv,
                max_tiles: mt,
                n_tiles: &nv,
                tile_rows: tile,
            };
            let xv = xb.as_view();
            // As the engine: gate and up in one launch into [gate | up] rows, the SwiGLU fused into the down
            // GEMM's x staging (split: two weight tensors; fused: one [2I, H] tensor per expert).
            match &lw.gate_up {
                GateUp::Split(gate, up) => {
                    let (gw, uw) = (
                        (&gate.packed.as_view(), &gate.scales.as_view()),
                        (&up.packed.as_view(), &up.scales.as_view()),
                    );
                    w4a16_gemm::moe_w4a16(
                        g,
                        w4a16_gemm::MoeX::Rows {
                            x: &xv,
                            ld: H,
                            row_div: TOP_K,
                        },
                        &routing,
                        &[gw, uw],
                        w4a16_gemm::MoeDims {
                            pairs: p,
                            n_experts: held,
                            n: mi,
                            k: H,
                        },
                        &mut ws.as_view_mut(),
                        (&mut gb.as_view_mut(), 2 * mi),
                    )
                    .unwrap();
                }
                GateUp::Fused(m) => {
                    w4a16_gemm::moe_w4a16(
                        g,
                        w4a16_gemm::MoeX::Rows {
                            x: &xv,
                            ld: H,
                            row_div: TOP_K,
                        },
                        &routing,
                        &[(&m.packed.as_view(), &m.scales.as_view())],
                        w4a16_gemm::MoeDims {
                            pairs: p,
                            n_experts: held,
                            n: 2 * mi,
                            k: H,
                        },
                        &mut ws.as_view_mut(),
                        (&mut gb.as_view_mut(), 2 * mi),
                    )
                    .unwrap();
                }
            }
            let d = &lw.down;
            w4a16_gemm::moe_w4a16(
                g,
                w4a16_gemm::MoeX::SiluGateUp {
                    gu: &gb.as_view(),
                    ld: 2 * mi,
                },
                &routing,
                &[(&d.packed.as_view(), &d.scales.as_view())],
                w4a16_gemm::MoeDims {
                    pairs: p,
                    n_experts: held,
                    n: H,
                    k: mi,
                },
                &mut ws.as_view_mut(),
                (&mut y.as_view_mut(), H),
            )
            .unwrap();
        }
        // As the engine: the rank's experts are 0 .. held (rank 0); pairs routed to other ranks' experts are
        // dropped by align and skipped by the combine (the router's ids, in its slot order).
        let mut os = out.slice_mut(s * t * H..(s + 1) * t * H);
        moe_combine::moe_combine_rank(
            g,
            &y.as_view(),
            H,
            &wts.slice(pr.clone()),
            &ids.slice(pr.clone()),
            (0, held),
            &mut os,
            t,
            TOP_K,
            H,
        )
        .unwrap();
        // The shared expert (bf16, this rank's slice) through three linears, then added.
        act_f32::f32_to_bf16(g, &x, &mut xb.as_view_mut()).unwrap();
        gemm_bf16::gemm_bf16(
            g,
            &xb.as_view(),
            &lw.shared[0].as_view(),
            &mut sg.as_view_mut(),
            t,
            H,
            si,
        )
        .unwrap();
        act_f32::f32_to_bf16(g, &x, &mut xb.as_view_mut()).unwrap();
        gemm_bf16::gemm_bf16(
            g,
            &xb.as_view(),
            &lw.shared[1].as_view(),
            &mut su.as_view_mut(),
            t,
            H,
            si,
        )
        .unwrap();
        act_f32::silu_mul_f32(g, &sg.as_view(), &su.as_view(), &mut sa.as_view_mut()).unwrap();
        act_f32::f32_to_bf16(g, &sa.as_view(), &mut sab.as_view_mut()).unwrap();
        gemm_bf16::gemm_bf16(
            g,
            &sab.as_view(),
            &lw.shared[2].as_view(),
            &mut so.as_view_mut(),
            t,
            si,
            H,
        )
        .unwrap();
        act_f32::add_f32(g, &mut os, &so.as_view()).unwrap();
    };
    for i in 0..SETS {
        call(i);
    }
    g.sync().unwrap();
    let before = g.stats.snapshot();
    call(0);
    let after = g.stats.snapshot();
    let (launches, blas) = (after[0] - before[0], after[1] - before[1]);
    let eager = time_ms(g, 0, SETS, &mut call);
    let graph = capture(g, SETS, &mut call);
    let (kernels, nodes) = graph_nodes(&graph);
    let (ms, reps) = replay_median_ms(g, &graph, 150.0, 5);
    let us = ms * 1e3 / SETS as f64;
    // Check the replayed layer (after the timing lines, so a failure loses no figure): every output written
    // and finite, every token routed to its forced experts, and at T = 8 (uniform) two tokens of the first
    // call against the host reference.
    g.stream.memcpy_htod(&nan_f32(SETS * t * H)[..], &mut out).unwrap();
    g.stream.memcpy_htod(&vec![-7i32; SETS * p][..], &mut ids).unwrap();
    graph.launch().unwrap();
    let (got_ids, got_out) = (g.download(&ids).unwrap(), g.download(&out).unwrap());
    let case = format!(
        "moe_layer plan={} gate_up={} routing={} T={t}",
        plan.name(),
        if fused { "fused" } else { "split" },
        if correlated { "correlated" } else { "uniform" }
    );
    let mut failures = Vec::new();
    if let Some(at) = got_out.iter().position(|v| !v.is_finite()) {
        failures.push(format!(
            "{case}: output {at} of {} not written or not finite ({})",
            got_out.len(),
            got_out[at]
        ));
    }
    for (s, want) in sets.iter().enumerate() {
        for tok in 0..t {
            let sl = s * p + tok * TOP_K..s * p + (tok + 1) * TOP_K;
            let mut a: Vec<i32> = got_ids[sl.clone()].to_vec();
            let mut b: Vec<i32> = want[tok * TOP_K..(tok + 1) * TOP_K].iter().map(|&e| e as i32).collect();
            a.sort_unstable();
            b.sort_unstable();
            if a != b {
                failures.push(format!(
                    "{case} set {s} token {tok}: the router chose {a:?}, forced {b:?}"
                ));
            }
        }
    }
    if failures.is_empty() && t == 8 && !correlated {
        for tok in [0, t - 1] {
            let want = reference(g, &w[0], plan, run, &xs_host[tok * H..(tok + 1) * H]);
            let e = error(&case, &got_out[tok * H..(tok + 1) * H], &want);
            println!(
                "PARITY {case} token {tok} vs host reference: max_abs={:.3e} rel={:.3e} tol=2.0e-2",
                e.max_abs, e.rel
            );
            if e.rel > 2e-2 {
                failures.push(format!(
                    "{case} token {tok}: rel error {:.3e} against the host reference (max_abs {:.3e} at {})",
                    e.rel, e.max_abs, e.at
                ));
            }
        }
    }
    // Byte floor per call: the distinct experts this rank holds that the call's routes touch, the shared
    // expert slice and the router (gate + bias); activations not counted.
    let distinct: Vec<usize> = sets
        .iter()
        .map(|ids| {
            let mut d: Vec<usize> = ids.iter().copied().filter(|&e| e < held).collect();
            d.sort_unstable();
            d.dedup();
            d.len()
        })
        .collect();
    let mean_d = distinct.iter().sum::<usize>() as f64 / SETS as f64;
    let fixed = 3 * si * H * 2 + E * H * 2 + E * 4;
    let bytes = mean_d * expert_bytes(mi) as f64 + fixed as f64;
    let floor_us = bytes / (copy * 1e9) * 1e6;
    let (dmin, dmax) = (distinct.iter().min().unwrap(), distinct.iter().max().unwrap());
    let routing = if correlated { "correlated" } else { "uniform" };
    let gate_up = if fused { "fused" } else { "split" };
    println!(
        "moe_layer plan={} gate_up={gate_up} routing={routing} T={t}: {us:.1} us per layer (graph of {SETS} layers \
         over {} weight copies, median of {reps}; eager {:.1} us), floor {floor_us:.1} us ({:.1} MB at {copy:.0} \
         GB/s), {:.2}x (goal <= 1.2x), distinct experts {mean_d:.1} (min {dmin} max {dmax}) of {held} held, {} \
         kernels per layer ({launches} engine kernels + {blas} cuBLAS calls)",
        plan.name(),
        w.len(),
        eager * 1e3,
        bytes / 1e6,
        us / floor_us,
        kernels / SETS
    );
    println!(
        "BENCH moe_layer plan={} gate_up={gate_up} routing={routing} T={t} us={us:.2} floor_us={floor_us:.2} \
         ratio={:.3} distinct={mean_d:.2} held={held} bytes={bytes:.0} kernels={} nodes={} \
         engine_kernels={launches} cublas_calls={blas} eager_us={:.2} copies={} tile_rows={tile} splits_gu={} \
         splits_down={}",
        plan.name(),
        us / floor_us,
        kernels / SETS,
        nodes / SETS,
        eager * 1e3,
        w.len(),
        plan_gu.splits,
        plan_d.splits
    );
    for f in &failures {
        eprintln!("FAILED {f}");
    }
    run.failures.extend(failures);
}

/// The routed MoE of one K2.6 layer at full size, T = 1, 8, 32, 64 routed tokens, three plans, two routings,
/// gate and up split (the engine's) and fused.
/// Weights: per plan as many layer copies as fit WEIGHT_BUDGET (full: 3 x 9.6 GB; TP8 and EP8 slices:
/// 8 x 1.2 GB), call i of a graph on copy i % copies with route set i, so consecutive calls never read the
/// same addresses (and a full-size call reads >= 290 MB, past the 60 MB L2).
#[test]
#[ignore = "timing; run by bench/gpu-bench.sh"]
fn moe_layer() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(g) = gpu() else { return };
    let copy = copy_gbps(&g);
    println!(
        "\nmoe_layer: device {}, copy {copy:.0} GB/s (read+write, 1 GiB memcpy_dtod)",
        g.describe()
    );
    println!("BENCH moe_layer_device copy_gbps={copy:.1} hot={HOT} p_hot={P_HOT} sets={SETS}");
    let mut r = rng(2900);
    let pools = Pools::new(&g, &mut r);
    let router = router_host(&mut r);
    let bias = rand_f32(&mut r, E, -0.01, 0.01);
    let mut run = MoeRun {
        router,
        bias,
        copy,
        failures: Vec::new(),
    };
    for plan in [Plan::Full, Plan::Tp8, Plan::Ep8] {
        let (held, mi, si) = plan.dims();
        let layer = held * expert_bytes(mi) + 3 * si * H * 2 + E * H * 2;
        let copies = (WEIGHT_BUDGET / layer).clamp(1, SETS);
        for fused in [false, true] {
            let w: Vec<LayerW> = (0..copies)
                .map(|_| layer_weights(&g, &pools, plan, fused, &run.router, &run.bias))
                .collect();
            g.sync().unwrap();
            eprintln!(
                "moe_layer {} fused={fused}: {copies} weight copies of {:.2} GB",
                plan.name(),
                layer as f64 / 1e9
            );
            for t in [1usize, 8, 32, 64] {
                for correlated in [false, true] {
                    moe_case(&g, &w, plan, t, correlated, &mut run);
                }
            }
            drop(w);
            g.sync().unwrap();
        }
    }
    assert!(
        run.failures.is_empty(),
        "{} moe_layer checks failed:\n{}",
        run.failures.len(),
        run.failures.join("\n")
    );
}

/// Ancestor mask `[t, words]` of a random recursive tree (node i's parent uniform in 0..i; node 0 the
/// root, under the committed prefix) and each node's visible tree rows (itself and its ancestors).
fn tree_mask(r: &mut ChaCha8Rng, t: usize) -> (Vec<u64>, usize, Vec<usize>) {
    let words = t.div_ceil(64);
    let parent: Vec<usize> = (0..t)
        .map(|i| if i == 0 { usize::MAX } else { r.random_range(0..i) })
        .collect();
    let mut bits = vec![0u64; t * words];
    let mut vis = vec![0usize; t];
    for i in 0..t {
        let mut j = i;
        loop {
            bits[i * words + j / 64] |= 1 << (j % 64);
            vis[i] += 1;
            if parent[j] == usize::MAX {
                break;
            }
            j = parent[j];
        }
    }
    (bits, words, vis)
}

/// The MLA tree-verify attention (absorbed form: q `[T, Hr, 576]` over the `[rows, 576]` latent cache,
/// mask = a random recursive tree, the committed length read on the device and the split chosen by the
/// cache's room, as CudaBackend::mla calls it) at context 4K, 16K, 32K, T = 1, 16, 64, 256 nodes, 64
/// heads (1 rank) and 8 (a TP8 rank; the latent cache is replicated). One cache of 61 layers (the engine's
/// [layers, cap, 576] layout); a graph's calls go to consecutive layers, at least 4 and at least 256 MB of
/// latent rows per replay, so the L2 holds none of them at 4K.
#[test]
#[ignore = "timing; run by bench/gpu-bench.sh"]
fn mla_verify() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // The decode kernel off, so that mla_attention times the split kernel at T = 1; the decode kernel is timed by
    // its own call below.
    let Some(g) = gpu_with(kdtree_engine::GpuOptions {
        mla_decode: false,
        ..gpu_options()
    }) else {
        return;
    };
    let copy = copy_gbps(&g);
    let mut r = rng(2950);
    let pools = Pools::new(&g, &mut r);
    let tflops = matmul_tflops(&g, &pools.weights);
    println!(
        "\nmla_verify: device {}, copy {copy:.0} GB/s, cuBLAS bf16 8192^3 {tflops:.0} TFLOP/s",
        g.describe()
    );
    println!("BENCH mla_verify_device copy_gbps={copy:.1} bf16_tflops={tflops:.1}");
    let scale = 1.0 / (192f32).sqrt();
    for ctx in [4096usize, 16384, 32768] {
        let cap = (ctx + 256).next_power_of_two().max(256);
        let cache = fill(&g, &pools.weights, LAYERS * cap * LAT);
        let committed = g.upload(&[ctx as i32]).unwrap();
        for heads in [64usize, 8] {
            for t in [1usize, 16, 64, 256] {
                let q = fill(&g, &pools.weights, t * heads * LAT);
                let (bits, words, vis) = tree_mask(&mut r, t);
                let mask = g.upload(&bits).unwrap();
                let s = MlaShape {
                    t,
                    heads,
                    kv_lora: KV_LORA,
                    rope: LAT - KV_LORA,
                    committed: ctx,
                };
                let room = MlaShape {
                    committed: cap - t,
                    ..s
                };
                let split = MlaSplit {
                    splits: MlaSplit::choose(&g, &room).splits,
                    rows_per_split: 0,
                };
                let (wo, wml) = split.workspace(&s);
                let (mut po, mut pml) = (g.zeros::<f32>(wo).unwrap(), g.zeros::<f32>(wml).unwrap());
                let mut out = g.zeros::<bf16>(t * heads * KV_LORA).unwrap();
                let bytes = (ctx + t) * LAT * 2 + t * heads * (LAT + KV_LORA) * 2 + t * words * 8;
                let mut call = |i: usize, out: &mut CudaSlice<bf16>| {
                    let l = i % LAYERS;
                    let lat = cache.slice(l * cap * LAT..(l + 1) * cap * LAT);
                    let (mv, cv) = (mask.as_view(), committed.as_view());
                    mla_attention::mla_attention(
                        &g,
                        &q.as_view(),
                        &lat,
                        Some((&mv, words)),
                        Some(&cv),
                        &s,
                        &split,
                        scale,
                        &mut po.as_view_mut(),
                        &mut pml.as_view_mut(),
                        &mut out.as_view_mut(),
                    )
                    .unwrap();
                };
                call(0, &mut out);
                let est = time_ms(&g, 1, 3, |i| call(i, &mut out));
                let by_bytes = (256usize << 20).div_ceil(bytes).max(4);
                let by_time = ((50.0 / est.max(1e-4)) as usize).max(4);
                let n = by_bytes.min(by_time).min(LAYERS);
                let what = format!("mla_verify ctx={ctx} heads={heads} T={t}");
                let (us, kernels, reps) = time_layers(&g, n, &mut call, &mut out, &what);
                let floor_us = bytes as f64 / (copy * 1e9) * 1e6;
                let flops =
                    2.0 * heads as f64 * vis.iter().map(|&v| (ctx + v) as f64).sum::<f64>() * (LAT + KV_LORA) as f64;
                let mma_us = flops / (tflops * 1e12) * 1e6;
                println!(
                    "mla_verify ctx={ctx} heads={heads} T={t} (random tree, depth <= {}): {us:.1} us per layer \
                     (graph of {n} layers, median of {reps}), byte floor {floor_us:.1} us ({:.2} MB), {:.2}x (goal \
                     <= 1.3x); {:.1} TFLOP/s ({:.2} GFLOP; at the bf16 matrix rate {mma_us:.1} us); {} kernels per \
                     call, {} splits",
                    vis.iter().max().unwrap(),
                    bytes as f64 / 1e6,
                    us / floor_us,
                    flops / (us * 1e-6) / 1e12,
                    flops / 1e9,
                    kernels,
                    split.splits
                );
                println!(
                    "BENCH mla_verify ctx={ctx} heads={heads} T={t} us={us:.2} floor_us={floor_us:.2} ratio={:.3} \
                     bytes={bytes} gflop={:.3} tflops={:.2} mma_floor_us={mma_us:.2} kernels={} splits={} \
                     layers={n}",
                    us / floor_us,
                    flops / 1e9,
                    flops / (us * 1e-6) / 1e12,
                    kernels,
                    split.splits
                );
                // The decode kernel (ops::mla_decode) on the same call: the A/B.
                if mla_decode::supported(&g, &s) {
                    let mut call = |i: usize, out: &mut CudaSlice<bf16>| {
                        let l = i % LAYERS;
                        let lat = cache.slice(l * cap * LAT..(l + 1) * cap * LAT);
                        let cv = committed.as_view();
                        mla_decode::mla_decode(
                            &g,
                            &q.as_view(),
                            &lat,
                            Some(&cv),
                            &s,
                            &split,
                            scale,
                            &mut po.as_view_mut(),
                            &mut pml.as_view_mut(),
                            &mut out.as_view_mut(),
                        )
                        .unwrap();
                    };
                    call(0, &mut out);
                    let what = format!("mla_decode ctx={ctx} heads={heads}");
                    let (dus, dk, dreps) = time_layers(&g, n, &mut call, &mut out, &what);
                    println!(
                        "mla_decode ctx={ctx} heads={heads} T=1: {dus:.1} us per layer (median of {dreps}), {:.2}x the \
                         byte floor {floor_us:.1} us; the split kernel above {us:.1} us",
                        dus / floor_us
                    );
                    println!(
                        "BENCH mla_decode ctx={ctx} heads={heads} us={dus:.2} floor_us={floor_us:.2} ratio={:.3} \
                         split_us={us:.2} kernels={} splits={}",
                        dus / floor_us,
                        dk,
                        split.splits
                    );
                }
            }
        }
        drop(cache);
        g.sync().unwrap();
    }
}

/// `n` calls of `call` (one a layer, writing `out`) captured as one graph and replayed (the median): microseconds
/// a call, kernels a call, replays. Then one replay over a NaN-filled `out`, which must come back written and
/// finite.
fn time_layers(
    g: &Gpu,
    n: usize,
    call: &mut impl FnMut(usize, &mut CudaSlice<bf16>),
    out: &mut CudaSlice<bf16>,
    what: &str,
) -> (f64, usize, usize) {
    let graph = capture(g, n, |i| call(i, out));
    let (kernels, _) = graph_nodes(&graph);
    let (ms, reps) = replay_median_ms(g, &graph, 100.0, 3);
    g.stream.memcpy_htod(&nan_bf16(out.len())[..], out).unwrap();
    graph.launch().unwrap();
    let got = g.download(out).unwrap();
    if let Some(at) = got.iter().position(|v| !v.to_f32().is_finite()) {
        panic!("{what}: output {at} not written or not finite");
    }
    (ms * 1e3 / n as f64, kernels / n, reps)
}

/// No GPU needed: the forced routes come out of K2.6's router (logits from [`router_host`]'s bf16 weights
/// for [`x_for`]'s inputs rounded to bf16, in f64, through the router kernel's CPU twin), the tree mask
/// holds each node's diagonal and ancestors, and correlated routes touch fewer experts than uniform ones.
#[test]
fn forced_routes_and_tree_masks() {
    use kdtree_engine::cpu::ops::moe_route;
    let mut r = rng(2901);
    let w = router_host(&mut r);
    let bias = rand_f32(&mut r, E, -0.01, 0.01);
    for correlated in [false, true] {
        let t = 4;
        let sets = route_sets(t, correlated);
        for ids in &sets[..2] {
            let x = x_for(&mut r, ids, t);
            for tok in 0..t {
                let xb: Vec<f64> = x[tok * H..(tok + 1) * H]
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_f64())
                    .collect();
                let logits: Vec<f32> = (0..E)
                    .map(|e| {
                        w[e * H..(e + 1) * H]
                            .iter()
                            .zip(&xb)
                            .map(|(a, b)| a.to_f64() * b)
                            .sum::<f64>() as f32
                    })
                    .collect();
                let (mut got, wts) = moe_route(&ROUTER, &logits, Some(&bias));
                let mut want = ids[tok * TOP_K..(tok + 1) * TOP_K].to_vec();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "correlated={correlated} token {tok}");
                assert!(wts.iter().all(|v| v.is_finite() && *v > 0.0));
            }
        }
    }
    for t in [1usize, 16, 64, 256] {
        let (bits, words, vis) = tree_mask(&mut r, t);
        for i in 0..t {
            assert!(
                bits[i * words + i / 64] >> (i % 64) & 1 == 1,
                "T={t} node {i}: no diagonal bit"
            );
            let ones: u32 = bits[i * words..(i + 1) * words].iter().map(|b| b.count_ones()).sum();
            assert_eq!(ones as usize, vis[i]);
            assert!(bits[i * words] & 1 == 1, "T={t} node {i}: the root is not an ancestor");
        }
    }
    for t in [1usize, 8, 32, 64] {
        let mean = |c: bool| {
            let sets = route_sets(t, c);
            sets.iter()
                .map(|ids| {
                    let mut d = ids.clone();
                    d.sort_unstable();
                    d.dedup();
                    d.len()
                })
                .sum::<usize>() as f64
                / SETS as f64
        };
        let (u, c) = (mean(false), mean(true));
        eprintln!("T={t}: distinct experts per call, uniform {u:.1}, correlated {c:.1}");
        assert!(
            t == 1 || c < u,
            "T={t}: correlated routes touch {c} experts, uniform {u}"
        );
    }
}

/// The routed experts of one K2.6 layer at prefill sizes on the TP8 rank-0 slice (384 experts of 256 x 7168
/// and 7168 x 256): gate | up in one grouped launch, SwiGLU, down, for T = 1024, 4096, 16384 tokens routed
/// uniformly (8 distinct experts a token). The form is `plan_moe`'s (the large-M form from
/// `w4a16_gemm::LARGE_MIN_ROWS` rows an expert); time per layer (CUDA events, warm), against the FLOP floor at
/// the bf16 peak measured in the same run (cuBLAS 8192^3) and the weight bytes at the copy rate.
#[test]
#[ignore = "timing; run by bench/gpu-bench.sh"]
fn moe_prefill() {
    use kdtree_engine::cuda::ops::silu_mul;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(g) = gpu() else { return };
    let mut r = rng(3100);
    let pools = Pools::new(&g, &mut r);
    let copy = copy_gbps(&g);
    let peak = matmul_tflops(&g, &pools.weights);
    let mi = MI / 8;
    let i4 = |n: usize, k: usize| {
        (
            fill(&g, &pools.bytes, E * n * k / 2),
            fill(&g, &pools.scales, E * n * k / 32),
        )
    };
    let (gate, up, down) = (i4(mi, H), i4(mi, H), i4(H, mi));
    println!(
        "\nmoe_prefill: device {}, copy {copy:.0} GB/s, bf16 peak {peak:.0} TFLOP/s",
        g.describe()
    );
    for t in [1024usize, 4096, 16384] {
        let p = t * TOP_K;
        let ids: Vec<i32> = (0..t)
            .flat_map(|_| {
                rand::seq::index::sample(&mut r, E, TOP_K)
                    .into_iter()
                    .map(|e| e as i32)
                    .collect::<Vec<_>>()
            })
            .collect();
        let x = fill(&g, &pools.weights, t * H);
        let plan_gu = w4a16_gemm::plan_moe(&g, p, E, 2 * mi, H);
        let plan_d = w4a16_gemm::plan_moe(&g, p, E, H, mi);
        let tile = plan_gu.tile_rows();
        let mt = moe_align::max_tiles(p, E, tile);
        let di = g.upload(&ids).unwrap();
        let (mut sorted, mut tiles, mut nt) = (
            g.zeros::<i32>(p).unwrap(),
            g.zeros::<i32>(3 * mt).unwrap(),
            g.zeros::<i32>(1).unwrap(),
        );
        moe_align::moe_align(
            &g,
            &di.as_view(),
            E,
            tile,
            &mut sorted.as_view_mut(),
            &mut tiles.as_view_mut(),
            &mut nt.as_view_mut(),
        )
        .unwrap();
        let wsl = plan_gu.workspace_len(p, 2 * mi).max(plan_d.workspace_len(p, H)).max(1);
        let mut ws = g.zeros::<f32>(wsl).unwrap();
        let mut gu = g.zeros::<bf16>(p * 2 * mi).unwrap();
        let mut act = g.zeros::<bf16>(p * mi).unwrap();
        let mut y = g.zeros::<bf16>(p * H).unwrap();
        let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), nt.as_view());
        let routing = w4a16_gemm::Routing {
            sorted: &sv,
            tiles: &tv,
            max_tiles: mt,
            n_tiles: &nv,
            tile_rows: tile,
        };
        let (gp, gs, upk, us, dp, ds) = (
            gate.0.as_view(),
            gate.1.as_view(),
            up.0.as_view(),
            up.1.as_view(),
            down.0.as_view(),
            down.1.as_view(),
        );
        let xv = x.as_view();
        let dims = |n: usize, k: usize| w4a16_gemm::MoeDims {
            pairs: p,
            n_experts: E,
            n,
            k,
        };
        let ms_gu = time_ms(&g, 2, 5, |_| {
            let xr = w4a16_gemm::MoeX::Rows {
                x: &xv,
                ld: H,
                row_div: TOP_K,
            };
            w4a16_gemm::moe_w4a16(
                &g,
                xr,
                &routing,
                &[(&gp, &gs), (&upk, &us)],
                dims(mi, H),
                &mut ws.as_view_mut(),
                (&mut gu.as_view_mut(), 2 * mi),
            )
            .unwrap();
        });
        let ms_down = time_ms(&g, 2, 5, |_| {
            if plan_d.large {
                silu_mul::silu_mul(
                    &g,
                    &gu.as_view(),
                    &gu.slice(mi..),
                    &mut act.as_view_mut(),
                    p,
                    mi,
                    2 * mi,
                )
                .unwrap();
                let av = act.as_view();
                let xr = w4a16_gemm::MoeX::Rows {
                    x: &av,
                    ld: mi,
                    row_div: 1,
                };
                w4a16_gemm::moe_w4a16(
                    &g,
                    xr,
                    &routing,
                    &[(&dp, &ds)],
                    dims(H, mi),
                    &mut ws.as_view_mut(),
                    (&mut y.as_view_mut(), H),
                )
                .unwrap();
            } else {
                let guv = gu.as_view();
                let xr = w4a16_gemm::MoeX::SiluGateUp { gu: &guv, ld: 2 * mi };
                w4a16_gemm::moe_w4a16(
                    &g,
                    xr,
                    &routing,
                    &[(&dp, &ds)],
                    dims(H, mi),
                    &mut ws.as_view_mut(),
                    (&mut y.as_view_mut(), H),
                )
                .unwrap();
            }
        });
        let flops = 2.0 * p as f64 * 3.0 * (mi * H) as f64;
        let ms = ms_gu + ms_down;
        let floor_ms = flops / (peak * 1e12) * 1e3;
        let bytes_ms = (3 * E * mi * H) as f64 * 9.0 / 16.0 / (copy * 1e9) * 1e3;
        println!(
            "moe_prefill T={t:>5}: {} form, gate|up {ms_gu:.3} ms + down {ms_down:.3} ms = {ms:.3} ms, {:.0} TFLOP/s; \
             floor {floor_ms:.3} ms (flops) / {bytes_ms:.3} ms (weights): {:.1}x",
            if plan_gu.large { "large-M" } else { "small-M" },
            flops / (ms * 1e-3) / 1e12,
            ms / floor_ms.max(bytes_ms)
        );
        println!(
            "BENCH moe_prefill t={t} large={} gate_up_ms={ms_gu:.4} down_ms={ms_down:.4} tflops={:.1} floor_ms={:.4}",
            plan_gu.large,
            flops / (ms * 1e-3) / 1e12,
            floor_ms.max(bytes_ms)
        );
    }
}

/// Causal prefill attention in MLA's expanded form at the K2.6 TP8 rank-0 slice's widths (8 heads, keys 192 =
/// nope 128 + rope 64, values 128): the one-kernel flash form (`mla_prefill`) against the split kernel's expanded
/// form (`mla_attention_heads` + merge), for one chunk of T new rows after `committed` cached ones (a 4K prompt, a
/// 16K chunk, the second 16K chunk of a 32K prompt). Time per layer (CUDA events, warm) against the FLOP floor
/// (2 (QW + DV) multiply-adds a visible (row, key) pair and head) at the bf16 peak measured in the same run.
#[test]
#[ignore = "timing; run by bench/gpu-bench.sh"]
fn mla_prefill() {
    use kdtree_engine::cuda::ops::mla_prefill as flash;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(g) = gpu() else { return };
    let (hr, qw, dv) = (8usize, 192usize, 128usize);
    if !flash::supported(&g, qw, dv) {
        println!("mla_prefill: the flash form is not supported on {}", g.describe());
        return;
    }
    let mut r = rng(3200);
    let pools = Pools::new(&g, &mut r);
    let peak = matmul_tflops(&g, &pools.weights);
    println!("\nmla_prefill: device {}, bf16 peak {peak:.0} TFLOP/s", g.describe());
    for (t, committed) in [(4096usize, 0usize), (16384, 0), (16384, 16384)] {
        let rows = committed + t;
        let hs = rows * (qw + dv);
        let q = fill(&g, &pools.weights, t * hr * qw);
        let kv = fill(&g, &pools.weights, hr * hs);
        let s = MlaShape {
            t,
            heads: hr,
            kv_lora: dv,
            rope: qw,
            committed,
        };
        let mut out = g.zeros::<bf16>(t * hr * dv).unwrap();
        let scale = 1.0 / (qw as f32).sqrt();
        let flash_p = |p1: bool, out: &mut cudarc::driver::CudaSlice<bf16>| {
            time_ms(&g, 2, 5, |_| {
                let o = &mut out.as_view_mut();
                flash::mla_prefill_with(&g, &q.as_view(), &kv.as_view(), hs, &s, scale, p1, o).unwrap();
            })
        };
        let (ms_flash, ms_p1) = (flash_p(false, &mut out), flash_p(true, &mut out));
        let split = MlaSplit::choose_heads(&g, &s);
        let (wo, wml) = split.workspace(&s);
        let (mut po, mut pml) = (g.zeros::<f32>(wo).unwrap(), g.zeros::<f32>(wml).unwrap());
        let ms_split = time_ms(&g, 1, 3, |_| {
            mla_attention::mla_attention_heads(
                &g,
                &q.as_view(),
                &kv.as_view(),
                hs,
                None,
                &s,
                &split,
                scale,
                &mut po.as_view_mut(),
                &mut pml.as_view_mut(),
                &mut out.as_view_mut(),
            )
            .unwrap();
        });
        let pairs = (t * committed + t * (t + 1) / 2) as f64;
        let flops = 2.0 * pairs * (qw + dv) as f64 * hr as f64;
        let floor_ms = flops / (peak * 1e12) * 1e3;
        let tf = |ms: f64| flops / (ms * 1e-3) / 1e12;
        println!(
            "mla_prefill T={t:>5} after {committed:>5}: flash {ms_flash:.3} ms = {:.0} TFLOP/s ({:.1}x the floor \
             {floor_ms:.3} ms); P as one bf16 {ms_p1:.3} ms = {:.0} TFLOP/s; split form {ms_split:.3} ms = {:.0} \
             TFLOP/s",
            tf(ms_flash),
            ms_flash / floor_ms,
            tf(ms_p1),
            tf(ms_split)
        );
        println!(
            "BENCH mla_prefill t={t} committed={committed} flash_ms={ms_flash:.4} p1_ms={ms_p1:.4} \
             split_ms={ms_split:.4} flash_tflops={:.1} floor_ms={floor_ms:.4}",
            tf(ms_flash)
        );
    }
}
