//! RMSNorm over rows, as HF `DeepseekV3RMSNorm` / Qwen3 `RMSNorm` (k26-format §4.2).
//!
//! `y = weight * (x * rsqrt(mean(x²) + eps))`, all in f32. HF casts the normalised value back to the input
//! dtype before the weight multiply; activations here are f32, so that cast is the identity (no bf16
//! rounding is emulated). The mean of squares is accumulated in f32, sequentially.
//! Reference: an f64 loop (test below, relative error < 1e-5).
//!
//! Dimension letters: T rows, H normalised width.

use super::bf16_to_f32;
use half::bf16;

/// RMSNorm of every `[H]` row of `x` `[T, H]` with a bf16 weight `[H]`. Returns `[T, H]` f32.
pub fn rms_norm(x: &[f32], weight: &[bf16], eps: f32) -> Vec<f32> {
    let h = weight.len();
    assert!(
        h > 0 && x.len().is_multiple_of(h),
        "rms_norm: x has {} elements, not a multiple of H={h}",
        x.len()
    );
    let mut y = vec![0f32; x.len()]; // [T, H] f32
    for (xr, yr) in x.chunks(h).zip(y.chunks_mut(h)) {
        let ms = xr.iter().fold(0f32, |a, &v| a + v * v) / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..h {
            yr[i] = bf16_to_f32(weight[i]) * (xr[i] * r);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::*;

    #[test]
    fn rms_norm_matches_f64() {
        let mut rng = rng(4);
        let (t, h) = (3, 50);
        let x = rand_vec(&mut rng, t * h);
        let w = rand_bf16(&mut rng, h);
        let y = rms_norm(&x, &w, 1e-5);
        let mut want = vec![0f64; t * h];
        for ti in 0..t {
            let ms: f64 = (0..h).map(|i| (x[ti * h + i] as f64).powi(2)).sum::<f64>() / h as f64;
            for i in 0..h {
                want[ti * h + i] = w[i].to_f64() * x[ti * h + i] as f64 / (ms + 1e-5).sqrt();
            }
        }
        let err = max_rel(&y, &want);
        assert!(err < 1e-5, "rms_norm rel err {err}");
    }
}
