//! The shared matmul driver and the one dot product every CPU matmul uses (matmul_bf16, matmul_f32,
//! matmul_i4g32 differ only in how a weight row is widened to f32).
//!
//! Determinism: every output element is produced by exactly one sequential loop with a fixed order of
//! additions ([`dot_f32`]); rayon only decides *which thread* runs that loop, so results are bit-identical
//! for any thread count. Tests: the matmul_* files' tests (f64 loop, thread counts).
//!
//! Dimension letters: T tokens (rows of x), K input features, N output features.

use rayon::prelude::*;

/// Output rows per rayon task in the matmuls (a scheduling knob only; results do not depend on it).
const ROWS_PER_TASK: usize = 16;

/// The one dot product every matmul here uses: 4 interleaved f32 partial sums over k (lane = k % 4),
/// combined as `(s0 + s1) + (s2 + s3)`. Fixed order, so the result never depends on threading.
#[inline]
pub(crate) fn dot_f32(x: &[f32], w: impl Fn(usize) -> f32, k: usize) -> f32 {
    let mut s = [0f32; 4];
    let full = k / 4 * 4;
    let mut i = 0;
    while i < full {
        s[0] += x[i] * w(i);
        s[1] += x[i + 1] * w(i + 1);
        s[2] += x[i + 2] * w(i + 2);
        s[3] += x[i + 3] * w(i + 3);
        i += 4;
    }
    while i < k {
        s[i % 4] += x[i] * w(i);
        i += 1;
    }
    (s[0] + s[1]) + (s[2] + s[3])
}

/// Shared driver: `y[t, n] = x[t, :] · row_n` for all t < T, n < N, parallel over n; `fill_row(n, out)`
/// writes weight row n (`[K]` f32) into `out`.
pub(crate) fn matmul_by_row(
    x: &[f32],
    t: usize,
    k: usize,
    n: usize,
    fill_row: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    assert_eq!(
        x.len(),
        t * k,
        "matmul: x has {} elements, expected T={t} x K={k}",
        x.len()
    );
    // [N, T] f32: computed column-of-y-at-a-time so decode (T = 1) still spreads over threads. Each weight
    // row is widened to f32 once per task and reused for all T inputs; the widening is exact, so the sums
    // are the same whatever T is.
    let mut yt = vec![0f32; n * t];
    yt.par_chunks_mut(t.max(1) * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut wrow = vec![0f32; k]; // [K] f32, one weight row
            for (j, col) in chunk.chunks_mut(t.max(1)).enumerate() {
                let row = c * ROWS_PER_TASK + j;
                fill_row(row, &mut wrow);
                for (ti, out) in col.iter_mut().enumerate() {
                    *out = dot_f32(&x[ti * k..(ti + 1) * k], |i| wrow[i], k);
                }
            }
        });
    // [T, N] f32
    let mut y = vec![0f32; t * n];
    for row in 0..n {
        for ti in 0..t {
            y[ti * n + row] = yt[row * t + ti];
        }
    }
    y
}

#[cfg(test)]
pub(crate) mod test_util {
    use half::bf16;
    use rand::{Rng, SeedableRng};
    pub use rand_chacha::ChaCha8Rng;

    pub fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }
    pub fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }
    pub fn rand_bf16(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0))).collect()
    }
    /// Max |a − b| / (|b| + 1e-3) over all elements.
    pub fn max_rel(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y).abs() / (y.abs() + 1e-3))
            .fold(0.0, f64::max)
    }
    /// `y[T, N] = x[T, K] · W[N, K]^T` in f64.
    pub fn naive_matmul(x: &[f32], w: &[f64], t: usize, k: usize, n: usize) -> Vec<f64> {
        let mut y = vec![0f64; t * n];
        for ti in 0..t {
            for r in 0..n {
                for c in 0..k {
                    y[ti * n + r] += x[ti * k + c] as f64 * w[r * k + c];
                }
            }
        }
        y
    }
}
