//! Build the DDTree draft tree: top-K log-probs per depth, then a best-first heap over prefixes.
//!
//! Dimension letters: L = draft rows (depths 1..L), V = vocab, K = min(budget, V), N = nodes popped
//! (<= budget), W = ceil((N+1)/64) bitmask words.
//! Must match `build_ddtree_tree` of liranringel/ddtree `ddtree.py` (c96427a; ddtree.md §2.2) exactly:
//! * log-probs are `logit - logsumexp(row)` of the *raw* draft logits (temperature 1) in f32; the top-K is
//!   the engine's rank order (`sampling::top_k`: logit desc, token id asc; torch.topk leaves ties open);
//! * candidates are ordered like the reference's heap tuple `(-logw, ranks, parent, depth, rank)`: equal
//!   scores (IEEE `==`, as Python compares floats) are broken by the smaller rank tuple (lexicographic, a
//!   prefix before its extensions), then parent, depth, rank; `logw` is accumulated in f64 from the f32
//!   log-probs with the reference's update formulas (sibling: `logw - lp[d][r] + lp[d][r+1]`, child:
//!   `logw + lp[d+1][0]`), a NaN score counting as -inf. The order is total, so the result never depends
//!   on heap internals;
//! * nodes are numbered in pop order, root = node 0 = the bonus token, not counted in the budget.
//!
//! Fixed-size state: a candidate is `(logw, parent node, depth, rank)` (no per-candidate rank Vec); its
//! rank tuple is the parent's path ranks plus its own rank, compared by walking both parent chains up to
//! the first differing depth (only on exact score ties). All buffers are sized by the budget up front.
//! Tests: below (ddtree.md §2.5 worked example) and engine/tests/ddtree_tree.rs (slow reference port).

use super::Visibility;
use crate::sampling::{log_sum_exp, top_k_into};
use rayon::prelude::*;
use std::cmp::Ordering;

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

/// Top-K of each row of `logits` ([rows, vocab] f32) in rank order, as log-probs `logit - logsumexp(row)`.
pub fn top_k_log_probs(logits: &[f32], rows: usize, vocab: usize, k: usize) -> TopK {
    assert_eq!(
        logits.len(),
        rows * vocab,
        "draft logits: {} values, expected rows={rows} x vocab={vocab}",
        logits.len()
    );
    let k = k.min(vocab);
    if rows == 0 || k == 0 {
        return TopK {
            rows,
            k,
            log_probs: Vec::new(),
            tokens: Vec::new(),
        };
    }
    // Rows are independent: one rayon task per row, each result a function of its row only.
    let per_row: Vec<(Vec<f32>, Vec<u32>)> = logits
        .par_chunks_exact(vocab)
        .map(|row| {
            let lz = log_sum_exp(row);
            let mut keys = Vec::with_capacity(vocab);
            top_k_into(row, k, &mut keys);
            keys.iter()
                .map(|&key| (u32::MAX - key as u32) as usize)
                .map(|t| (row[t] - lz, t as u32))
                .unzip()
        })
        .collect();
    let (mut log_probs, mut tokens) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
    for (lp, t) in per_row {
        log_probs.extend(lp);
        tokens.extend(t);
    }
    TopK {
        rows,
        k,
        log_probs,
        tokens,
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
    /// [N+1] first child of each node in pop order, -1 for a leaf (SGLang's `retrive_next_token`).
    pub first_child: Vec<i32>,
    /// [N+1] next sibling in pop order, -1 for the last (SGLang's `retrive_next_sibling`). A node's
    /// children carry distinct tokens.
    pub next_sibling: Vec<i32>,
    pub visibility: Visibility,
}

impl DraftTree {
    /// Root-only tree (budget 0 or no draft rows).
    pub fn root_only(bonus: u32) -> Self {
        DraftTree {
            tokens: vec![bonus],
            depths: vec![0],
            parents: vec![-1],
            log_q: vec![0.0],
            first_child: vec![-1],
            next_sibling: vec![-1],
            visibility: Visibility::root_only(),
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
    /// Children of `node` as (token, child index), in pop order.
    pub fn children(&self, node: usize) -> impl Iterator<Item = (u32, usize)> + '_ {
        let mut c = self.first_child[node];
        std::iter::from_fn(move || {
            let i = usize::try_from(c).ok()?;
            c = self.next_sibling[i];
            Some((self.tokens[i], i))
        })
    }
    /// Append a node (the builder's only mutation); `last_child` is the builder's per-node scratch.
    fn add_node(&mut self, last_child: &mut Vec<i32>, token: u32, depth: u32, parent: i32, logw: f64) {
        let n = self.tokens.len() as i32;
        self.tokens.push(token);
        self.depths.push(depth);
        self.parents.push(parent);
        self.log_q.push(logw);
        self.first_child.push(-1);
        self.next_sibling.push(-1);
        last_child.push(-1);
        if parent >= 0 {
            let p = parent as usize;
            match last_child[p] {
                -1 => self.first_child[p] = n,
                prev => self.next_sibling[prev as usize] = n,
            }
            last_child[p] = n;
        }
    }
    /// The child of `node` carrying `token`, if any.
    pub fn child(&self, node: usize, token: u32) -> Option<usize> {
        self.children(node).find(|c| c.0 == token).map(|c| c.1)
    }
}

/// A heap candidate: the prefix `path(parent) + [rank-th token at depth]`.
#[derive(Debug, Clone, Copy)]
struct Cand {
    logw: f64,
    parent: u32,
    depth: u32,
    rank: u32,
}

/// The popped nodes the ordering needs: parent and rank of every node (node 0 = root).
struct Nodes<'a> {
    parents: &'a [i32],
    ranks: &'a [u32],
}

impl Nodes<'_> {
    /// One level up from the rank-tuple element `(parent node, rank)`.
    fn up(&self, e: (usize, u32)) -> (usize, u32) {
        (self.parents[e.0] as usize, self.ranks[e.0])
    }
    /// Lexicographic order of the candidates' rank tuples (a prefix before its extensions).
    fn cmp_ranks(&self, a: &Cand, b: &Cand) -> Ordering {
        let m = a.depth.min(b.depth);
        let lift = |c: &Cand| (m..c.depth).fold((c.parent as usize, c.rank), |e, _| self.up(e));
        let (mut ea, mut eb) = (lift(a), lift(b));
        if ea == eb {
            return a.depth.cmp(&b.depth);
        }
        // Differing elements at depth m: climb to the first depth where they hang off the same node;
        // there the ranks differ and decide.
        while ea.0 != eb.0 {
            ea = self.up(ea);
            eb = self.up(eb);
        }
        ea.1.cmp(&eb.1)
    }
    /// The reference heap order `(-logw, ranks, parent, depth, rank)`; Less pops first.
    fn cmp(&self, a: &Cand, b: &Cand) -> Ordering {
        let (x, y) = (-a.logw, -b.logw);
        if x != y {
            return x.total_cmp(&y);
        }
        self.cmp_ranks(a, b)
            .then(a.parent.cmp(&b.parent))
            .then(a.depth.cmp(&b.depth))
            .then(a.rank.cmp(&b.rank))
    }
}

/// Binary min-heap of candidates under `Nodes::cmp` (std's BinaryHeap cannot see the node arrays).
/// Pop sifts the hole to the bottom, then up (as std does): about one comparison per level.
struct Heap(Vec<Cand>);

impl Heap {
    fn sift_up(&mut self, mut pos: usize, o: &Nodes) {
        let h = &mut self.0;
        let c = h[pos];
        while pos > 0 {
            let parent = (pos - 1) / 2;
            if o.cmp(&c, &h[parent]) != Ordering::Less {
                break;
            }
            h[pos] = h[parent];
            pos = parent;
        }
        h[pos] = c;
    }
    fn push(&mut self, c: Cand, o: &Nodes) {
        self.0.push(c);
        self.sift_up(self.0.len() - 1, o);
    }
    fn pop(&mut self, o: &Nodes) -> Option<Cand> {
        let last = self.0.pop()?;
        if self.0.is_empty() {
            return Some(last);
        }
        let top = std::mem::replace(&mut self.0[0], last);
        let n = self.0.len();
        let h = &mut self.0;
        let (mut pos, mut child) = (0, 1);
        while child + 1 < n {
            child += (o.cmp(&h[child + 1], &h[child]) == Ordering::Less) as usize;
            h[pos] = h[child];
            pos = child;
            child = 2 * pos + 1;
        }
        if child == n - 1 {
            h[pos] = h[child];
            pos = child;
        }
        h[pos] = last;
        self.sift_up(pos, o);
        Some(top)
    }
}

/// A candidate's score: NaN (e.g. `-inf - -inf` once a row has fewer than K finite logits, or a NaN logit)
/// counts as -inf, so the order stays total (the reference's heap order with NaN is undefined) and a device
/// builder, whose NaN bits differ from the host's, orders the same (kernels/cuda/ddtree_build.cu).
fn score(logw: f64) -> f64 {
    if logw.is_nan() {
        f64::NEG_INFINITY
    } else {
        logw
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
    // Depth d is 1-based.
    let lp = |d: u32, r: u32| top.log_probs[(d as usize - 1) * k + r as usize] as f64;
    // Sized for the usual budgets up front (no reallocation up to 4096 nodes); a larger budget grows.
    let cap = budget.min(4096) + 1;
    let mut t = DraftTree {
        tokens: Vec::with_capacity(cap),
        depths: Vec::with_capacity(cap),
        parents: Vec::with_capacity(cap),
        log_q: Vec::with_capacity(cap),
        first_child: Vec::with_capacity(cap),
        next_sibling: Vec::with_capacity(cap),
        visibility: Visibility::root_only(),
    };
    // Per node: its rank (for the tie order) and its last child so far (to append siblings in pop order).
    let (mut ranks, mut last_child) = (Vec::with_capacity(cap), Vec::with_capacity(cap));
    t.add_node(&mut last_child, bonus, 0, -1, 0.0);
    ranks.push(0);
    let mut heap = Heap(Vec::with_capacity(cap + 1));
    heap.0.push(Cand {
        logw: score(lp(1, 0)),
        parent: 0,
        depth: 1,
        rank: 0,
    });
    while t.drafted() < budget {
        let Some(c) = heap.pop(&Nodes {
            parents: &t.parents,
            ranks: &ranks,
        }) else {
            break;
        };
        let token = top.tokens[(c.depth as usize - 1) * k + c.rank as usize];
        let n = t.tokens.len() as u32;
        t.add_node(&mut last_child, token, c.depth, c.parent as i32, c.logw);
        ranks.push(c.rank);
        let o = Nodes {
            parents: &t.parents,
            ranks: &ranks,
        };
        if (c.rank as usize) + 1 < k {
            let logw = score(c.logw - lp(c.depth, c.rank) + lp(c.depth, c.rank + 1));
            heap.push(
                Cand {
                    logw,
                    rank: c.rank + 1,
                    ..c
                },
                &o,
            );
        }
        if (c.depth as usize) < depth_limit {
            let logw = score(c.logw + lp(c.depth + 1, 0));
            heap.push(
                Cand {
                    logw,
                    parent: n,
                    depth: c.depth + 1,
                    rank: 0,
                },
                &o,
            );
        }
    }
    t.visibility = Visibility::from_parents(&t.parents).expect("the builder's parents are earlier nodes");
    t
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// ddtree.md §2.5: L = 3, B = 5, marginals q1: a .7 b .2 c .1 | q2: d .6 e .3 f .1 | q3: g .8 h .15 i .05.
    /// Tokens: a..i = 0..8 in a vocab of `v` >= 9; the other tokens of each row get logit -inf.
    pub(crate) fn worked_example_logits(v: usize) -> Vec<f32> {
        let mut logits = vec![f32::NEG_INFINITY; 3 * v];
        for (row, probs) in [
            [(0, 0.7f32), (1, 0.2), (2, 0.1)],
            [(3, 0.6), (4, 0.3), (5, 0.1)],
            [(6, 0.8), (7, 0.15), (8, 0.05)],
        ]
        .iter()
        .enumerate()
        {
            for &(t, p) in probs {
                logits[row * v + t] = p.ln();
            }
        }
        logits
    }

    fn child_lists(t: &DraftTree) -> Vec<Vec<(u32, usize)>> {
        (0..t.len()).map(|n| t.children(n).collect()).collect()
    }

    #[test]
    fn worked_example_of_ddtree_md_2_5() {
        let x = 100; // bonus token id
        let t = build_tree(x, &worked_example_logits(9), 3, 9, 5);
        assert_eq!(t.parents, vec![-1, 0, 1, 2, 1, 0]);
        assert_eq!(t.depths, vec![0, 1, 2, 3, 2, 1]);
        assert_eq!(t.tokens, vec![x, 0, 3, 6, 4, 1]); // x, a, d, g, e, b
        assert_eq!(
            child_lists(&t),
            vec![
                vec![(0, 1), (1, 5)],
                vec![(3, 2), (4, 4)],
                vec![(6, 3)],
                vec![],
                vec![],
                vec![]
            ]
        );
        assert_eq!(
            (t.first_child, t.next_sibling),
            (vec![1, 2, 3, -1, -1, -1], vec![-1, 5, 4, -1, -1, -1])
        );
        assert_eq!(t.visibility.words, 1);
        assert_eq!(t.visibility.bits, vec![0x01, 0x03, 0x07, 0x0F, 0x13, 0x21]);
        let q: Vec<f64> = t.log_q.iter().map(|l| l.exp()).collect();
        for (got, want) in q.iter().zip([1.0, 0.7, 0.42, 0.336, 0.21, 0.2]) {
            assert!((got - want).abs() < 1e-6, "prefix probs {q:?}");
        }
        // Budget 9 continues in q order: a·e·g .168, b·d .12, c .1, b·d·g .096 (then a·f .07, ...).
        let t9 = build_tree(x, &worked_example_logits(9), 3, 9, 9);
        assert_eq!(&t9.parents[..6], &t.parents[..]);
        assert_eq!(t9.tokens[6..], [6, 3, 2, 6]);
        assert_eq!(t9.parents[6..], [4, 5, 0, 7]);
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
    fn rows_with_fewer_finite_logits_than_k_keep_a_total_order() {
        // K = 8 > the 3 finite logits per row: siblings past them score -inf - -inf = NaN, which counts as
        // -inf (build.rs `score`), so scores never rise in pop order and equal -inf scores pop in rank-tuple
        // order: first the extensions (0, 3), (0, 4), … of the best depth-1 prefix (0) = node 1.
        let v = 8;
        let mut logits = vec![f32::NEG_INFINITY; 2 * v];
        for (i, x) in [
            (0, 0.0f32),
            (3, -0.5),
            (5, -1.0),
            (v + 1, 0.0),
            (v + 2, -2.0),
            (v + 6, -0.25),
        ] {
            logits[i] = x;
        }
        let t = build_tree(9, &logits, 2, v, 40);
        assert!(t.log_q.iter().all(|x| !x.is_nan()), "{:?}", t.log_q);
        assert!(
            t.log_q[1..].windows(2).all(|w| w[0] >= w[1]),
            "scores rise in pop order: {:?}",
            t.log_q
        );
        let finite = t.log_q.iter().filter(|x| x.is_finite()).count();
        assert_eq!(finite, 1 + 3 + 9, "root, 3 depth-1 and 3x3 depth-2 prefixes");
        assert_eq!((t.depths[finite], t.depths[finite + 1]), (2, 2));
        assert_eq!((t.parents[finite], t.parents[finite + 1]), (1, 1));
        assert_eq!(t.len(), 41);
    }

    #[test]
    fn budget_zero_and_k_capped_by_vocab() {
        assert_eq!(build_tree(5, &[1.0, 2.0], 1, 2, 0), DraftTree::root_only(5));
        let t = build_tree(5, &[1.0, 2.0], 1, 2, 10);
        assert_eq!(t.tokens, vec![5, 1, 0]);
        assert_eq!(t.parents, vec![-1, 0, 0]);
        assert_eq!(t.child(0, 0), Some(2));
        assert_eq!(t.child(0, 7), None);
    }
}
