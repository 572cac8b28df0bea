//! Numerically stable softmax of one row in place (attention scores of MLA and the drafter).
//!
//! `exp(x − max) / Σ`, f32, sum accumulated sequentially; `-inf` entries get probability 0; an all-`-inf`
//! row is left as all zeros. Reference: f64 softmax (test below, 1e-6).

/// Softmax of `x` in place.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if m == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_f64() {
        let mut x = vec![1.0f32, -2.0, 3.5, f32::NEG_INFINITY, 0.25];
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        softmax(&mut x);
        let z: f64 = x64.iter().map(|v| v.exp()).sum();
        for i in 0..x.len() {
            assert!((x[i] as f64 - x64[i].exp() / z).abs() < 1e-6, "softmax[{i}]");
        }
        let mut all_masked = vec![f32::NEG_INFINITY; 3];
        softmax(&mut all_masked);
        assert_eq!(all_masked, vec![0.0; 3]);
    }
}
