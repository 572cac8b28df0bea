//! The expanded (multi-head) MLA prefill (`KDTREE_MLA_EXPANDED_MIN_ROWS`, `GpuOptions::mla_expanded_min_rows`:
//! kv_b expands the latent rows into per-head keys and values, `mla_attention_heads`) inside the model: a 60-token
//! prefill of the synthetic tiny preset and of the trained pair (one rank), the attention output of layers 0 and 1
//! (before any router can pick other experts) against the CPU reference and against the GPU's latent form. Needs a
//! GPU.
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use cuda_common::*;
use kdtree_engine::api::{LogitRows, Target};
use kdtree_engine::model::{Trace, TraceData};
use kdtree_engine::{open_cpu, open_with, AttnMode, Device, OpenOptions};
use round_common::{convert, pair_dir, synth_tiny_one_rank};
use std::path::Path;

/// Relative to the largest |value| of a layer's attention output, over all rows: bf16 roundings of the inputs,
/// the expanded keys and values and the output (~4e-3 each) and another summation order.
const TOL: f64 = 2.0e-2;

fn prefill(t: &mut dyn Target, prompt: &[u32]) -> Trace {
    let chain: Vec<i32> = (0..prompt.len() as i32).map(|i| i - 1).collect();
    t.reset();
    t.start_trace();
    t.forward_rows(prompt, &chain, LogitRows::Last).unwrap();
    t.take_trace().unwrap()
}

fn attn(tr: &Trace, l: usize) -> Vec<f32> {
    match &tr.get(&format!("layers.{l}.attn_out")).unwrap().data {
        TraceData::F32(v) => v.clone(),
        TraceData::I32(_) => panic!("attn_out is f32"),
    }
}

fn case(label: &str, dir: &Path) {
    let opts = |min_rows: usize| {
        let mut gpu = gpu_options();
        gpu.mla_expanded_min_rows = min_rows;
        OpenOptions {
            attn_mode: AttnMode::Absorbed,
            gpu,
            ..OpenOptions::default()
        }
    };
    let mut cpu = open_cpu(dir, opts(0)).unwrap();
    let mut latent = open_with(dir, Device::Cuda, opts(0)).unwrap();
    let mut expanded = open_with(dir, Device::Cuda, opts(16)).unwrap();
    let v = latent.target.info().vocab_size as u32;
    let prompt: Vec<u32> = (0..60u32).map(|i| (i * 101 + 7) % v).collect();
    let (a, b, c) = (
        prefill(&mut cpu.target, &prompt),
        prefill(&mut *latent.target, &prompt),
        prefill(&mut *expanded.target, &prompt),
    );
    for l in 0..2 {
        let (want, lat, exp) = (attn(&a, l), attn(&b, l), attn(&c, l));
        check(
            &format!("{label} layer {l} attention, expanded prefill vs the CPU"),
            &exp,
            &want,
            TOL,
        );
        check(
            &format!("{label} layer {l} attention, expanded vs latent on the GPU"),
            &exp,
            &lat,
            TOL,
        );
    }
}

#[test]
fn expanded_prefill_matches_the_cpu_reference() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    case("tiny-synth", &synth_tiny_one_rank(tmp.path()));
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    case("kdtree-tiny-pair", &tmp.path().join("pair1"));
}
