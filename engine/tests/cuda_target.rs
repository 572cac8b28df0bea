//! The whole target forward on the CUDA backend (`TargetModel<CudaBackend>`, the model code the CPU
//! reference runs) against the CPU reference on the same in-memory weights: a chained prefill, a tree
//! forward with an ancestor mask hanging off it, a commit of a root-to-node path, a decode step after it,
//! and greedy AR generation. Reports max abs and rel (max abs / max |reference|) logit error per stage
//! against a named tolerance. Needs a GPU (skips without one unless KDTREE_REQUIRE_GPU=1).
#![cfg(feature = "cuda")]

mod cuda_common;

use std::sync::Arc;

use cuda_common::*;
use kdtree_engine::api::{LogitRows, Target};
use kdtree_engine::cuda::CudaBackend;
use kdtree_engine::generate::{generate_on, GenRequest, Mode, Sampling};
use kdtree_engine::model::source::MemSource;
use kdtree_engine::model::target::TargetModel;
use kdtree_engine::model::testing::{random_tensors, tiny_config, PREFIX};
use kdtree_engine::model::{AttnMode, CpuTarget, TensorSource, Weights};
use kdtree_formats::plan::ExpertsMode;

/// Logits of the bf16 GPU path against the f32 CPU reference, relative to max |logit|: activations are
/// rounded to bf16 at every GEMM input and the latent cache is bf16 (2^-9 relative each), over 3 layers.
/// Not yet measured when written; the measured figures are printed by this test and recorded in
/// bench/GPU-RESULTS.md.
const TARGET_LOGITS_TOL: f64 = 5.0e-2;

fn models() -> Option<(CpuTarget, TargetModel<CudaBackend>)> {
    let gpu = gpu()?;
    // tiny_config with widths the W4A16 kernel takes (N % 32, K % 128): hidden 256, moe width 128.
    let mut t = tiny_config(Some(32));
    t.hidden_size = 256;
    t.moe_intermediate_size = 128;
    t.intermediate_size = 256;
    let src: Arc<dyn TensorSource> = Arc::new(MemSource::new(t.clone(), PREFIX, &random_tensors(&t, 17), 1, ExpertsMode::Tp).unwrap());
    let cpu = CpuTarget::new(Arc::new(Weights::load(src.clone()).unwrap()), vec![1, 2], AttnMode::Absorbed).unwrap();
    let cw = Weights::load_on(CudaBackend::new(Arc::new(gpu)), src).unwrap();
    let cuda = TargetModel::new(Arc::new(cw), vec![1, 2], AttnMode::Absorbed).unwrap();
    Some((cpu, cuda))
}

fn compare(case: &str, got: &[f32], want: &[f32], tol: f64) {
    check(case, got, want, tol);
}

#[test]
fn cuda_target_matches_the_cpu_reference() {
    let Some((mut cpu, mut cuda)) = models() else { return };
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 96).collect();
    let chain: Vec<i32> = (0..prompt.len() as i32).map(|i| i - 1).collect();
    let a = cpu.forward_rows(&prompt, &chain, LogitRows::All).unwrap();
    let b = cuda.forward_rows(&prompt, &chain, LogitRows::All).unwrap();
    compare("target prefill logits (T=23)", &b.logits, &a.logits, TARGET_LOGITS_TOL);
    compare("target prefill taps (layers 1, 2)", &b.taps, &a.taps, TARGET_LOGITS_TOL);
    let path: Vec<usize> = (0..prompt.len()).collect();
    cpu.commit(&path).unwrap();
    cuda.commit(&path).unwrap();
    // A tree of 12 nodes: two roots, branches, depth 4.
    let tokens = [3u32, 9, 14, 1, 77, 50, 8, 8, 60, 2, 31, 90];
    let parents = [-1i32, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4, 7];
    let a = cpu.forward_rows(&tokens, &parents, LogitRows::All).unwrap();
    let b = cuda.forward_rows(&tokens, &parents, LogitRows::All).unwrap();
    compare("target tree verify logits (12 nodes, ancestor mask)", &b.logits, &a.logits, TARGET_LOGITS_TOL);
    cpu.commit(&[0, 1, 3, 8]).unwrap();
    cuda.commit(&[0, 1, 3, 8]).unwrap();
    assert_eq!((cpu.committed(), cuda.committed()), (27, 27));
    let a = cpu.forward_rows(&[5], &[-1], LogitRows::All).unwrap();
    let b = cuda.forward_rows(&[5], &[-1], LogitRows::All).unwrap();
    compare("target decode after a compacted path", &b.logits, &a.logits, TARGET_LOGITS_TOL);
    let last = cpu.forward_rows(&[5, 6], &[-1, 0], LogitRows::Last).unwrap();
    assert_eq!(last.logits.len(), 96, "LogitRows::Last gives one row");
    // Greedy AR: report agreement (bf16 can flip a near-tie; the logits bound above is the check).
    let req = GenRequest { prompt: prompt.clone(), max_tokens: 24, stop_token_ids: vec![], sampling: Sampling::greedy(), mode: Mode::Ar };
    let ta = generate_on(&mut cpu, None, &req, &mut |_| false).unwrap().tokens;
    let tb = generate_on(&mut cuda, None, &req, &mut |_| false).unwrap().tokens;
    let same = ta.iter().zip(&tb).take_while(|(x, y)| x == y).count();
    println!("PARITY greedy AR 24 tokens: first {same} identical (cpu {ta:?} cuda {tb:?})");
    assert!(same >= 8, "greedy AR diverged at token {same}: cpu {ta:?} cuda {tb:?}");
}
