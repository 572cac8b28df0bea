//! Rotary position embedding: interleaved (GPT-J, the DeepSeek/Kimi MLA `k_pe`/`q_pe` on the stored
//! layout, k26-format §4.4) and NeoX `rotate_half` (the Qwen3-style DFlash drafter), plus the cos/sin of
//! one position. Reference: an f64 rotation, and GPT-J == NeoX on the permuted vector (test below).
//!
//! Dimension letters: D rotated dims (cos/sin have D/2 entries).

pub use crate::backend::rope_cos_sin;

/// Interleaved (GPT-J) RoPE on one vector `x[D]` in place: pairs `(2i, 2i+1)` rotate by angle i, with
/// `cos[i], sin[i]` for i < D/2.
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    assert!(
        cos.len() == half && sin.len() == half,
        "rope_interleaved: D={} needs {half} cos/sin, got {}/{}",
        x.len(),
        cos.len(),
        sin.len()
    );
    for i in 0..half {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * cos[i] - b * sin[i];
        x[2 * i + 1] = b * cos[i] + a * sin[i];
    }
}

/// NeoX `rotate_half` RoPE on one vector `x[D]` in place: pairs `(i, i + D/2)` rotate by angle i,
/// `cos[i], sin[i]` for i < D/2 (HF `apply_rotary_pos_emb` with `cos = cat(freqs, freqs)`).
pub fn rope_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    assert!(
        cos.len() == half && sin.len() == half,
        "rope_neox: D={} needs {half} cos/sin, got {}/{}",
        x.len(),
        cos.len(),
        sin.len()
    );
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::super::yarn_inv_freq;
    use super::*;

    #[test]
    fn rope_variants_are_permutations_of_each_other() {
        // GPT-J on x equals NeoX on the permuted x' = [x0,x2,..,x1,x3,..] (k26-format §4.4), permuted back.
        let mut rng = rng(5);
        let d = 16;
        let x = rand_vec(&mut rng, d);
        let inv = yarn_inv_freq(d, 10000.0, None);
        let (c, s) = rope_cos_sin(&inv, 7, 1.0);
        let mut a = x.clone();
        rope_interleaved(&mut a, &c, &s);
        let mut p: Vec<f32> = (0..d / 2)
            .map(|i| x[2 * i])
            .chain((0..d / 2).map(|i| x[2 * i + 1]))
            .collect();
        rope_neox(&mut p, &c, &s);
        for i in 0..d / 2 {
            assert_eq!(a[2 * i], p[i]);
            assert_eq!(a[2 * i + 1], p[i + d / 2]);
        }
        // f64 rotation check.
        for i in 0..d / 2 {
            let th = 7.0 * inv[i] as f64;
            let (x0, x1) = (x[2 * i] as f64, x[2 * i + 1] as f64);
            assert!((a[2 * i] as f64 - (x0 * th.cos() - x1 * th.sin())).abs() < 1e-5);
            assert!((a[2 * i + 1] as f64 - (x1 * th.cos() + x0 * th.sin())).abs() < 1e-5);
        }
    }
}
