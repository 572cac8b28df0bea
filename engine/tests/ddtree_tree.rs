//! DDTree construction (engine/src/ddtree) against two definitions:
//! * a literal port of the reference builder (liranringel/ddtree `build_ddtree_tree`, ddtree.md §2.2),
//!   whose heap entries carry the whole rank tuple as Python does: the engine's fixed-size builder must
//!   give the same tokens, depths, parents, prefix scores and children, tie-breaks included, for budgets
//!   up to 2048 on random and on exact-tie draft log-probs;
//! * a brute-force definition: on tie-free random marginals the tree is exactly the `budget`
//!   highest-probability prefixes (ddtree.md §2.1 Prop. 2–3), numbered in non-increasing probability,
//!   with parents < children, child lists and ancestor bitmasks consistent with the parents.

use kdtree_engine::ddtree::{build_tree, build_tree_from_top_k, top_k_log_probs, walk_greedy, DraftTree, TopK};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Literal port of the heap part of `build_ddtree_tree` (liranringel/ddtree `ddtree.py` c96427a): heap
/// entries `(-logw, ranks, parent, depth, rank, logw)` ordered as Python orders tuples (floats by `==`
/// then `<`; the rank tuple lexicographically), with the same f64 score updates. The slow spec.
mod ddtree_reference {
    use kdtree_engine::ddtree::TopK;
    use std::cmp::{Ordering, Reverse};
    use std::collections::BinaryHeap;

    pub struct Tree {
        pub tokens: Vec<u32>,
        pub depths: Vec<u32>,
        pub parents: Vec<i32>,
        pub log_w: Vec<f64>,
        pub child_maps: Vec<Vec<(u32, usize)>>,
    }

    struct Entry {
        neg_logw: f64,
        ranks: Vec<u32>,
        parent: usize,
        depth: usize,
        rank: usize,
        logw: f64,
    }
    impl Ord for Entry {
        fn cmp(&self, o: &Self) -> Ordering {
            let f = |a: f64, b: f64| a.partial_cmp(&b).expect("no NaN scores here");
            f(self.neg_logw, o.neg_logw)
                .then_with(|| self.ranks.cmp(&o.ranks))
                .then(self.parent.cmp(&o.parent))
                .then(self.depth.cmp(&o.depth))
                .then(self.rank.cmp(&o.rank))
                .then(f(self.logw, o.logw))
        }
    }
    impl PartialOrd for Entry {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl PartialEq for Entry {
        fn eq(&self, o: &Self) -> bool {
            self.cmp(o) == Ordering::Equal
        }
    }
    impl Eq for Entry {}

    pub fn build(top: &TopK, budget: usize) -> Tree {
        let (topk, depth_limit) = (top.k, top.rows);
        let lp = |d: usize, r: usize| top.log_probs[d * topk + r] as f64; // [depth - 1, rank]
        let mut t = Tree {
            tokens: vec![],
            depths: vec![],
            parents: vec![-1],
            log_w: vec![],
            child_maps: vec![vec![]],
        };
        let first = lp(0, 0);
        let mut heap = BinaryHeap::new();
        heap.push(Reverse(Entry {
            neg_logw: -first,
            ranks: vec![0],
            parent: 0,
            depth: 1,
            rank: 0,
            logw: first,
        }));
        while t.tokens.len() < budget {
            let Some(Reverse(e)) = heap.pop() else { break };
            let token = top.tokens[(e.depth - 1) * topk + e.rank];
            let current = t.tokens.len() + 1;
            t.tokens.push(token);
            t.depths.push(e.depth as u32);
            t.parents.push(e.parent as i32);
            t.log_w.push(e.logw);
            t.child_maps.push(vec![]);
            t.child_maps[e.parent].push((token, current));
            if e.rank + 1 < topk {
                let mut ranks = e.ranks[..e.ranks.len() - 1].to_vec();
                ranks.push(e.rank as u32 + 1);
                let logw = e.logw - lp(e.depth - 1, e.rank) + lp(e.depth - 1, e.rank + 1);
                heap.push(Reverse(Entry {
                    neg_logw: -logw,
                    ranks,
                    parent: e.parent,
                    depth: e.depth,
                    rank: e.rank + 1,
                    logw,
                }));
            }
            if e.depth < depth_limit {
                let mut ranks = e.ranks.clone();
                ranks.push(0);
                let logw = e.logw + lp(e.depth, 0);
                heap.push(Reverse(Entry {
                    neg_logw: -logw,
                    ranks,
                    parent: current,
                    depth: e.depth + 1,
                    rank: 0,
                    logw,
                }));
            }
        }
        t
    }
}

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
            assert!(
                t.log_q[i] <= t.log_q[i - 1] + 1e-12,
                "pop order must be non-increasing in q"
            );
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
        let kids: usize = (0..n).map(|i| t.children(i).count()).sum();
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
        let want = t
            .children(i)
            .next()
            .map(|c| c.0)
            .unwrap_or_else(|| (0..vocab as u32).find(|v| t.child(i, *v).is_none()).unwrap());
        verify[i * vocab + want as usize] = 1.0;
    }
    let w = walk_greedy(&t, &verify, vocab);
    let mut cur = 0;
    for &n in &w.path[1..] {
        assert_eq!(n, t.children(cur).next().unwrap().1);
        cur = n;
    }
    assert_eq!(t.first_child[cur], -1, "walk stops only at a leaf here");
    assert_eq!(w.path.len() as u32 - 1, t.depths[cur]);
}

fn assert_same_as_reference(top: &TopK, budget: usize, what: &str) {
    let t = build_tree_from_top_k(7, top, budget);
    let r = ddtree_reference::build(top, budget);
    assert_eq!(t.drafted(), r.tokens.len(), "{what}: node count");
    assert_eq!(&t.tokens[1..], &r.tokens[..], "{what}: tokens");
    assert_eq!(&t.depths[1..], &r.depths[..], "{what}: depths");
    assert_eq!(t.parents, r.parents, "{what}: parents");
    let lq: Vec<u64> = t.log_q[1..].iter().map(|x| x.to_bits()).collect();
    assert_eq!(
        lq,
        r.log_w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "{what}: prefix scores"
    );
    for (n, kids) in r.child_maps.iter().enumerate() {
        assert_eq!(&t.children(n).collect::<Vec<_>>(), kids, "{what}: children of {n}");
    }
}

/// [rows, vocab] logits drawn from `levels` distinct values: many exact ties within and across rows.
fn tied_logits(rows: usize, vocab: usize, levels: u32, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..rows * vocab)
        .map(|_| -(rng.random_range(0..levels) as f32) * 0.5)
        .collect()
}

#[test]
fn equals_the_reference_builder_up_to_budget_2048() {
    for (seed, rows, vocab) in [(11u64, 7usize, 3000usize), (12, 15, 2100), (13, 3, 40), (14, 1, 5000)] {
        let random = random_logits(rows, vocab, seed);
        let tied = tied_logits(rows, vocab, 4, seed);
        let flat = vec![0.25f32; rows * vocab];
        for budget in [1usize, 2, 16, 64, 255, 256, 1024, 2048] {
            for (name, logits) in [("random", &random), ("tied", &tied), ("flat", &flat)] {
                let top = top_k_log_probs(logits, rows, vocab, budget.min(vocab));
                assert_same_as_reference(
                    &top,
                    budget,
                    &format!("{name} seed {seed} rows {rows} vocab {vocab} budget {budget}"),
                );
            }
        }
    }
}

#[test]
fn equals_the_reference_builder_on_handmade_tied_log_probs() {
    // Dyadic log-probs: every path sum is exact in f64, so equal real sums tie exactly and the rank
    // tuple (then parent, depth, rank) decides, deep into the tree.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for (rows, k) in [(7usize, 2048usize), (15, 300), (4, 3)] {
        for steps in [1u32, 2, 3] {
            let mut log_probs = Vec::with_capacity(rows * k);
            for _ in 0..rows {
                let mut row: Vec<f32> = (0..k)
                    .map(|_| -(rng.random_range(0..steps) as f32) * 0.25 - 1.0)
                    .collect();
                row.sort_by(|a, b| b.total_cmp(a));
                log_probs.extend(row);
            }
            let tokens = (0..rows * k).map(|i| (i % k) as u32 * 3 + 1).collect();
            let top = TopK {
                rows,
                k,
                log_probs,
                tokens,
            };
            for budget in [5usize, 100, 1000, 2048] {
                assert_same_as_reference(
                    &top,
                    budget,
                    &format!("rows {rows} k {k} steps {steps} budget {budget}"),
                );
            }
        }
    }
}
