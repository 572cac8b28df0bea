//! Token choice from one row of target logits (greedy argmax, or a seeded sample after temperature,
//! top-k and top-p), and the engine's one rank order, one top-K, one argmax and one RNG. Used by the
//! autoregressive loop and by the DDTree walk (one decision per visited tree node).
//!
//! This header is the spec; the CUDA sampler / walk implements the same. Dimension letters: V = vocab.
//!
//! **Rank order** of a row: value descending, then token id ascending; `-0.0` equals `+0.0`; NaN ranks
//! after every number. As an integer: [`rank_key`] `= ord(x) << 32 | (2^32 − 1 − id)`, larger = better,
//! where `ord(NaN) = 0` and otherwise, with `b = bits(x + 0.0)` (so −0 → +0), `ord = !b` if the sign bit
//! is set, else `b | 0x8000_0000` (a u32 in value order), so a GPU can radix-select u64 keys. [`top_k`] = the first k
//! in rank order (selection, then a sort of the k only); [`argmax`] = the first. The MoE router, the draft top-K of
//! the tree builder and the sampler all use this order.
//!
//! **Uniform of a position.** The token that will sit at absolute position p (0-based, prompt included)
//! under seed s uses `u = uniform(s, p)`: Philox4x32-10 (Random123, Salmon et al. SC'11; [`philox4x32_10`])
//! with key `(s mod 2^32, s >> 32)` and counter `(p mod 2^32, p >> 32, 0, 0)`, output words x0..x3, and
//! `u = ((x1 << 32 | x0) >> 11) · 2^−53` ∈ [0, 1). Counter words 2 and 3 are 0 (reserved). u depends on
//! (s, p) alone: the AR step that emits position p and the DDTree walk decision that emits position p
//! (the decision at a node of depth d under a root at position `start` emits `start + d + 1`) use the same
//! u, so with equal logits the same token; a GPU walk can draw every node in parallel. Greedy uses no u.
//!
//! **Sampled decision** at temperature T > 0, top_k k, top_p P, uniform u (probabilities in f64):
//! 1. candidates: the non-NaN tokens (none: token 0). `x_j = f64(l_j) / f64(T)`, `m = max x_j`,
//!    `w_j = 1 if x_j == m else exp(x_j − m)` (so ±inf rows stay finite).
//! 2. top-k (0 < k < #candidates): keep the tokens with `l_j >= v_k`, v_k = the k-th value in rank order.
//!    Ties with the k-th value survive, as in transformers' `TopKLogitsWarper` (`scores < topk[-1]` removed).
//! 3. top-p (P < 1): `Z_k = Σ w_j` over the kept tokens in id order; walk the kept tokens in rank order
//!    summing `w_j / Z_k`; the first token where the sum reaches P (`>=`) is the cut c; keep the tokens
//!    ranked at or before c. This is transformers' `TopPLogitsWarper` (a token survives iff the mass ranked
//!    strictly before it is < P, at least one survives) with ties in the ranking broken by id.
//! 4. `Z = Σ w_j` over the survivors in id order; the decision is the smallest survivor id j whose
//!    id-order inclusive prefix sum of survivor weights is `> u · Z` (the last survivor if rounding leaves
//!    none).
//!
//! Nothing sorts the vocabulary: step 2 is one selection (the k-th value); step 3 sorts only the step-2
//! survivors when top-k cut, else widens a partial selection (top 32, 128, 512, … in rank order) until
//! the cut is inside it; step 4 is one pass in id order (a prefix sum on a GPU). Sums are sequential in the stated
//! order; a parallel backend summing in another order can differ only when u·Z or P lies within f64 rounding (~1e-16
//! relative) of a boundary. Tests: unit tests below; brute-force spec in engine/tests/sampling_spec.rs; AR == DDTree
//! and position-keyed draws in engine/tests/generate_loops.rs and sampling_positions.rs.

use std::cmp::Ordering;

/// Decoding parameters. `temperature <= 0` (or NaN) means greedy (top_p / top_k / seed ignored).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; values >= 1 (or NaN) disable top-p.
    pub top_p: f32,
    /// Keep the k most likely tokens (and ties with the k-th); 0 disables top-k.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl Sampling {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }
}

const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32 with 10 rounds (Random123 `philox4x32_R(10, ctr, key)`): round
/// `(hi0, lo0) = M0·c0, (hi1, lo1) = M1·c2, c = (hi1^c1^k0, lo1, hi0^c3^k1, lo0)`, key += (W0, W1)
/// before every round but the first.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W[0]), k[1].wrapping_add(PHILOX_W[1])];
        }
        let p0 = PHILOX_M[0] as u64 * c[0] as u64;
        let p1 = PHILOX_M[1] as u64 * c[2] as u64;
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The uniform in [0, 1) for the token at absolute `position` under `seed` (module header).
pub fn uniform(seed: u64, position: usize) -> f64 {
    let p = position as u64;
    let x = philox4x32_10([p as u32, (p >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
    (((x[1] as u64) << 32 | x[0] as u64) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Rank key of token `id` with value `x`: larger = earlier in rank order; distinct for distinct ids.
pub fn rank_key(x: f32, id: u32) -> u64 {
    let ord = if x.is_nan() {
        0
    } else {
        let b = (x + 0.0).to_bits(); // -0.0 + 0.0 = +0.0
        if b >> 31 == 1 {
            !b
        } else {
            b | 0x8000_0000
        }
    };
    (ord as u64) << 32 | (u32::MAX - id) as u64
}

/// Rank order of tokens `a`, `b` of `row` (Less = `a` first).
pub fn rank_cmp(row: &[f32], a: u32, b: u32) -> Ordering {
    rank_key(row[b as usize], b).cmp(&rank_key(row[a as usize], a))
}

/// Indices of the `min(k, len)` first elements of `row` in rank order, in that order. O(V + k log k).
pub fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut keys = Vec::new();
    top_k_into(row, k, &mut keys);
    keys.into_iter().map(|key| u32::MAX - key as u32).collect()
}

/// [`top_k`] into a reusable buffer of rank keys (decode the id with `u32::MAX - key as u32`, the value
/// is `row[id]`): `keys` ends as the `min(k, len)` best keys, descending. One selection over V keys
/// (measured faster than a k-entry heap scan on a 163,840-vocab row for every k), then a sort of k.
pub fn top_k_into(row: &[f32], k: usize, keys: &mut Vec<u64>) {
    assert!(
        row.len() <= u32::MAX as usize,
        "top_k: row of {} elements exceeds u32 ids",
        row.len()
    );
    keys.clear();
    let k = k.min(row.len());
    if k == 0 {
        return;
    }
    // Ascending order of !key = descending order of key.
    keys.extend(row.iter().enumerate().map(|(i, &x)| !rank_key(x, i as u32)));
    if k < keys.len() {
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    keys.sort_unstable();
    keys.iter_mut().for_each(|x| *x = !*x);
}

/// Index of the largest value (the first in rank order): the lowest index wins ties, NaN never wins
/// (an empty or all-NaN row gives 0).
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

/// `logsumexp(row)` (max-shifted, sum in f64 in index order), rounded to f32.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let s: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
    (m as f64 + s.ln()) as f32
}

/// Which tokens of a row survive steps 1–3 of the module header, and their weights.
struct Survivors<'a> {
    row: &'a [f32],
    t: f64,
    /// max over candidates of l / T (= max l / T: division by T > 0 is monotone).
    m: f64,
    /// The survivors, id ascending (None = no cut: every non-NaN token).
    kept: Option<Vec<u32>>,
}

impl Survivors<'_> {
    /// None when the row has no candidate (all NaN or empty).
    fn new<'a>(row: &'a [f32], s: &Sampling) -> Option<Survivors<'a>> {
        let t = s.temperature as f64;
        let id = |nk: u64| (u32::MAX - !nk as u32) as usize; // token of a negated rank key
        let mut keys = Vec::new();
        let mut kept = None;
        let (mut max, mut n) = (f32::NEG_INFINITY, 0usize);
        if s.top_k > 0 && s.top_k < row.len() {
            // Negated rank keys: ascending = rank order; a NaN's high word is all ones.
            keys.reserve_exact(row.len());
            keys.extend(row.iter().enumerate().map(|(i, &x)| !rank_key(x, i as u32)));
            n = keys.iter().filter(|&&nk| nk >> 32 != u32::MAX as u64).count();
            if s.top_k < n {
                let (better, kth, _) = keys.select_nth_unstable(s.top_k - 1);
                let best = better.iter().copied().min().unwrap_or(*kth);
                let v = row[id(*kth)];
                max = row[id(best)];
                kept = Some((0..row.len() as u32).filter(|&j| row[j as usize] >= v).collect());
            }
        }
        if kept.is_none() {
            (max, n) = (f32::NEG_INFINITY, 0);
            for &l in row.iter().filter(|l| !l.is_nan()) {
                max = max.max(l);
                n += 1;
            }
        }
        if n == 0 {
            return None;
        }
        let mut sv = Survivors {
            row,
            t,
            m: max as f64 / t,
            kept,
        };
        if s.top_p < 1.0 {
            if let Some(len) = sv.nucleus(s.top_p as f64, n, &mut keys) {
                let mut ids: Vec<u32> = keys[..len].iter().map(|&key| u32::MAX - key as u32).collect();
                ids.sort_unstable();
                sv.kept = Some(ids);
            }
        }
        Some(sv)
    }
    fn weight(&self, id: usize) -> f64 {
        let x = self.row[id] as f64 / self.t;
        if x == self.m {
            1.0
        } else {
            (x - self.m).exp()
        }
    }
    /// Sum of the weights of the survivors in id order.
    fn total(&self) -> f64 {
        match &self.kept {
            Some(k) => k.iter().map(|&j| self.weight(j as usize)).sum(),
            None => (0..self.row.len())
                .filter(|&j| !self.row[j].is_nan())
                .map(|j| self.weight(j))
                .sum(),
        }
    }
    /// The survivors, id ascending.
    fn ids(&self) -> Box<dyn Iterator<Item = usize> + '_> {
        match &self.kept {
            Some(k) => Box::new(k.iter().map(|&j| j as usize)),
            None => Box::new((0..self.row.len()).filter(|&j| !self.row[j].is_nan())),
        }
    }
    /// Step 3: leaves a rank-order prefix of the step-2 survivors' rank keys in `keys` and returns how
    /// many of them the nucleus keeps (through the cut token), or None when they never reach `p`.
    fn nucleus(&self, p: f64, candidates: usize, keys: &mut Vec<u64>) -> Option<usize> {
        let z = self.total();
        let walk = |ranked: &[u64]| {
            let mut cum = 0.0;
            ranked.iter().position(|&key| {
                cum += self.weight((u32::MAX - key as u32) as usize) / z;
                cum >= p
            })
        };
        if let Some(kept) = &self.kept {
            keys.clear();
            keys.extend(kept.iter().map(|&j| rank_key(self.row[j as usize], j)));
            keys.sort_unstable_by(|a, b| b.cmp(a));
            return walk(keys).map(|c| c + 1);
        }
        // No top-k: widen a partial selection in rank order until the cut is inside it.
        let mut m = 32usize;
        loop {
            top_k_into(self.row, m, keys);
            let n = keys.len().min(candidates); // NaN keys rank last: never walked
            if let Some(c) = walk(&keys[..n]) {
                return Some(c + 1);
            }
            if m >= candidates {
                return None;
            }
            m = m.saturating_mul(4);
        }
    }
}

/// The adjusted distribution a sampled decision draws from: `(token, prob)` of every surviving token with
/// nonzero probability, token id ascending, probabilities summing to 1. Greedy: the argmax with prob 1.
pub fn adjusted_distribution(row: &[f32], s: &Sampling) -> Vec<(u32, f64)> {
    if s.is_greedy() {
        return vec![(argmax(row), 1.0)];
    }
    let Some(sv) = Survivors::new(row, s) else {
        return vec![(0, 1.0)];
    };
    let kept: Vec<(u32, f64)> = sv
        .ids()
        .map(|j| (j as u32, sv.weight(j)))
        .filter(|x| x.1 > 0.0)
        .collect();
    let z: f64 = kept.iter().map(|x| x.1).sum();
    kept.into_iter().map(|(j, w)| (j, w / z)).collect()
}

/// One decision with uniform `u` (steps 1–4 of the module header); argmax when greedy.
pub fn decide(row: &[f32], s: &Sampling, u: f64) -> u32 {
    if s.is_greedy() {
        return argmax(row);
    }
    let Some(sv) = Survivors::new(row, s) else { return 0 };
    let target = u * sv.total();
    let (mut cum, mut last) = (0.0, 0u32);
    for j in sv.ids() {
        cum += sv.weight(j);
        last = j as u32;
        if cum > target {
            return last;
        }
    }
    last
}

/// The decision for the token that will sit at absolute `position`: [`decide`] with
/// `uniform(s.seed, position)` (greedy: argmax, no uniform).
pub fn sample(row: &[f32], s: &Sampling, position: usize) -> u32 {
    if s.is_greedy() {
        return argmax(row);
    }
    decide(row, s, uniform(s.seed, position))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_random123_known_answers() {
        // Random123 kat_vectors, the three "philox4x32 10" lines: counter, key -> output.
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            ([0; 4], [0; 2], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (ctr, key, want) in kat {
            assert_eq!(philox4x32_10(ctr, key), want, "ctr {ctr:08x?} key {key:08x?}");
        }
    }

    #[test]
    fn uniform_is_the_documented_function_of_seed_and_position() {
        // seed 0, position 0 is the first KAT vector: x0 = 0x6627e8d5, x1 = 0xe169c58d.
        let want = ((0xe169_c58du64 << 32 | 0x6627_e8d5) >> 11) as f64 / (1u64 << 53) as f64;
        assert_eq!(uniform(0, 0), want);
        // Key = (seed lo, seed hi), counter = (position lo, position hi, 0, 0).
        let (seed, pos) = (0x299f_31d0_a409_3822u64, 0x0000_0001_243f_6a88usize);
        let x = philox4x32_10([0x243f_6a88, 1, 0, 0], [0xa409_3822, 0x299f_31d0]);
        assert_eq!(
            uniform(seed, pos),
            (((x[1] as u64) << 32 | x[0] as u64) >> 11) as f64 / (1u64 << 53) as f64
        );
        // Range and a coarse uniformity check: 16 bins over 64k positions.
        let mut bins = [0usize; 16];
        for p in 0..65536 {
            let u = uniform(7, p);
            assert!((0.0..1.0).contains(&u));
            bins[(u * 16.0) as usize] += 1;
        }
        for b in bins {
            assert!((b as f64 - 4096.0).abs() < 4.0 * 64.0, "bins {bins:?}");
        }
        assert_ne!(uniform(7, 3), uniform(8, 3));
        assert_ne!(uniform(7, 3), uniform(7, 4));
    }

    #[test]
    fn rank_order_ties_zeros_and_nan() {
        let row = [0.5f32, 0.9, f32::NAN, 0.5, 0.9, -0.0, 0.0, f32::NEG_INFINITY];
        assert_eq!(top_k(&row, 8), vec![1, 4, 0, 3, 5, 6, 7, 2]);
        assert_eq!(top_k(&row, 3), vec![1, 4, 0]);
        assert_eq!(top_k(&row, 0), Vec::<u32>::new());
        assert_eq!(top_k(&row, 100).len(), 8);
        assert_eq!(argmax(&row), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, -1.0]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[-5.0]), 0);
        assert!(rank_key(f32::NEG_INFINITY, 0) > rank_key(f32::NAN, 0));
        assert!(rank_key(f32::INFINITY, 9) > rank_key(f32::MAX, 0));
        assert_eq!(rank_cmp(&row, 5, 6), Ordering::Less);
    }

    #[test]
    fn top_k_keeps_ties_with_the_kth_and_top_p_cuts_by_rank() {
        let row = [0.0f32, 3.0, 1.0, 2.0, 3.0, 2.0];
        let s = Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 3,
            seed: 0,
        };
        // The 3rd value is 2.0: both 2.0 tokens survive (transformers keeps ties with the k-th value).
        let d = adjusted_distribution(&row, &s);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 4, 5]);
        let s = Sampling { top_k: 2, ..s };
        let d = adjusted_distribution(&row, &s);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4]);
        assert!((d[0].1 - 0.5).abs() < 1e-12);
        // probs of [3,3,2,2,1,0] at T=1: .3222 .3222 .1185 .1185 .0436 .0160: top_p .7 reaches at rank 3
        // (token 3, the lower id of the two 2.0s).
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.7,
            top_k: 0,
            seed: 0,
        };
        let d = adjusted_distribution(&row, &s);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 4]);
        let total: f64 = d.iter().map(|x| x.1).sum();
        assert!((total - 1.0).abs() < 1e-12);
        // top_p so small that only the best token survives.
        let s = Sampling {
            temperature: 1.0,
            top_p: 1e-6,
            top_k: 0,
            seed: 0,
        };
        assert_eq!(adjusted_distribution(&row, &s), vec![(1, 1.0)]);
    }

    #[test]
    fn decide_is_the_inverse_cdf_in_id_order() {
        let row = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY, f32::NAN];
        let s = Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        };
        // Weights 1 and 3: u < 0.25 -> token 0, else token 1; -inf and NaN are never drawn.
        assert_eq!(decide(&row, &s, 0.0), 0);
        assert_eq!(decide(&row, &s, 0.2499), 0);
        assert_eq!(decide(&row, &s, 0.2501), 1);
        assert_eq!(decide(&row, &s, 0.999_999), 1);
        // Infinite logits: +inf tokens share all mass; an all -inf row is uniform.
        let inf = [1.0f32, f32::INFINITY, 2.0, f32::INFINITY];
        assert_eq!((decide(&inf, &s, 0.1), decide(&inf, &s, 0.9)), (1, 3));
        let ninf = [f32::NEG_INFINITY; 4];
        assert_eq!((decide(&ninf, &s, 0.1), decide(&ninf, &s, 0.9)), (0, 3));
        assert_eq!(decide(&[f32::NAN], &s, 0.5), 0);
    }

    #[test]
    fn sampling_follows_the_distribution_per_position() {
        let row = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let s = Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 7,
        };
        let draw = |seed| {
            (0..4000)
                .map(|p| sample(&row, &Sampling { seed, ..s.clone() }, p))
                .collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "P(1) = {ones}, expected 0.75");
        assert!(a.iter().all(|&t| t != 2));
        assert_eq!(sample(&[0.1, 0.9], &Sampling::greedy(), 5), 1);
    }
}
