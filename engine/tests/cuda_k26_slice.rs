//! Timing of the TP8 rank-0 slice of the full K2.6 (61 layers, 384 experts, the K2.6 DFlash drafter) on one
//! GPU, from dummy weights (`DummySource`: the converter's plan for 8 ranks, rank 0 only, every tensor
//! filled on the device from a seed; ~74 GB, no files). What one GPU of eight computes, minus the
//! all-reduces. `#[ignore]` (needs an H200-class GPU and ~2 minutes): run with
//! `cargo test -p kdtree-engine --features cuda --release --test cuda_k26_slice -- --ignored --nocapture`.
//! Prints one `BENCH k26r0 ...` line per figure: the fill (GB, s), then the AR step, the feed round (budget
//! 0) and DDTree rounds at budgets 16, 64, 256 through `Session::step` (device step / device round, captured
//! as CUDA graphs and replayed; wall time per step including its one host read, median / p10 / p90 of N
//! after a warm-up), with
//! the GPU's counters per step (graph launches, eager kernel launches, reads) and the byte floor under
//! uniform routing (distinct experts of T nodes × top-8 of 384: 384·(1 − (1 − 8/384)^T)) at 4.3 TB/s.
#![cfg(feature = "cuda")]

mod cuda_common;

use kdtree_engine::generate::Sampling;
use kdtree_engine::model::open::open_dummy_cuda_on;
use kdtree_engine::model::DummySource;
use kdtree_engine::Mode;
use std::sync::Arc;
use std::time::Instant;

/// Steps timed per figure (after WARM untimed ones: the first captures the graph).
const STEPS: usize = 40;
const WARM: usize = 4;
/// The measured device-to-device copy rate of the H200 (perf-anchors §7.1), for the floor column.
const COPY_TB_S: f64 = 4.3;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[test]
#[ignore]
fn k26_rank0_slice_timing() {
    let Some(gpu) = cuda_common::gpu() else { return };
    let gpu = Arc::new(gpu);
    let p = kdtree_convert::synth::resolve("k26", None).unwrap();
    let (c, d) = (
        kdtree_convert::synth::configs::model_config(&p).to_string(),
        kdtree_convert::synth::configs::drafter_config(&p).to_string(),
    );
    let src = DummySource::from_json("k26/config.json", &c, Some(("k26/drafter/config.json", &d)), 8, 0, 0).unwrap();
    // Bytes a step reads: routed experts (per expert), the rest of the target (embed_tokens is a row gather,
    // not read whole), the drafter.
    let (mut routed, mut dense, mut drafter) = (0u64, 0u64, 0u64);
    for (name, dtype, shape) in src.listing() {
        let b = kdtree_formats::dtype::byte_len(dtype, &shape).unwrap() as u64;
        if name.starts_with("drafter.") {
            drafter += b;
        } else if name.contains(".mlp.experts.") {
            routed += b;
        } else if !name.contains("embed_tokens") {
            dense += b;
        }
    }
    let (e, k, moe_layers) = (384.0f64, 8.0f64, 60.0);
    let per_expert = routed as f64 / e; // all MoE layers together
    let floor_ms = |nodes: usize, with_drafter: bool| {
        let touched = e * (1.0 - (1.0 - k / e).powi(nodes as i32));
        (dense as f64 + touched * per_expert + if with_drafter { drafter as f64 } else { 0.0 }) / (COPY_TB_S * 1e12)
            * 1e3
    };
    let total = src.bytes();
    let t0 = Instant::now();
    let mut m = open_dummy_cuda_on(src, gpu.clone()).unwrap();
    println!(
        "BENCH k26r0 fill {:.2} GB (target + drafter, rank 0 of 8) in {:.2} s on {}",
        total as f64 / 1e9,
        t0.elapsed().as_secs_f64(),
        gpu.describe()
    );
    println!(
        "BENCH k26r0 bytes: routed experts {:.2} GB ({moe_layers} MoE layers), other target {:.2} GB, drafter {:.2} GB",
        routed as f64 / 1e9,
        dense as f64 / 1e9,
        drafter as f64 / 1e9
    );
    let v = m.target.info().vocab_size as u32;
    assert_eq!(v, 20480, "the rank slice's vocabulary is V/8");
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 11) % v).collect();
    // KDTREE_PROFILE=k26ar|k26dd16: one replay of that graph between cuProfilerStart/Stop (bench/ncu.sh times
    // each of its kernels alone), instead of the timings.
    let profile = std::env::var("KDTREE_PROFILE").unwrap_or_default();
    for (name, tag, mode) in [
        ("ar_step", "k26ar", Mode::Ar),
        // The feed round (`--budget auto` where drafting does not pay): the AR step plus the drafter's context.
        ("feed_round budget=0", "k26feed", Mode::DDTree { budget: 0 }),
        ("ddtree_round budget=16", "k26dd16", Mode::DDTree { budget: 16 }),
        ("ddtree_round budget=64", "k26dd64", Mode::DDTree { budget: 64 }),
        ("ddtree_round budget=256", "k26dd256", Mode::DDTree { budget: 256 }),
    ] {
        if !profile.is_empty() && profile != tag {
            continue;
        }
        let mut s = m.session(mode).unwrap();
        s.reserve(prompt.len() + 8 * (WARM + STEPS) + 300).unwrap();
        s.prefill(&prompt, &Sampling::greedy()).unwrap();
        for _ in 0..WARM {
            s.step().unwrap();
        }
        let census = gpu
            .last_graph()
            .map(|c| c.to_string())
            .unwrap_or_else(|| "no graph".into());
        if !profile.is_empty() {
            gpu.profiled(|| s.step().unwrap()).unwrap();
            println!("BENCH k26r0 {name}: one replay profiled; the graph: {census}");
            continue;
        }
        let (before, graphs0) = (
            gpu.stats.snapshot(),
            gpu.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed),
        );
        let mut ms = Vec::with_capacity(STEPS);
        let mut tokens = 0;
        for _ in 0..STEPS {
            let t = Instant::now();
            tokens += s.step().unwrap().tokens.len();
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let after = gpu.stats.snapshot();
        let graphs = gpu.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed) - graphs0;
        let per = |i: usize| (after[i] - before[i]) as f64 / STEPS as f64;
        let device = if mode == Mode::Ar {
            s.device_steps()
        } else {
            s.device_rounds()
        };
        let nodes = match mode {
            Mode::DDTree { budget } => budget + 1,
            _ => 1,
        };
        let (med, p10, p90) = (pct(&mut ms, 0.5), pct(&mut ms, 0.1), pct(&mut ms, 0.9));
        let floor = floor_ms(nodes, nodes > 1);
        println!(
            "BENCH k26r0 {name}: median {med:.3} ms (p10 {p10:.3}, p90 {p90:.3}; {STEPS} steps after {WARM}), {:.2} \
             tokens/step, uniform-routing byte floor {floor:.3} ms ({:.2}x), per step: {:.2} graph launches, {:.1} \
             eager kernels, {:.1} cuBLAS, {:.1} reads; {device} of {} steps on the device; the graph: {census}",
            tokens as f64 / STEPS as f64,
            med / floor,
            graphs as f64 / STEPS as f64,
            per(0),
            per(1),
            per(3),
            WARM + STEPS
        );
    }
    if let Some(why) = gpu.capture_failure() {
        println!("BENCH k26r0 capture failed (steps ran eagerly): {why}");
    }
}
