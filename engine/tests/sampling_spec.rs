//! The sampler (engine/src/sampling.rs) against a slow spec that sorts the whole vocabulary the way
//! transformers' warpers do: temperature, `TopKLogitsWarper` (remove `scores < kth`, ties with the k-th
//! survive), `TopPLogitsWarper` (a token survives iff the mass ranked strictly before it is < top_p),
//! then a categorical draw by inverse CDF over the survivors in token-id order. Rows include exact ties,
//! ±0, ±inf and NaN; vocab sizes up to 5000 with flat rows so the nucleus search has to widen.
//! Also: the one top-K and argmax against a full sort.

use kdtree_engine::sampling::{adjusted_distribution, argmax, decide, top_k, Sampling};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Survivors (id ascending) and their probabilities, by full sorts.
fn spec(row: &[f32], s: &Sampling) -> Vec<(u32, f64)> {
    let t = s.temperature as f64;
    let mut c: Vec<u32> = (0..row.len() as u32).filter(|&i| !row[i as usize].is_nan()).collect();
    if c.is_empty() {
        return vec![(0, 1.0)];
    }
    let val = |i: u32| row[i as usize];
    c.sort_by(|&a, &b| val(b).partial_cmp(&val(a)).unwrap().then(a.cmp(&b)));
    if s.top_k > 0 && s.top_k < c.len() {
        let kth = val(c[s.top_k - 1]);
        c.retain(|&i| val(i) >= kth);
    }
    let m = val(c[0]) as f64 / t;
    let w = |i: u32| {
        let x = val(i) as f64 / t;
        if x == m {
            1.0
        } else {
            (x - m).exp()
        }
    };
    if s.top_p < 1.0 {
        let mut by_id = c.clone();
        by_id.sort();
        let z: f64 = by_id.iter().map(|&i| w(i)).sum(); // Z_k in id order, as specified
        let mut before = 0.0;
        let mut keep = 0;
        for &i in &c {
            if keep > 0 && before >= s.top_p as f64 {
                break;
            }
            before += w(i) / z;
            keep += 1;
        }
        c.truncate(keep);
    }
    c.sort();
    c.retain(|&i| w(i) > 0.0);
    let z: f64 = c.iter().map(|&i| w(i)).sum();
    c.into_iter().map(|i| (i, w(i) / z)).collect()
}

fn rows(rng: &mut ChaCha8Rng) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for v in [1usize, 2, 7, 64, 300] {
        out.push((0..v).map(|_| rng.random_range(-6.0f32..6.0)).collect());
        out.push((0..v).map(|_| rng.random_range(0..4) as f32 * 0.5).collect()); // exact ties
        let mut odd: Vec<f32> = (0..v).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        for (i, x) in odd.iter_mut().enumerate() {
            *x = match i % 7 {
                1 => f32::NEG_INFINITY,
                3 => f32::NAN,
                5 => -0.0,
                6 => 0.0,
                _ => *x,
            };
        }
        out.push(odd);
    }
    // Flat-ish wide rows: the nucleus of top_p 0.9 holds thousands of tokens.
    out.push((0..5000).map(|_| rng.random_range(-0.1f32..0.1)).collect());
    out.push(vec![1.5; 5000]);
    out
}

#[test]
fn survivors_and_probabilities_match_the_full_sort_spec() {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut checked = 0;
    for row in rows(&mut rng) {
        let v = row.len();
        for temperature in [0.3f32, 1.0, 2.5] {
            for top_k in [0, 1, 2, 5, 17, v.saturating_sub(1), v, v + 3] {
                for top_p in [1.0f32, 0.99, 0.9, 0.5, 0.1, 1e-9] {
                    let s = Sampling {
                        temperature,
                        top_p,
                        top_k,
                        seed: 0,
                    };
                    let got = adjusted_distribution(&row, &s);
                    let want = spec(&row, &s);
                    let what = format!("v {v} T {temperature} k {top_k} p {top_p} row {:?}", &row[..v.min(8)]);
                    assert_eq!(
                        got.iter().map(|x| x.0).collect::<Vec<_>>(),
                        want.iter().map(|x| x.0).collect::<Vec<_>>(),
                        "{what}"
                    );
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g.1 - w.1).abs() < 1e-12, "{what}: p({}) {} vs {}", g.0, g.1, w.1);
                    }
                    // Draws: inverse CDF in id order, away from the cumulative boundaries.
                    for k in 0..20 {
                        let u = (k as f64 + 0.5) / 20.0;
                        let mut cum = 0.0;
                        let pick = want.iter().find(|x| {
                            cum += x.1;
                            cum > u
                        });
                        let near = want.iter().scan(0.0, |c, x| {
                            *c += x.1;
                            Some(*c)
                        });
                        if near.into_iter().any(|c| (c - u).abs() < 1e-9) {
                            continue;
                        }
                        assert_eq!(
                            decide(&row, &s, u),
                            pick.unwrap_or(want.last().unwrap()).0,
                            "{what}: u {u}"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 2000, "{checked} cases");
}

#[test]
fn greedy_and_top_k_one_are_the_argmax() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for row in rows(&mut rng) {
        let a = argmax(&row);
        assert_eq!(decide(&row, &Sampling::greedy(), 0.7), a);
        if row.iter().any(|x| !x.is_nan()) {
            let s = Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 1,
                seed: 0,
            };
            // Ties with the best value all survive top_k = 1 (transformers); the argmax is the lowest id.
            assert_eq!(adjusted_distribution(&row, &s)[0].0, a);
        }
    }
}

#[test]
fn top_k_is_a_prefix_of_the_full_rank_sort() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for row in rows(&mut rng) {
        let mut full: Vec<u32> = (0..row.len() as u32).collect();
        let key = |i: u32| {
            let x = row[i as usize];
            (x.is_nan(), if x.is_nan() { 0.0 } else { -x }, i)
        };
        full.sort_by(|&a, &b| key(a).partial_cmp(&key(b)).unwrap());
        for k in [0, 1, 3, 32, row.len(), row.len() + 5] {
            assert_eq!(
                top_k(&row, k),
                full[..k.min(row.len())].to_vec(),
                "k {k} len {}",
                row.len()
            );
        }
        assert_eq!(argmax(&row), full[0]);
    }
}
