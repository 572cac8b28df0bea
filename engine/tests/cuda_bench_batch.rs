//! Timings of batched steps (issue 15) on the GPU: one `Batch::step` over N sequences (N = 1, 4, 16, 64) in AR
//! and DDTree budget 16, on the trained pair (models/kdtree-tiny) and on a k26-slice model (real K2.6 widths,
//! 3 layers, one rank, dummy weights filled on the GPU). Each figure: the median of 10 steps between CUDA
//! events after 3 warm-up steps (the first captures the step's graph), the host's read included; with the
//! graph's node census and the launches, uploads and reads per step (a replayed step is one graph launch and
//! one read). `KDTREE_PROFILE=<model>-<mode>-<N>` (e.g. `pair-ar-64`): one step between cuProfilerStart/Stop
//! instead (Nsight Compute times its kernels; bench/batch.sh). Ignored: run by bench/batch.sh.
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use kdtree_engine::generate::Sampling;
use kdtree_engine::model::open::{open_cuda_on, open_dummy_cuda_on};
use kdtree_engine::model::DummySource;
use kdtree_engine::{Loaded, Mode};
use std::sync::Arc;

fn steps(g: &Arc<kdtree_engine::cuda::Gpu>, m: &Loaded, model: &str) {
    steps_at(
        g,
        m,
        model,
        &[1, 4, 16, 64],
        &[("ar", Mode::Ar), ("dd16", Mode::DDTree { budget: 16 })],
    );
}

fn steps_at(g: &Arc<kdtree_engine::cuda::Gpu>, m: &Loaded, model: &str, sizes: &[usize], modes: &[(&str, Mode)]) {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let profile = std::env::var("KDTREE_PROFILE").unwrap_or_default();
    let v = m.info().vocab_size as u32;
    for &(tag, mode) in modes {
        for &n in sizes {
            let name = format!("{model}-{tag}-{n}");
            if !profile.is_empty() && profile != name {
                continue;
            }
            let mut batch = m.batch(mode, n, None).unwrap();
            for i in 0..n {
                let prompt: Vec<u32> = (0..16 + (i % 5) as u32 * 6)
                    .map(|j| (j * 7919 + 11 * i as u32 + 1) % v)
                    .collect();
                let s = batch.session(i);
                s.reserve(prompt.len() + 64).unwrap();
                s.prefill(&prompt, &Sampling::greedy()).unwrap();
            }
            let all: Vec<usize> = (0..n).collect();
            for _ in 0..3 {
                batch.step(&all).unwrap();
            }
            let census = g
                .last_graph()
                .map(|c| c.to_string())
                .unwrap_or_else(|| "no graph".into());
            if !profile.is_empty() {
                g.profiled(|| batch.step(&all).unwrap()).unwrap();
                println!("BENCH batch_step {name}: one step profiled; the graph: {census}");
                continue;
            }
            let before = g.stats.snapshot();
            let graphs0 = g.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed);
            let (mut ms, mut tokens) = (Vec::new(), 0usize);
            for _ in 0..10 {
                let e0 = g.stream.record_event(flags).unwrap();
                tokens += batch.step(&all).unwrap().iter().map(|e| e.tokens.len()).sum::<usize>();
                let e1 = g.stream.record_event(flags).unwrap();
                e1.synchronize().unwrap();
                ms.push(e0.elapsed_ms(&e1).unwrap() as f64);
            }
            let after = g.stats.snapshot();
            let graphs = g.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed) - graphs0;
            ms.sort_by(f64::total_cmp);
            let med = ms[ms.len() / 2];
            let per = |k: usize| (after[k] - before[k]) as f64 / 10.0;
            println!(
                "BENCH batch_step {name}: {med:.3} ms a step (median of 10), {:.1} tokens a step, {:.0} tok/s; per \
                 step {:.1} graph launches, {:.1} kernel launches, {:.1} uploads, {:.1} reads; the graph: {census}",
                tokens as f64 / 10.0,
                tokens as f64 / 10.0 / med * 1e3,
                graphs as f64 / 10.0,
                per(0),
                per(2),
                per(3)
            );
        }
    }
}

#[test]
#[ignore = "timing; run by bench/batch.sh"]
fn batch_steps_pair() {
    let Some(g) = cuda_common::gpu() else { return };
    let g = Arc::new(g);
    let tmp = tempfile::tempdir().unwrap();
    round_common::convert(&round_common::pair_dir(), &tmp.path().join("pair1"), 1);
    let m = open_cuda_on(&tmp.path().join("pair1"), g.clone()).unwrap();
    steps(&g, &m, "pair");
}

#[test]
#[ignore = "timing; run by bench/batch.sh"]
fn batch_steps_k26_slice() {
    let Some(g) = cuda_common::gpu() else { return };
    let g = Arc::new(g);
    let p = kdtree_convert::synth::resolve("k26-slice", Some(3)).unwrap();
    let (c, d) = (
        kdtree_convert::synth::configs::model_config(&p).to_string(),
        kdtree_convert::synth::configs::drafter_config(&p).to_string(),
    );
    let src = DummySource::from_json(
        "k26-slice/config.json",
        &c,
        Some(("k26-slice/drafter/config.json", &d)),
        1,
        0,
        0,
    )
    .unwrap();
    let m = open_dummy_cuda_on(src, g.clone()).unwrap();
    steps(&g, &m, "k26");
}

/// The TP8 rank-0 slice of the full 61-layer K2.6 (dummy weights, ~78 GB filled on the GPU): what one GPU of
/// eight computes for a batch, without the all-reduces. `KDTREE_BATCH_K26R0=1` (a long fill; bench/batch.sh).
#[test]
#[ignore = "timing; run by bench/batch.sh with KDTREE_BATCH_K26R0=1"]
fn batch_steps_k26_rank0() {
    if std::env::var("KDTREE_BATCH_K26R0").as_deref() != Ok("1") {
        return;
    }
    let Some(g) = cuda_common::gpu() else { return };
    let g = Arc::new(g);
    let p = kdtree_convert::synth::resolve("k26", None).unwrap();
    let (c, d) = (
        kdtree_convert::synth::configs::model_config(&p).to_string(),
        kdtree_convert::synth::configs::drafter_config(&p).to_string(),
    );
    let src = DummySource::from_json("k26/config.json", &c, Some(("k26/drafter/config.json", &d)), 8, 0, 0).unwrap();
    let m = open_dummy_cuda_on(src, g.clone()).unwrap();
    steps_at(
        &g,
        &m,
        "k26r0",
        &[1, 16, 64],
        &[("ar", Mode::Ar), ("dd16", Mode::DDTree { budget: 16 })],
    );
}
