//! Residual add and the fixed-order sum of rank partials (the CPU all-reduce).
//!
//! `acc[i] += x[i]` elementwise in f32. Summing tensor-parallel partials with it rank 0, 1, ..., R−1 is
//! the reduction order the CPU reference fixes (an NCCL all-reduce would pick its own; CUDA documents
//! its tolerance against this). Tests below.

/// `acc += x`, elementwise.
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    assert_eq!(
        acc.len(),
        x.len(),
        "add_assign: acc has {} elements, x {}",
        acc.len(),
        x.len()
    );
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// Sum of rank partials, each `[n]`, added to zeros in rank order: `((0 + p0) + p1) + ...`.
pub fn all_reduce_sum(partials: &[Vec<f32>], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    for p in partials {
        add_assign(&mut out, p);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_sums_in_rank_order() {
        // 1e8 + 1 − 1e8 in f32 depends on the order: rank order gives (0 + 1e8 + 1) − 1e8 = 0.
        let parts = vec![vec![1e8f32, 1.0], vec![1.0, 2.0], vec![-1e8, 3.0]];
        assert_eq!(all_reduce_sum(&parts, 2), vec![0.0, 6.0]);
        let mut a = vec![1.0f32, 2.0];
        add_assign(&mut a, &[0.5, -2.0]);
        assert_eq!(a, vec![1.5, 0.0]);
    }
}
