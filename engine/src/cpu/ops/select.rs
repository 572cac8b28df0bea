//! The engine's argmax and top-K, in one place: every model-side caller (router, tests, tools) goes
//! through `cpu::ops::{argmax, topk}` so the one implementation can be switched here.
//!
//! argmax is `sampling::argmax` (the one argmax of the crate: lowest index wins ties, NaN never wins).
//! topk is the stable sort below until the allocation-free top-K of ddtree/sampling lands; it must keep
//! the same tie rule (lowest index first among equal values, NaN last). Tests below.

pub use crate::sampling::argmax;

/// Indices of the `k` largest elements, largest first. Tie rule: among equal values the **lowest index**
/// comes first (a stable sort by descending value). NaN sorts last. Panics if `k > x.len()`.
pub fn topk(x: &[f32], k: usize) -> Vec<usize> {
    assert!(k <= x.len(), "topk: k={k} exceeds length {}", x.len());
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| {
        let (va, vb) = (x[a], x[b]);
        match (va.is_nan(), vb.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => vb.partial_cmp(&va).unwrap(),
        }
    });
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_and_topk_tie_rules() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
        assert_eq!(topk(&[0.5, 0.9, 0.5, 0.9, 0.1], 3), vec![1, 3, 0]);
        assert_eq!(topk(&[f32::NAN, 0.2, 0.3], 2), vec![2, 1]);
    }
}
