//! YaRN rope scaling: inverse frequencies, the cos/sin amplitude ("attention_factor") and `get_mscale`.
//!
//! Reference: k26-format §4.4, transformers `_compute_yarn_parameters` (truncate = true). `beta_fast`,
//! `beta_slow`, `factor` and `original_max_position_embeddings` are read from the config, never assumed
//! (they differ between K2.6 and K2-Thinking). Tests below: K2.6's ramp (low 8, high 20) and K2-Thinking's.
//!
//! Dimension letters: D rope dims.

use kdtree_formats::config::RopeScaling;

/// YaRN `get_mscale(scale, mscale)`: `0.1 · mscale · ln(scale) + 1` when scale > 1, else 1.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Rotary inverse frequencies `[D/2]` for rope dim `dim` and base `theta`; with YaRN scaling a blend of
/// extrapolated `theta^(-2i/D)` and interpolated `/factor` frequencies by a linear ramp between
/// `floor(corr(beta_fast))` and `ceil(corr(beta_slow))`, `corr(r) = D ln(orig / 2πr) / (2 ln theta)`.
/// Computed in f64, rounded to f32 once.
pub fn yarn_inv_freq(dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    assert!(
        dim.is_multiple_of(2) && dim > 0,
        "yarn_inv_freq: rope dim {dim} must be even and > 0"
    );
    let half = dim / 2;
    let extra: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64))
        .collect();
    let Some(s) = scaling.filter(|s| s.kind == "yarn" || s.kind == "deepseek_yarn") else {
        return extra.iter().map(|&f| f as f32).collect();
    };
    let orig = s.original_max_position_embeddings as f64;
    let corr = |r: f64| dim as f64 * (orig / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let low = corr(s.beta_fast).floor().max(0.0);
    let mut high = corr(s.beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    (0..half)
        .map(|i| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let mask = 1.0 - ramp; // extrapolation weight
            let inter = extra[i] / s.factor;
            (inter * (1.0 - mask) + extra[i] * mask) as f32
        })
        .collect()
}

/// YaRN cos/sin amplitude ("attention_factor" in transformers):
/// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`, 1.0 without YaRN (1.0 on K2.6).
pub fn yarn_attention_factor(scaling: Option<&RopeScaling>) -> f64 {
    match scaling.filter(|s| s.kind == "yarn" || s.kind == "deepseek_yarn") {
        Some(s) => yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim),
        None => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k26_yarn(beta_fast: f64) -> RopeScaling {
        RopeScaling {
            kind: "yarn".into(),
            factor: 64.0,
            original_max_position_embeddings: 4096,
            beta_fast,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }
    }

    #[test]
    fn yarn_inv_freq_matches_k26_ramp() {
        // k26-format §4.4: K2.6 low = 8, high = 20; K2-Thinking (beta_fast 1) low = 19, high = 20.
        for (bf, low, high) in [(32.0, 8.0, 20.0), (1.0, 19.0, 20.0)] {
            let s = k26_yarn(bf);
            let inv = yarn_inv_freq(64, 50000.0, Some(&s));
            for (i, &got) in inv.iter().enumerate().take(32) {
                let extra = 50000f64.powf(-(2.0 * i as f64) / 64.0);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let want = extra / 64.0 * ramp + extra * (1.0 - ramp);
                assert!(
                    ((got as f64) - want).abs() <= want * 1e-6,
                    "beta_fast={bf} i={i}: {got} vs {want}"
                );
            }
            assert_eq!(
                inv[8] as f64,
                (50000f64.powf(-16.0 / 64.0)) as f32 as f64,
                "i=8 is pure extrapolation"
            );
        }
        assert_eq!(yarn_attention_factor(Some(&k26_yarn(32.0))), 1.0);
        assert!((yarn_get_mscale(64.0, 1.0) - 1.4158883).abs() < 1e-6);
    }
}
