//! The router's selection-score error of the CUDA forward against the CPU reference, measured: the bound of the
//! route-flip rule the GPU suite's teacher-forced checks use. A token's routed experts can come out differently
//! on the GPU only where the CPU's decision margin (`cpu::ops::route_margin`: the last chosen expert's selection
//! score minus the best unchosen one's; sigmoid + bias, one group on these models) is below |Δ s_a| + |Δ s_b|
//! <= 2 max |Δ s|. This test prefills the same prompts on both backends with the layer trace on, then runs 16 one-row
//! decode steps on the same tokens, compares every
//! MoE layer's router logits through the sigmoid (the bias is the same on both) on the rows no route flip has
//! reached yet (a flip's row and every later row of the layers after it carry its difference, not bf16 noise),
//! and prints `MEASURE router_score_error model=M row_layers=N scores=S route_flips=F max=X p99=Y
//! flip_margin=2X` per model (the synthetic tiny preset
//! and the trained pair, converted for one rank). It fails when the error is not finite or above 0.02 (a
//! broken forward, far above bf16 noise: run 72 saw flips at margins up to 1.6e-3). Needs a GPU.
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use cuda_common::*;
use kdtree_engine::api::LogitRows;
use kdtree_engine::model::TraceData;
use kdtree_engine::{open_cpu, open_with, AttnMode, Device, OpenOptions};
use round_common::{convert, pair_dir, synth_tiny_one_rank};
use std::path::Path;

fn sigmoid(z: f32) -> f64 {
    1.0 / (1.0 + (-(z as f64)).exp())
}

/// One-row decode steps after each prompt's prefill: the AR path's M = 1 GEMMs and split attention.
const DECODE_STEPS: usize = 16;
/// One MoE layer of a forward: every row's router logits, and the expert ids it chose.
type RouterLayer = (Vec<f32>, Vec<i32>);

/// A trace's MoE layers in order: (router logits [T, E], chosen ids [T, k]).
fn router_layers(label: &str, t: &kdtree_engine::model::Trace) -> Vec<RouterLayer> {
    t.tensors
        .iter()
        .filter(|x| x.name.ends_with("router.logits"))
        .map(|a| {
            let ids = a.name.replace("router.logits", "router.topk_ids");
            match (&a.data, t.get(&ids).map(|b| &b.data)) {
                (TraceData::F32(x), Some(TraceData::I32(y))) => (x.clone(), y.clone()),
                _ => panic!("{label}: {} (f32) or {ids} (i32) missing from the trace", a.name),
            }
        })
        .collect()
}

fn measure(label: &str, dir: &Path) {
    let opts = OpenOptions {
        attn_mode: AttnMode::Absorbed,
        gpu: gpu_options(),
        ..OpenOptions::default()
    };
    let mut cpu = open_cpu(dir, opts).unwrap();
    let mut gpu = open_with(dir, Device::Cuda, opts).unwrap();
    let v = gpu.target.info().vocab_size as u32;
    let mut r = rng(7331);
    let mut errs: Vec<f64> = Vec::new();
    let mut rows = 0;
    let mut flips = 0;
    for len in [24usize, 40, 64] {
        use rand::Rng;
        let prompt: Vec<u32> = (0..len).map(|_| r.random_range(0..v)).collect();
        let steps: Vec<u32> = (0..DECODE_STEPS).map(|_| r.random_range(0..v)).collect();
        let chain: Vec<i32> = (0..len as i32).map(|i| i - 1).collect();
        // Per backend, per forward (the prefill, then one-row decode steps teacher-forced on the same tokens):
        // every MoE layer's (router logits, chosen ids), in layer order.
        let mut calls: Vec<Vec<Vec<RouterLayer>>> = Vec::new();
        for t in [&mut cpu.target as &mut dyn kdtree_engine::api::Target, &mut *gpu.target] {
            t.reset();
            let mut per = Vec::new();
            for (i, tokens) in std::iter::once(&prompt[..]).chain(steps.chunks(1)).enumerate() {
                t.start_trace();
                let parents: &[i32] = if i == 0 { &chain } else { &[-1] };
                t.forward_rows(tokens, parents, LogitRows::Last).unwrap();
                per.push(router_layers(label, &t.take_trace().unwrap()));
                t.commit(&(0..tokens.len()).collect::<Vec<_>>()).unwrap();
            }
            calls.push(per);
        }
        // A route flip at (row q, MoE layer l) changes row q's output of layer l and, through attention, every
        // row >= q at the layers after l: those rows carry the flip's difference, not bf16 noise. A row p is
        // measured at layer i only if no flip (q <= p, l < i) came before; rows come in order, so for the
        // decode rows that is i <= the smallest flipped layer so far (`cap`); inside the prefill, the rows
        // before the earliest flipped row of an earlier layer (`clean`).
        let mut cap = usize::MAX;
        for (c, (ca, ga)) in calls[0].iter().zip(&calls[1]).enumerate() {
            assert_eq!(ca.len(), ga.len(), "{label}: MoE layers traced");
            let n = if c == 0 { len } else { 1 };
            let mut clean = n;
            for (i, ((xl, xi), (yl, yi))) in ca.iter().zip(ga).enumerate() {
                if c > 0 && i > cap {
                    break;
                }
                assert_eq!((xl.len(), xi.len()), (yl.len(), yi.len()), "{label}: layer {i} shapes");
                let (e, k) = (xl.len() / n, xi.len() / n);
                errs.extend(
                    xl[..clean * e]
                        .iter()
                        .zip(&yl[..clean * e])
                        .map(|(&p, &q)| (sigmoid(p) - sigmoid(q)).abs()),
                );
                rows += clean;
                let flipped = (0..clean).find(|&p| {
                    let (mut sa, mut sb) = (xi[p * k..(p + 1) * k].to_vec(), yi[p * k..(p + 1) * k].to_vec());
                    sa.sort_unstable();
                    sb.sort_unstable();
                    sa != sb
                });
                if let Some(p) = flipped {
                    flips += 1;
                    clean = p;
                    cap = cap.min(i);
                }
            }
        }
    }
    assert!(!errs.is_empty(), "{label}: no MoE layer traced");
    errs.sort_by(|a, b| a.total_cmp(b));
    let max = *errs.last().unwrap();
    let p99 = errs[(errs.len() - 1) * 99 / 100];
    println!(
        "MEASURE router_score_error model={label} row_layers={rows} scores={} route_flips={flips} \
         max={max:.3e} p99={p99:.3e} flip_margin={:.3e}",
        errs.len(),
        2.0 * max
    );
    assert!(
        max.is_finite() && max <= 0.02,
        "{label}: router score error {max:.3e}: not bf16 noise"
    );
}

#[test]
fn router_score_error_of_the_gpu_forward() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    measure("tiny-synth", &synth_tiny_one_rank(tmp.path()));
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    measure("kdtree-tiny-pair", &tmp.path().join("pair1"));
}
