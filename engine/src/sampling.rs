//! Token choice from one row of target logits: greedy argmax, or a seeded sample after temperature,
//! top-k and top-p. Used by the autoregressive loop and by the DDTree walk (one decision per visited
//! tree node), so both loops draw from the same stream the same way.
//!
//! Must match: greedy = `argmax` with the lowest index winning ties (torch.argmax on CPU does the same for
//! finite rows); sampled = a categorical draw from `softmax(logits / T)` restricted to the top-k, then to
//! the smallest top-p nucleus (transformers' `TopKLogitsWarper` then `TopPLogitsWarper` semantics, except
//! that ties at the cut are broken by token id, not by sort stability).
//! Determinism: candidates are ordered by (logit desc, token id asc), probabilities are computed in f64 in
//! that order, and every sampled decision consumes exactly one `f64` from the RNG (even when only one
//! candidate survives), so a seed fixes the whole output. Greedy decisions consume nothing.
//! Tests: unit tests below; end-to-end reproducibility in engine/tests/generate_loops.rs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// The RNG of one generation: ChaCha20 seeded with `Sampling::seed` via `seed_from_u64`.
pub type GenRng = ChaCha20Rng;

/// Decoding parameters. `temperature <= 0` means greedy (top_p / top_k / seed ignored).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; values >= 1 disable top-p.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables top-k.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0 }
    }
}

impl Sampling {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }
    pub fn rng(&self) -> GenRng {
        GenRng::seed_from_u64(self.seed)
    }
}

/// Index of the largest value; the lowest index wins ties; NaN never wins (an all-NaN row gives 0).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut seen = false;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !seen || v > best_v {
            best = i;
            best_v = v;
            seen = true;
        }
    }
    best as u32
}

/// `log_softmax(row)` in f32 with the normaliser accumulated in f64 in index order.
pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let lz = log_sum_exp(row);
    row.iter().map(|&x| x - lz).collect()
}

/// `logsumexp(row)` (max-shifted, sum in f64 in index order), rounded to f32.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let s: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
    (m as f64 + s.ln()) as f32
}

/// The adjusted distribution a sampled decision draws from: `(token, prob)` in draw order
/// (logit desc, token asc), probabilities summing to 1. For greedy settings it is the argmax with prob 1.
pub fn adjusted_distribution(row: &[f32], s: &Sampling) -> Vec<(u32, f64)> {
    if s.is_greedy() {
        return vec![(argmax(row), 1.0)];
    }
    let mut idx: Vec<u32> = (0..row.len() as u32).filter(|&i| !row[i as usize].is_nan()).collect();
    let by_logit = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if s.top_k > 0 && s.top_k < idx.len() {
        idx.select_nth_unstable_by(s.top_k - 1, by_logit);
        idx.truncate(s.top_k);
    }
    idx.sort_unstable_by(by_logit);
    if idx.is_empty() {
        return vec![(0, 1.0)];
    }
    let t = s.temperature as f64;
    let m = row[idx[0] as usize] as f64 / t;
    let mut probs: Vec<f64> = idx.iter().map(|&i| (row[i as usize] as f64 / t - m).exp()).collect();
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= z);
    let mut keep = probs.len();
    if s.top_p < 1.0 {
        // Smallest prefix whose mass reaches top_p (at least one token).
        let mut cum = 0.0;
        for (k, p) in probs.iter().enumerate() {
            cum += p;
            if cum >= s.top_p as f64 {
                keep = k + 1;
                break;
            }
        }
    }
    let z: f64 = probs[..keep].iter().sum();
    idx.into_iter().zip(probs).take(keep).map(|(i, p)| (i, p / z)).collect()
}

/// One decision: argmax when greedy (no RNG use), else one draw `u ~ U[0,1)` mapped through the
/// cumulative adjusted distribution in draw order.
pub fn sample(row: &[f32], s: &Sampling, rng: &mut GenRng) -> u32 {
    if s.is_greedy() {
        return argmax(row);
    }
    let dist = adjusted_distribution(row, s);
    let u: f64 = rng.random();
    let mut cum = 0.0;
    for &(tok, p) in &dist {
        cum += p;
        if u < cum {
            return tok;
        }
    }
    dist.last().map(|d| d.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_lowest_index_wins_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, -1.0]), 1);
        assert_eq!(argmax(&[-5.0]), 0);
    }

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let s: f32 = lp.iter().map(|x| x.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6, "sum {s}");
        assert!((lp[2] - lp[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_and_top_p_cut_the_candidates() {
        let row = [0.0f32, 3.0, 1.0, 2.0, 3.0];
        let s = Sampling { temperature: 1.0, top_p: 1.0, top_k: 2, seed: 0 };
        let d = adjusted_distribution(&row, &s);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4]);
        assert!((d[0].1 - 0.5).abs() < 1e-12);
        // probs of [3,3,2,1,0] at T=1: .3995, .3995, .1470, .0541, .0198 -> top_p .8 keeps 3 tokens.
        let s = Sampling { temperature: 1.0, top_p: 0.8, top_k: 0, seed: 0 };
        let d = adjusted_distribution(&row, &s);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4, 3]);
        let total: f64 = d.iter().map(|x| x.1).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_distribution() {
        let row = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let s = Sampling { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 7 };
        let draw = |seed| {
            let mut rng = Sampling { seed, ..s.clone() }.rng();
            (0..4000).map(|_| sample(&row, &s, &mut rng)).collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "P(1) = {ones}, expected 0.75");
        assert!(a.iter().all(|&t| t != 2));
    }

    #[test]
    fn greedy_consumes_no_randomness() {
        let mut rng = Sampling::greedy().rng();
        let mut fresh = Sampling::greedy().rng();
        assert_eq!(sample(&[0.1, 0.9], &Sampling::greedy(), &mut rng), 1);
        assert_eq!(rng.random::<u64>(), fresh.random::<u64>());
    }
}
