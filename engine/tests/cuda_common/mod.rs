//! Shared helpers of the CUDA parity tests (engine/tests/cuda_*.rs): opening the GPU (skip only when none
//! exists; `KDTREE_REQUIRE_GPU=1` turns the skip into a failure), seeded random inputs, NaN-poisoned
//! outputs and the error report every case prints; [`timing`]: the benches' CUDA-event and graph timing;
//! [`fill`]: their random device data.
#![allow(dead_code)]

pub mod fill;
pub mod timing;

use half::bf16;
use kdtree_engine::cuda::Gpu;
use kdtree_engine::GpuOptions;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The GPU switches of the environment (`KDTREE_CUDA_GRAPHS=0`, `KDTREE_CUDA_POISON=1`, ...: the suites set
/// them; docs/design/options.md), as the tools read them.
pub fn gpu_options() -> GpuOptions {
    GpuOptions::from_env()
}

/// The GPU, or None (test skipped, reason printed) when none is usable and KDTREE_REQUIRE_GPU is not 1.
/// Models loaded onto it check every weight's device bytes against the manifest (the load check is always on
/// in the suite).
pub fn gpu() -> Option<Gpu> {
    gpu_with(gpu_options())
}

/// [`gpu`] with these switches.
pub fn gpu_with(opts: GpuOptions) -> Option<Gpu> {
    match Gpu::new(0, opts) {
        Ok(g) => {
            g.set_weight_check(kdtree_engine::backend::WeightCheck::Device);
            Some(g)
        }
        Err(e) => {
            if std::env::var("KDTREE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("KDTREE_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("SKIP (no GPU): {e}");
            None
        }
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    eprintln!("seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform in ±[lo, hi) (never zero when lo > 0), as bf16.
pub fn rand_bf16(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            let v = r.random_range(lo..hi);
            bf16::from_f32(if r.random::<bool>() { v } else { -v })
        })
        .collect()
}

/// `n` pseudo-random bytes from `seed` (splitmix64 words, 8 MiB pieces in parallel): fast enough for the
/// multi-GB buffers of the large-buffer cases.
pub fn rand_bytes(seed: u64, n: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let mut v = vec![0u8; n];
    v.par_chunks_mut(8 << 20).enumerate().for_each(|(c, piece)| {
        let mut x = seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for w in piece.chunks_mut(8) {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            w.copy_from_slice(&z.to_le_bytes()[..w.len()]);
        }
    });
    v
}

pub fn rand_f32(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

pub fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

pub fn nan_bf16(n: usize) -> Vec<bf16> {
    vec![bf16::NAN; n]
}

pub fn nan_f32(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// Error of `got` against `want`: max |got − want| and that divided by max |want| (the "rel" every case
/// reports). Any NaN in `got` fails at once.
pub struct Err {
    pub max_abs: f64,
    pub rel: f64,
    /// Index of the largest error.
    pub at: usize,
}

pub fn error(case: &str, got: &[f32], want: &[f32]) -> Err {
    assert_eq!(got.len(), want.len(), "{case}: length {} vs {}", got.len(), want.len());
    if let Some(i) = got.iter().position(|v| v.is_nan()) {
        panic!("{case}: NaN at {i} (output not fully written, or a NaN result)");
    }
    let (mut max_abs, mut at) = (0.0f64, 0usize);
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let d = (a as f64 - b as f64).abs();
        if d > max_abs {
            (max_abs, at) = (d, i);
        }
    }
    let scale = want.iter().map(|&b| (b as f64).abs()).fold(0.0, f64::max).max(1e-30);
    Err {
        max_abs,
        rel: max_abs / scale,
        at,
    }
}

/// Checks `got` against `want` with a tolerance on `rel`, printing one line per case.
pub fn check(case: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = error(case, got, want);
    eprintln!("{case}: max_abs {:.3e} rel {:.3e} (tol {:.1e})", e.max_abs, e.rel, tol);
    println!(
        "PARITY {case} max_abs={:.3e} rel={:.3e} tol={:.1e}",
        e.max_abs, e.rel, tol
    );
    assert!(
        e.rel <= tol,
        "{case}: rel error {:.3e} over tolerance {:.1e} (max_abs {:.3e} at {}: got {} want {}; first values got \
         {:?} want {:?})",
        e.rel,
        tol,
        e.max_abs,
        e.at,
        got[e.at],
        want[e.at],
        &got[..got.len().min(4)],
        &want[..want.len().min(4)]
    );
}

pub fn check_bf16(case: &str, got: &[bf16], want: &[f32], tol: f64) {
    check(case, &widen(got), want, tol);
}
