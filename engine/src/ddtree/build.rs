//! Build the DDTree draft tree: top-K log-probs per depth, then a best-first heap over prefixes.
//!
//! Dimension letters: L = draft rows (depths 1..L), V = vocab, K = min(budget, V), N = nodes popped
//! (<= budget), W = ceil((N+1)/64) bitmask words.
//! Must match `build_ddtree_tree` of liranringel/ddtree `ddtree.py` (c96427a; ddtree.md §2.2):
//! * log-probs are `logit - logsumexp(row)` of the *raw* draft logits (temperature 1) in f32;
//! * candidates are keyed like the reference's heap tuple `(-logw, ranks, parent, depth, rank)`, so equal
//!   scores are broken by the smaller rank tuple (lexicographic, a prefix before its extensions), then
//!   parent, depth, rank; `logw` is accumulated in f64 from the f32 log-probs with the reference's exact
//!   update formulas (sibling: `logw - lp[d][r] + lp[d][r+1]`, child: `logw + lp[d+1][0]`). The result
//!   is a function of the inputs only, never of heap internals;
//! * top-K ties (equal logits) are ordered by token id ascending (torch.topk leaves this unspecified);
//! * nodes are numbered in pop order, root = node 0 = the bonus token, not counted in the budget.
//!
//! Visibility is stored as per-row ancestor bitmasks (bit j of row i = node j is i or an ancestor of i),
//! built by OR-copying the parent's row, which is valid because parents[i] < i.
//! Tests: below (ddtree.md §2.5 worked example) and engine/tests/ddtree_tree.rs.

use crate::sampling::log_sum_exp;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Per-depth top-K of the draft marginals.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    pub rows: usize,
    pub k: usize,
    /// [L, K] f32 log-probs, non-increasing along each row.
    pub log_probs: Vec<f32>,
    /// [L, K] token ids matching `log_probs`.
    pub tokens: Vec<u32>,
}

/// Top-K of each row of `logits` ([rows, vocab] f32): order (logit desc, token id asc).
pub fn top_k_log_probs(logits: &[f32], rows: usize, vocab: usize, k: usize) -> TopK {
    assert_eq!(logits.len(), rows * vocab, "draft logits: {} values, expected rows={rows} x vocab={vocab}", logits.len());
    let k = k.min(vocab);
    let mut log_probs = Vec::with_capacity(rows * k);
    let mut tokens = Vec::with_capacity(rows * k);
    for r in 0..rows {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let lz = log_sum_exp(row);
        let by_logit = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        let mut idx: Vec<u32> = (0..vocab as u32).collect();
        if k > 0 && k < vocab {
            idx.select_nth_unstable_by(k - 1, by_logit);
        }
        idx.truncate(k);
        idx.sort_unstable_by(by_logit);
        for &t in &idx {
            log_probs.push(row[t as usize] - lz);
            tokens.push(t);
        }
    }
    TopK { rows, k, log_probs, tokens }
}

/// Ancestor visibility as bitmasks: `bits[i * words + j / 64] >> (j % 64) & 1` = node j visible to node i.
#[derive(Debug, Clone, PartialEq)]
pub struct Visibility {
    /// Rows = nodes (N + 1).
    pub rows: usize,
    /// u64 words per row = ceil(rows / 64).
    pub words: usize,
    /// [rows, words] u64.
    pub bits: Vec<u64>,
}

impl Visibility {
    /// Build from `parents` (parents[0] = -1, parents[i] < i): row i = row(parents[i]) | {i}.
    pub fn from_parents(parents: &[i32]) -> Self {
        let rows = parents.len();
        let words = rows.div_ceil(64).max(1);
        let mut bits = vec![0u64; rows * words];
        for i in 0..rows {
            let p = parents[i];
            if p >= 0 {
                let p = p as usize;
                assert!(p < i, "parents[{i}] = {p} is not < {i}");
                let (done, cur) = bits.split_at_mut(i * words);
                cur[..words].copy_from_slice(&done[p * words..(p + 1) * words]);
            }
            bits[i * words + i / 64] |= 1u64 << (i % 64);
        }
        Visibility { rows, words, bits }
    }
    pub fn row(&self, i: usize) -> &[u64] {
        &self.bits[i * self.words..(i + 1) * self.words]
    }
    pub fn visible(&self, i: usize, j: usize) -> bool {
        (self.row(i)[j / 64] >> (j % 64)) & 1 == 1
    }
}

/// The draft tree: node 0 is the root (bonus token), nodes 1..=N in pop order.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftTree {
    /// [N+1] token per node; tokens[0] = bonus.
    pub tokens: Vec<u32>,
    /// [N+1] depth per node; depths[0] = 0. A node sits at position start + depth.
    pub depths: Vec<u32>,
    /// [N+1] parent per node; parents[0] = -1 and parents[i] < i. Exactly the `parents` of `Target::forward`.
    pub parents: Vec<i32>,
    /// [N+1] surrogate log q of each node's prefix (sum of its path's draft log-probs); 0 at the root.
    pub log_q: Vec<f64>,
    /// [N+1] children of each node as (token, child index), in pop order; tokens are distinct per node.
    pub child_maps: Vec<Vec<(u32, usize)>>,
    pub visibility: Visibility,
}

impl DraftTree {
    /// Root-only tree (budget 0 or no draft rows).
    pub fn root_only(bonus: u32) -> Self {
        let parents = vec![-1];
        DraftTree {
            tokens: vec![bonus],
            depths: vec![0],
            visibility: Visibility::from_parents(&parents),
            parents,
            log_q: vec![0.0],
            child_maps: vec![Vec::new()],
        }
    }
    /// Nodes including the root (N + 1).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Drafted nodes (N), the root excluded.
    pub fn drafted(&self) -> usize {
        self.tokens.len() - 1
    }
    pub fn child(&self, node: usize, token: u32) -> Option<usize> {
        self.child_maps[node].iter().find(|c| c.0 == token).map(|c| c.1)
    }
    /// Absolute positions of the nodes when the root sits at `start`.
    pub fn positions(&self, start: usize) -> Vec<usize> {
        self.depths.iter().map(|&d| start + d as usize).collect()
    }
}

/// A heap candidate; ordered like the reference tuple `(-logw, ranks, parent, depth, rank)`.
struct Cand {
    logw: f64,
    ranks: Vec<u32>,
    parent: usize,
    depth: usize,
    rank: usize,
}

impl Cand {
    fn key_cmp(&self, o: &Self) -> Ordering {
        (-self.logw)
            .total_cmp(&-o.logw)
            .then_with(|| self.ranks.cmp(&o.ranks))
            .then(self.parent.cmp(&o.parent))
            .then(self.depth.cmp(&o.depth))
            .then(self.rank.cmp(&o.rank))
    }
}
impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.key_cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        self.key_cmp(o)
    }
}

/// Build the tree for root `bonus` from draft logits `[rows, vocab]` (rows = depths available) and a
/// node budget (root excluded). budget 0 or rows 0 gives the root-only tree.
pub fn build_tree(bonus: u32, draft_logits: &[f32], rows: usize, vocab: usize, budget: usize) -> DraftTree {
    if budget == 0 || rows == 0 {
        return DraftTree::root_only(bonus);
    }
    let top = top_k_log_probs(draft_logits, rows, vocab, budget.min(vocab));
    build_tree_from_top_k(bonus, &top, budget)
}

/// The heap part of [`build_tree`], from precomputed top-K (exposed for golden recording and tests).
pub fn build_tree_from_top_k(bonus: u32, top: &TopK, budget: usize) -> DraftTree {
    if budget == 0 || top.rows == 0 || top.k == 0 {
        return DraftTree::root_only(bonus);
    }
    let (k, depth_limit) = (top.k, top.rows);
    let lp = |d: usize, r: usize| top.log_probs[(d - 1) * k + r] as f64; // depth d is 1-based
    let mut tree = DraftTree::root_only(bonus);
    let mut heap = BinaryHeap::new();
    heap.push(Reverse(Cand { logw: lp(1, 0), ranks: vec![0], parent: 0, depth: 1, rank: 0 }));
    while tree.drafted() < budget {
        let Some(Reverse(c)) = heap.pop() else { break };
        let token = top.tokens[(c.depth - 1) * k + c.rank];
        let n = tree.tokens.len();
        tree.tokens.push(token);
        tree.depths.push(c.depth as u32);
        tree.parents.push(c.parent as i32);
        tree.log_q.push(c.logw);
        tree.child_maps.push(Vec::new());
        tree.child_maps[c.parent].push((token, n));
        if c.rank + 1 < k {
            let mut ranks = c.ranks.clone();
            *ranks.last_mut().unwrap() = (c.rank + 1) as u32;
            let logw = c.logw - lp(c.depth, c.rank) + lp(c.depth, c.rank + 1);
            heap.push(Reverse(Cand { logw, ranks, parent: c.parent, depth: c.depth, rank: c.rank + 1 }));
        }
        if c.depth < depth_limit {
            let mut ranks = c.ranks;
            ranks.push(0);
            let logw = c.logw + lp(c.depth + 1, 0);
            heap.push(Reverse(Cand { logw, ranks, parent: n, depth: c.depth + 1, rank: 0 }));
        }
    }
    tree.visibility = Visibility::from_parents(&tree.parents);
    tree
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// ddtree.md §2.5: L = 3, B = 5, marginals q1: a .7 b .2 c .1 | q2: d .6 e .3 f .1 | q3: g .8 h .15 i .05.
    /// Tokens: a..i = 0..8 in a vocab of `v` >= 9; the other tokens of each row get logit -inf.
    pub(crate) fn worked_example_logits(v: usize) -> Vec<f32> {
        let mut logits = vec![f32::NEG_INFINITY; 3 * v];
        for (row, probs) in [[(0, 0.7f32), (1, 0.2), (2, 0.1)], [(3, 0.6), (4, 0.3), (5, 0.1)], [(6, 0.8), (7, 0.15), (8, 0.05)]]
            .iter()
            .enumerate()
        {
            for &(t, p) in probs {
                logits[row * v + t] = p.ln();
            }
        }
        logits
    }

    #[test]
    fn worked_example_of_ddtree_md_2_5() {
        let x = 100; // bonus token id
        let t = build_tree(x, &worked_example_logits(9), 3, 9, 5);
        assert_eq!(t.parents, vec![-1, 0, 1, 2, 1, 0]);
        assert_eq!(t.depths, vec![0, 1, 2, 3, 2, 1]);
        assert_eq!(t.positions(10), vec![10, 11, 12, 13, 12, 11]);
        assert_eq!(t.tokens, vec![x, 0, 3, 6, 4, 1]); // x, a, d, g, e, b
        assert_eq!(t.child_maps, vec![vec![(0, 1), (1, 5)], vec![(3, 2), (4, 4)], vec![(6, 3)], vec![], vec![], vec![]]);
        assert_eq!(t.visibility.words, 1);
        assert_eq!(t.visibility.bits, vec![0x01, 0x03, 0x07, 0x0F, 0x13, 0x21]);
        let q: Vec<f64> = t.log_q.iter().map(|l| l.exp()).collect();
        for (got, want) in q.iter().zip([1.0, 0.7, 0.42, 0.336, 0.21, 0.2]) {
            assert!((got - want).abs() < 1e-6, "prefix probs {q:?}");
        }
    }

    #[test]
    fn multi_word_bitmask_rows_copy_the_parent() {
        // A chain of 130 nodes: row i has bits 0..=i set, spread over 3 words.
        let parents: Vec<i32> = (0..130i32).map(|i| i - 1).collect();
        let v = Visibility::from_parents(&parents);
        assert_eq!(v.words, 3);
        assert_eq!(v.row(129), &[u64::MAX, u64::MAX, 0b11]);
        assert_eq!(v.row(63), &[u64::MAX, 0, 0]);
        assert_eq!(v.row(64), &[u64::MAX, 1, 0]);
        assert!(v.visible(100, 0) && v.visible(100, 100) && !v.visible(100, 101));
    }

    #[test]
    fn equal_scores_break_on_the_rank_tuple() {
        // Two depths, all logits equal: every prefix at a depth has the same score, so pops go
        // depth 1 by rank, interleaved with deeper prefixes only when their score is higher
        // (never: log q of depth 2 < depth 1). Ranks decide: (0), (1), (2), then (0,0), (0,1), ...
        let v = 3;
        let logits = vec![0.0f32; 2 * v];
        let t = build_tree(9, &logits, 2, v, 5);
        assert_eq!(t.parents, vec![-1, 0, 0, 0, 1, 1]);
        assert_eq!(t.tokens, vec![9, 0, 1, 2, 0, 1]);
    }

    #[test]
    fn budget_zero_and_k_capped_by_vocab() {
        assert_eq!(build_tree(5, &[1.0, 2.0], 1, 2, 0), DraftTree::root_only(5));
        let t = build_tree(5, &[1.0, 2.0], 1, 2, 10);
        assert_eq!(t.tokens, vec![5, 1, 0]);
        assert_eq!(t.parents, vec![-1, 0, 0]);
    }
}
