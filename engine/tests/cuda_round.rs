//! The whole DDTree round on the GPU (`Target::device_round` on the CUDA backend: the drafter, top-K, tree
//! build, mask, verify, per-node decisions, walk and commit on the device; one read back per round) on the
//! trained pair models/kdtree-tiny converted for one rank:
//! * `device_round_equals_the_host_round_on_the_gpu`: every round's tokens and counters equal the host round
//!   on the same GPU (same kernels for the forwards; the host builds and walks the tree), greedy and two
//!   sampled settings, budgets 1 to 1024;
//! * `ddtree_equals_ar_on_the_gpu`: greedy DDTree through the device round emits the AR tokens, budgets 1,
//!   8, 64, 256, 1024 (tie-aware: a divergence is accepted only where the AR row's top two logits are within
//!   the bf16 tolerance, and printed);
//! * `captured_round_equals_the_eager_round`: the round captured once as a CUDA graph and replayed gives
//!   the same steps as the same ops launched one by one (greedy and sampled, budgets 1, 16, 256);
//! * `one_read_back_per_round`: graph launches, kernel launches, cuBLAS calls, uploads and reads (host
//!   syncs) per round, captured vs eager device round vs host round, from the GPU's counters; a device
//!   round reads back exactly once, and a replayed one launches one graph and nothing else.
//!
//! Needs a GPU: skips without one unless KDTREE_REQUIRE_GPU=1.
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use kdtree_engine::cuda::Gpu;
use kdtree_engine::generate::Sampling;
use kdtree_engine::{open_cuda_on, Loaded, Mode, ProbeSet};
use round_common::*;
use std::sync::Arc;

fn pair_on_gpu(tmp: &tempfile::TempDir) -> Option<(Arc<Gpu>, Loaded)> {
    let g = Arc::new(cuda_common::gpu()?);
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let m = open_cuda_on(&tmp.path().join("pair1"), g.clone()).unwrap();
    Some((g, m))
}

const PROMPTS: [&[u32]; 2] = [&[1, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11], &[400, 401, 402, 9]];

#[test]
fn device_round_equals_the_host_round_on_the_gpu() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((_g, mut m)) = pair_on_gpu(&tmp) else { return };
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    let (rounds, tau) = compare(&mut m, "kdtree-tiny pair, cuda", &prompts, &[1, 8, 64, 256, 1024], 6);
    println!("PARITY device_round(cuda) exact over {rounds} rounds (greedy tau {tau:.2})");
}

#[test]
fn ddtree_equals_ar_on_the_gpu() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((_g, mut m)) = pair_on_gpu(&tmp) else { return };
    let n = 24;
    for (i, p) in PROMPTS.iter().enumerate() {
        // AR with the logit row behind every token (for the tie check).
        let (ar, rows) = {
            let mut s = m.session(Mode::Ar).unwrap();
            s.set_probes(ProbeSet { logits: true, ..ProbeSet::default() });
            let mut toks = vec![s.prefill(p, &Sampling::greedy()).unwrap()];
            while toks.len() < n {
                toks.extend(s.step().unwrap().tokens);
            }
            (toks, s.take_probes().logits)
        };
        for budget in [1usize, 8, 64, 256, 1024] {
            let mut s = m.session(Mode::DDTree { budget }).unwrap();
            let mut toks = vec![s.prefill(p, &Sampling::greedy()).unwrap()];
            while toks.len() < n {
                toks.extend(s.step().unwrap().tokens);
            }
            assert!(s.device_rounds() > 0, "budget {budget}: no round ran on the device");
            toks.truncate(n);
            match toks.iter().zip(&ar).position(|(a, b)| a != b) {
                None => println!("PARITY ddtree_vs_ar(cuda,prompt={i},budget={budget}) exact ({n} tokens, {} device rounds)", s.device_rounds()),
                Some(k) => {
                    let row = &rows[k];
                    let (a, b) = (row[ar[k] as usize], row[toks[k] as usize]);
                    assert!((a - b).abs() <= 5e-2 * a.abs().max(1.0), "prompt {i} budget {budget}: token {k} is {} (AR {}), AR logits {a} vs {b}: not a near-tie", toks[k], ar[k]);
                    println!("PARITY ddtree_vs_ar(cuda,prompt={i},budget={budget}) first {k} of {n} tokens identical, then a near-tie (AR logits {a} vs {b})");
                }
            }
        }
    }
}

#[test]
fn captured_round_equals_the_eager_round() {
    // The captured round (one CUDA graph, replayed) against the same ops run eagerly, step for step.
    let tmp = tempfile::tempdir().unwrap();
    let Some((g, mut m)) = pair_on_gpu(&tmp) else { return };
    let settings = [Sampling::greedy(), Sampling { temperature: 1.0, top_p: 0.9, top_k: 0, seed: 3 }];
    let (mut rounds, steps) = (0, 8);
    for s in &settings {
        for budget in [1usize, 16, 256] {
            for p in PROMPTS {
                g.set_graphs(false);
                let (eager, _) = run(&mut m, p, budget, s, true, steps);
                g.set_graphs(true);
                let graphs_before = g.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed);
                let (captured, n) = run(&mut m, p, budget, s, true, steps);
                let graphs = g.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed) - graphs_before;
                assert_eq!(n, steps, "budget {budget}: rounds fell back to the host");
                assert_eq!(graphs as usize, steps, "budget {budget}: {graphs} graph launches for {steps} rounds");
                assert_eq!(captured, eager, "budget {budget} {s:?}: the captured round differs from the eager one");
                rounds += steps;
            }
        }
    }
    println!("PARITY device_round(cuda, one CUDA graph per round == eager) exact over {rounds} rounds (greedy and T=1 top_p 0.9, budgets 1, 16, 256)");
}

#[test]
fn one_read_back_per_round() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((g, mut m)) = pair_on_gpu(&tmp) else { return };
    let graph_launches = || g.stats.graph_launches.load(std::sync::atomic::Ordering::Relaxed);
    for budget in [8usize, 64, 256] {
        for (what, device, graphs) in [("one CUDA graph", true, true), ("device round, eager", true, false), ("host round", false, false)] {
            g.set_graphs(graphs);
            let mut s = m.session(Mode::DDTree { budget }).unwrap();
            s.set_device_round(device);
            s.prefill(PROMPTS[0], &Sampling::greedy()).unwrap();
            // Warm: the tree workspace is allocated (and the round captured) in the first round.
            let warm = g.stats.snapshot();
            s.step().unwrap();
            let captured = g.stats.snapshot();
            let rounds = 5u64;
            let (before, gl) = (g.stats.snapshot(), graph_launches());
            for _ in 0..rounds {
                s.step().unwrap();
            }
            let (after, gl) = (g.stats.snapshot(), graph_launches() - gl);
            let per: Vec<f64> = before.iter().zip(&after).map(|(a, b)| (b - a) as f64 / rounds as f64).collect();
            let in_graph = if graphs { format!(" (the graph holds {} kernels and {} cuBLAS calls)", captured[0] - warm[0], captured[1] - warm[1]) } else { String::new() };
            println!(
                "BENCH round_counts budget={budget} {what}: per round {:.1} graph launches, {:.1} kernel launches, {:.1} cuBLAS calls, {:.1} uploads, {:.1} reads back (host syncs){in_graph}",
                gl as f64 / rounds as f64, per[0], per[1], per[2], per[3]
            );
            if device {
                assert_eq!(s.device_rounds() as u64, rounds + 1, "budget {budget}: rounds fell back to the host");
                assert_eq!(after[3] - before[3], rounds, "budget {budget}: a device round must read back exactly once");
            }
            if graphs {
                assert_eq!(gl, rounds, "budget {budget}: one graph launch per round");
                assert_eq!((after[0] - before[0], after[1] - before[1], after[2] - before[2]), (0, 0, 0), "budget {budget}: a replayed round launches nothing else and uploads nothing");
            }
        }
    }
    g.set_graphs(true);
}
