//! Seeded fills of dummy weights (`--load-format dummy`, vLLM's convention): element i of a tensor is a
//! pure function of (seed, i), so a GPU fills its buffers in place, in any order, and equals this CPU twin
//! bit for bit. CUDA twin: kernels/cuda/fill.cu (wrapper engine/src/cuda/ops/fill.rs). Test:
//! engine/tests/dummy_load.rs (determinism, seeds, ranges), engine/tests/cuda_target.rs (CUDA == CPU).
//!
//! **Word stream.** 32-bit word j of seed s is word `j % 4` of `philox4x32_10(counter = (c lo, c hi, 0, 0),
//! key = (s lo, s hi))` with `c = j / 4` (sampling::philox4x32_10, the engine's one RNG).
//! **Uniform** (bf16 / f32 tensors): element i takes word i; `m = (word >> 8) − 2^23` ∈ [−2^23, 2^23) and
//! `x = center + m · step` with `step = half · 2^−23` (f32, each operation rounded once, no fused
//! multiply-add), then rounded to nearest even for bf16: U(center − half, center + half) on a 2^24 grid.
//! **Bytes** (INT4 nibble stacks): byte i is byte `i % 4` (little end first) of word `i / 4`, so both
//! nibbles of every byte are uniform over 0..15 (q + 8 stored: q uniform over −8..7).

pub use crate::backend::Fill;
use half::bf16;
use rayon::prelude::*;

/// Word `j` of the stream of `seed` (module header).
#[inline]
pub fn fill_word(seed: u64, j: u64) -> u32 {
    let c = j / 4;
    let x = crate::sampling::philox4x32_10([c as u32, (c >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
    x[(j % 4) as usize]
}

/// The uniform value of element `i` in f32 (module header).
#[inline]
pub fn fill_uniform_f32(seed: u64, i: u64, center: f32, step: f32) -> f32 {
    let m = (fill_word(seed, i) >> 8) as i32 - (1 << 23);
    center + m as f32 * step
}

fn uniform_of(what: &str, f: &Fill) -> anyhow::Result<(u64, f32, f32)> {
    match (f, f.center_step()) {
        (Fill::Uniform { seed, .. }, Some((c, s))) => Ok((*seed, c, s)),
        _ => anyhow::bail!("fill: a byte fill asked for a {what} tensor"),
    }
}

/// `n` bf16 values of a uniform fill.
pub fn fill_bf16(n: usize, f: &Fill) -> anyhow::Result<Vec<bf16>> {
    let (seed, c, s) = uniform_of("bf16", f)?;
    Ok((0..n as u64)
        .into_par_iter()
        .map(|i| bf16::from_f32(fill_uniform_f32(seed, i, c, s)))
        .collect())
}

/// `n` f32 values of a uniform fill.
pub fn fill_f32(n: usize, f: &Fill) -> anyhow::Result<Vec<f32>> {
    let (seed, c, s) = uniform_of("f32", f)?;
    Ok((0..n as u64)
        .into_par_iter()
        .map(|i| fill_uniform_f32(seed, i, c, s))
        .collect())
}

/// `n` bytes of a byte fill.
pub fn fill_u8(n: usize, f: &Fill) -> anyhow::Result<Vec<u8>> {
    let Fill::Bytes { seed } = *f else {
        anyhow::bail!("fill: a uniform fill asked for a u8 tensor")
    };
    Ok((0..n as u64)
        .into_par_iter()
        .map(|i| (fill_word(seed, i / 4) >> (8 * (i % 4))) as u8)
        .collect())
}
