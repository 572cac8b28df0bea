//! `y = x · W^T` with W in bf16 (the dense projections) or f32 (weights the engine derives itself).
//!
//! Reference: an f64 triple loop (test below, relative error < 1e-4); torch `x.float() @ W.float().T`.
//! Weights are widened exactly and summed in the fixed order of `matmul::dot_f32`. Tests: below.
//!
//! Dimension letters: T tokens, K input features, N output features.

use super::bf16_to_f32;
use super::matmul::matmul_by_row;
use half::bf16;

/// `y[T, N] = x[T, K] · W[N, K]^T` with W in bf16 (row-major `[N, K]`, as torch `nn.Linear.weight`),
/// f32 accumulation. Returns `[T, N]` f32.
pub fn matmul_bf16(x: &[f32], w: &[bf16], t: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(
        w.len(),
        n * k,
        "matmul_bf16: W has {} elements, expected N={n} x K={k}",
        w.len()
    );
    matmul_by_row(x, t, k, n, |row, out| {
        let wr = &w[row * k..(row + 1) * k];
        out.iter_mut().zip(wr).for_each(|(o, &v)| *o = bf16_to_f32(v));
    })
}

/// `y[T, N] = x[T, K] · W[N, K]^T` with W in f32. Same summation order as [`matmul_bf16`].
pub fn matmul_f32(x: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(
        w.len(),
        n * k,
        "matmul_f32: W has {} elements, expected N={n} x K={k}",
        w.len()
    );
    matmul_by_row(x, t, k, n, |row, out| out.copy_from_slice(&w[row * k..(row + 1) * k]))
}

#[cfg(test)]
mod tests {
    use super::super::bf16_slice_to_f32;
    use super::super::matmul::test_util::*;
    use super::*;

    #[test]
    fn matmul_bf16_matches_f64_loop() {
        let mut rng = rng(1);
        for &(t, k, n) in &[(1, 7, 3), (3, 64, 37), (5, 130, 20)] {
            let x = rand_vec(&mut rng, t * k);
            let w = rand_bf16(&mut rng, n * k);
            let y = matmul_bf16(&x, &w, t, k, n);
            let w64: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
            let err = max_rel(&y, &naive_matmul(&x, &w64, t, k, n));
            assert!(err < 1e-4, "matmul_bf16(t={t},k={k},n={n}): rel err {err}");
            let wf = bf16_slice_to_f32(&w);
            assert_eq!(
                y,
                matmul_f32(&x, &wf, t, k, n),
                "matmul_f32 must equal matmul_bf16 on widened weights"
            );
        }
    }

    #[test]
    fn matmul_identical_across_thread_counts() {
        let mut rng = rng(2);
        let (t, k, n) = (3, 96, 77);
        let x = rand_vec(&mut rng, t * k);
        let w = rand_bf16(&mut rng, n * k);
        let p1 = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let p2 = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let a = p1.install(|| matmul_bf16(&x, &w, t, k, n));
        let b = p2.install(|| matmul_bf16(&x, &w, t, k, n));
        assert_eq!(a, b);
    }
}
