//! The expanded (multi-head) MLA prefill (`KDTREE_MLA_EXPANDED_MIN_ROWS`, `GpuOptions::mla_expanded_min_rows`:
//! kv_b expands the latent rows into per-head keys and values, `mla_attention_heads`) inside the model: a 60-token
//! prefill of the synthetic tiny preset and of the trained pair (one rank), the attention output of layers 0 and 1
//! (before any router can pick other experts) against the CPU reference and against the GPU's latent form. Needs a
//! GPU.
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use cuda_common::*;
use kdtree_engine::api::{LogitRows, PrefillItem, Target};
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

/// A batched prefill takes the expanded form per segment (each prompt of at least the switch's rows alone, the
/// others together in the latent form), so a prompt gets its form whatever batch it is in: the trained pair, three
/// prompts of 60, 20 and 50 tokens with the switch at 32, against each prompt's prefill alone and the CPU.
#[test]
fn batched_prefill_takes_the_expanded_form_per_segment() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pair1");
    convert(&pair_dir(), &dir, 1);
    let opts = |min_rows: usize| {
        let mut gpu = gpu_options();
        gpu.mla_expanded_min_rows = min_rows;
        OpenOptions {
            attn_mode: AttnMode::Absorbed,
            gpu,
            ..OpenOptions::default()
        }
    };
    let (expanded, latent) = (
        open_with(&dir, Device::Cuda, opts(32)).unwrap(),
        open_with(&dir, Device::Cuda, opts(0)).unwrap(),
    );
    let mut cpu = open_cpu(&dir, opts(0)).unwrap();
    let v = expanded.target.info().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [60u32, 20, 50]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 97 + 13 * n) % v).collect())
        .collect();
    let batch = |m: &kdtree_engine::Loaded| -> Vec<Vec<f32>> {
        let mut ts: Vec<Box<dyn Target>> = prompts.iter().map(|_| m.target.fork().unwrap()).collect();
        let mut items: Vec<PrefillItem> = ts
            .iter_mut()
            .zip(&prompts)
            .map(|(t, p)| PrefillItem {
                target: &mut **t,
                drafter: None,
                prompt: p,
            })
            .collect();
        m.target.batch_ops().unwrap().prefill(&mut items).unwrap()
    };
    let alone = |t: &mut dyn Target, p: &[u32]| -> Vec<f32> {
        let chain: Vec<i32> = (0..p.len() as i32).map(|i| i - 1).collect();
        t.reset();
        t.forward_rows(p, &chain, LogitRows::Last).unwrap().logits
    };
    let (b1, b2, b_lat) = (batch(&expanded), batch(&expanded), batch(&latent));
    assert_eq!(b1, b2, "two batched prefills differ");
    for (i, p) in prompts.iter().enumerate() {
        let mut t = expanded.target.fork().unwrap();
        let own = alone(&mut *t, p);
        let want = alone(&mut cpu.target, p);
        let same = b1[i]
            .iter()
            .zip(&own)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        println!(
            "PARITY batched prefill, prompt {i} ({} tokens): {same} of {} logits bit-equal to its prefill alone",
            p.len(),
            own.len()
        );
        check(
            &format!("batched prefill prompt {i} ({} tokens) vs alone", p.len()),
            &b1[i],
            &own,
            TOL,
        );
        check(
            &format!("batched prefill prompt {i} ({} tokens) vs the CPU", p.len()),
            &b1[i],
            &want,
            TOL,
        );
        // The long prompts' rows took the expanded form in the batch: other roundings than the latent batch's.
        if p.len() >= 32 {
            assert_ne!(
                b1[i], b_lat[i],
                "prompt {i}: the batched prefill did not take the expanded form"
            );
        }
    }
}
