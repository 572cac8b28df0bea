//! DDTree construction (engine/src/ddtree) against a brute-force definition: on tie-free random
//! marginals the tree must be exactly the `budget` highest-probability prefixes (ddtree.md §2.1 Prop. 2–3),
//! numbered in non-increasing probability (pop order), with parents < children, child maps and ancestor
//! bitmasks consistent with the parents; budgets cover 1..=200 (multi-word bitmasks).

use kdtree_engine::ddtree::{build_tree, top_k_log_probs, walk_greedy, DraftTree};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_logits(rows: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..rows * vocab).map(|_| rng.random_range(-4.0f32..4.0)).collect()
}

/// All prefixes (as token paths) of depth <= rows over the top-K of each row, sorted by log q desc.
fn brute_force(logits: &[f32], rows: usize, vocab: usize, budget: usize) -> Vec<(Vec<u32>, f64)> {
    let top = top_k_log_probs(logits, rows, vocab, budget.min(vocab));
    let k = top.k;
    let mut all: Vec<(Vec<u32>, f64)> = Vec::new();
    let mut frontier: Vec<(Vec<u32>, f64)> = vec![(vec![], 0.0)];
    for d in 0..rows {
        let mut next = Vec::new();
        for (p, s) in &frontier {
            for r in 0..k {
                let mut q = p.clone();
                q.push(top.tokens[d * k + r]);
                next.push((q, s + top.log_probs[d * k + r] as f64));
            }
        }
        // Only prefixes that can be in the top `budget` need extending (children score lower).
        next.sort_by(|a, b| b.1.total_cmp(&a.1));
        next.truncate(budget);
        all.extend(next.iter().cloned());
        frontier = next;
    }
    all.sort_by(|a, b| b.1.total_cmp(&a.1));
    all.truncate(budget);
    all
}

fn path_of(t: &DraftTree, mut n: usize) -> Vec<u32> {
    let mut p = Vec::new();
    while n != 0 {
        p.push(t.tokens[n]);
        n = t.parents[n] as usize;
    }
    p.reverse();
    p
}

#[test]
fn tree_is_the_top_budget_prefixes_in_pop_order() {
    for (seed, rows, vocab) in [(1, 3, 5), (2, 7, 30), (3, 15, 64), (4, 7, 500)] {
        let logits = random_logits(rows, vocab, seed);
        for budget in [1, 2, 3, 8, 31, 64, 65, 200] {
            let t = build_tree(vocab as u32, &logits, rows, vocab, budget);
            let want = brute_force(&logits, rows, vocab, budget);
            assert_eq!(t.drafted(), want.len().min(budget), "seed {seed} budget {budget}");
            for (n, (path, lq)) in want.iter().enumerate() {
                assert_eq!(&path_of(&t, n + 1), path, "seed {seed} budget {budget} node {}", n + 1);
                assert!((t.log_q[n + 1] - lq).abs() < 1e-9);
                assert_eq!(t.depths[n + 1] as usize, path.len());
            }
        }
    }
}

#[test]
fn tree_arrays_are_consistent() {
    let (rows, vocab) = (7, 50);
    let logits = random_logits(rows, vocab, 9);
    for budget in [0, 1, 5, 63, 64, 127, 128, 300] {
        let t = build_tree(3, &logits, rows, vocab, budget);
        let n = t.len();
        assert_eq!(t.tokens[0], 3);
        assert_eq!((t.parents[0], t.depths[0]), (-1, 0));
        assert_eq!(t.visibility.words, n.div_ceil(64));
        for i in 1..n {
            let p = t.parents[i] as usize;
            assert!(p < i);
            assert_eq!(t.depths[i], t.depths[p] + 1);
            assert!(t.log_q[i] <= t.log_q[i - 1] + 1e-12, "pop order must be non-increasing in q");
            assert_eq!(t.child(p, t.tokens[i]), Some(i));
            for j in 0..n {
                let mut a = i;
                let mut anc = a == j;
                while a != 0 && !anc {
                    a = t.parents[a] as usize;
                    anc = a == j;
                }
                assert_eq!(t.visibility.visible(i, j), anc, "budget {budget} row {i} col {j}");
            }
        }
        let kids: usize = t.child_maps.iter().map(|c| c.len()).sum();
        assert_eq!(kids, n - 1);
        assert!(t.visibility.visible(0, 0));
    }
}

#[test]
fn greedy_walk_follows_argmax_children() {
    let (rows, vocab) = (4, 12);
    let logits = random_logits(rows, vocab, 5);
    let t = build_tree(0, &logits, rows, vocab, 20);
    // Target that agrees with the tree's first path node-by-node: argmax at node i = the token of its
    // lowest-numbered child, and something absent at leaves.
    let mut verify = vec![0f32; t.len() * vocab];
    for i in 0..t.len() {
        let want = t.child_maps[i].first().map(|c| c.0).unwrap_or_else(|| {
            (0..vocab as u32).find(|v| t.child(i, *v).is_none()).unwrap()
        });
        verify[i * vocab + want as usize] = 1.0;
    }
    let w = walk_greedy(&t, &verify, vocab);
    let mut cur = 0;
    for &n in &w.path[1..] {
        assert_eq!(n, t.child_maps[cur][0].1);
        cur = n;
    }
    assert!(t.child_maps[cur].is_empty(), "walk stops only at a leaf here");
    assert_eq!(w.path.len() as u32 - 1, t.depths[cur]);
}
