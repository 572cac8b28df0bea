//! SiLU, sigmoid and the SwiGLU combine `silu(gate) ⊙ up` (dense MLP, shared and routed experts, drafter
//! MLP; sigmoid is also the MoE router's scoring function). Reference: f64 formulas (test below).

/// Logistic sigmoid `1 / (1 + e^-x)` in f32.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU `x · sigmoid(x)` in f32.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// SwiGLU combine: `silu(gate) ⊙ up`, elementwise over equal-length slices.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(
        gate.len(),
        up.len(),
        "silu_mul: gate has {} elements, up {}",
        gate.len(),
        up.len()
    );
    gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_matches_f64() {
        for v in [-5.0f32, -0.5, 0.0, 2.0, 30.0] {
            let want = v as f64 / (1.0 + (-(v as f64)).exp());
            assert!((silu(v) as f64 - want).abs() < 1e-6 * (1.0 + want.abs()), "silu({v})");
        }
        assert_eq!(
            silu_mul(&[1.0, -2.0], &[3.0, 0.5]),
            vec![silu(1.0) * 3.0, silu(-2.0) * 0.5]
        );
    }
}
