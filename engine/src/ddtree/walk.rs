//! The verification walk over a draft tree given the target's logits at every node.
//!
//! Must match `follow_verified_tree` of liranringel/ddtree `ddtree.py` (ddtree.md §3.1–3.3): start at the
//! root; at the current node take the target's decision; if a child carries that token move to it and
//! repeat, else stop. The decision at the last accepted node is the bonus (next root).
//! Greedy decision = argmax (lowest index on ties). Sampled decision (T > 0) = one draw from the target's
//! adjusted distribution (sampling.rs) at each *visited* node with the uniform of the position the decided
//! token will occupy: a node at depth d under a root at position `start` decides position `start + d + 1`
//! (sampling.rs header). The reference samples every node up front with independent draws; here the draw
//! of a node is a function of (seed, position) alone, so the walk has the same law, every node could be
//! drawn in parallel (nodes of equal depth share a uniform, but only one of them is on the walked path),
//! and the token at position p is decided exactly as the autoregressive loop decides it. So a seed gives
//! the same tokens in both modes whenever node logits equal chain logits.
//! Tests: below, and engine/tests/generate_loops.rs (DDTree == AR).

use super::DraftTree;
use crate::sampling::{argmax, sample, Sampling};

/// Result of one walk.
#[derive(Debug, Clone, PartialEq)]
pub struct Walk {
    /// Accepted nodes, a root-to-node path starting with 0 (the argument of `Target::commit`).
    pub path: Vec<usize>,
    /// The target's decision at each path node: `decisions[i]` chose `tokens[path[i+1]]` for i < last,
    /// and the last entry is the bonus.
    pub decisions: Vec<u32>,
}

impl Walk {
    /// Next root token: the decision at the deepest accepted node.
    pub fn bonus(&self) -> u32 {
        *self.decisions.last().expect("a walk visits at least the root")
    }
    /// Drafted nodes accepted (path length minus the root).
    pub fn accepted(&self) -> usize {
        self.path.len() - 1
    }
}

/// Walk with an arbitrary per-node decision rule, called once per visited node in visit order.
pub fn walk(tree: &DraftTree, mut decide: impl FnMut(usize) -> u32) -> Walk {
    let mut path = vec![0usize];
    let mut decisions = Vec::new();
    let mut cur = 0usize;
    loop {
        let d = decide(cur);
        decisions.push(d);
        match tree.child(cur, d) {
            Some(c) => {
                path.push(c);
                cur = c;
            }
            None => return Walk { path, decisions },
        }
    }
}

/// Greedy walk; `logits` is [N+1, vocab] f32 in node order.
pub fn walk_greedy(tree: &DraftTree, logits: &[f32], vocab: usize) -> Walk {
    assert_eq!(
        logits.len(),
        tree.len() * vocab,
        "verify logits: {} values, expected {} nodes x {vocab}",
        logits.len(),
        tree.len()
    );
    walk(tree, |n| argmax(&logits[n * vocab..(n + 1) * vocab]))
}

/// Sample-and-walk at `s` for a tree whose root sits at position `start` (greedy when
/// `s.temperature <= 0`).
pub fn walk_sampled(tree: &DraftTree, logits: &[f32], vocab: usize, s: &Sampling, start: usize) -> Walk {
    assert_eq!(
        logits.len(),
        tree.len() * vocab,
        "verify logits: {} values, expected {} nodes x {vocab}",
        logits.len(),
        tree.len()
    );
    walk(tree, |n| {
        sample(
            &logits[n * vocab..(n + 1) * vocab],
            s,
            start + tree.depths[n] as usize + 1,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddtree::build_tree;

    fn one_hot(v: usize, t: u32) -> Vec<f32> {
        let mut r = vec![0.0; v];
        r[t as usize] = 1.0;
        r
    }

    #[test]
    fn worked_example_greedy_walk() {
        // ddtree.md §2.5: argmax at root = a (0), at node 1 = e (4), at node 4 = x (50) -> path [0,1,4].
        let v = 64;
        let tree = build_tree(100, &crate::ddtree::build::tests::worked_example_logits(v), 3, v, 5);
        let targets = [0u32, 4, 7, 8, 50, 2]; // decision at nodes 0..=5
        let verify: Vec<f32> = targets.iter().flat_map(|&t| one_hot(v, t)).collect();
        let w = walk_greedy(&tree, &verify, v);
        assert_eq!(w.path, vec![0, 1, 4]);
        assert_eq!(w.decisions, vec![0, 4, 50]);
        assert_eq!(w.bonus(), 50);
        assert_eq!(w.accepted(), 2);
        let committed: Vec<u32> = w.path.iter().map(|&n| tree.tokens[n]).collect();
        assert_eq!(committed, vec![100, 0, 4]); // b, a, e
    }

    #[test]
    fn sampled_decisions_use_the_uniform_of_the_decided_position() {
        let v = 64;
        let tree = build_tree(100, &crate::ddtree::build::tests::worked_example_logits(v), 3, v, 5);
        // Each node mildly prefers its first child's token, so walks often go deep but not always.
        let verify: Vec<f32> = (0..tree.len())
            .flat_map(|n| {
                let mut r = vec![0.0f32; v];
                if let Some((t, _)) = tree.children(n).next() {
                    r[t as usize] = 3.0;
                }
                r
            })
            .collect();
        let mut depths_seen = [0usize; 4];
        for seed in 0..40u64 {
            let s = Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed,
            };
            for start in [0usize, 10, 1 << 33] {
                let w = walk_sampled(&tree, &verify, v, &s, start);
                for (i, &n) in w.path.iter().enumerate() {
                    let pos = start + tree.depths[n] as usize + 1;
                    assert_eq!(
                        w.decisions[i],
                        sample(&verify[n * v..(n + 1) * v], &s, pos),
                        "seed {seed} node {n}"
                    );
                }
                depths_seen[w.accepted()] += 1;
            }
        }
        assert!(depths_seen.iter().all(|&c| c > 0), "walk depths {depths_seen:?}");
    }

    #[test]
    fn root_only_tree_is_one_decision() {
        let tree = crate::ddtree::DraftTree::root_only(3);
        let w = walk_greedy(&tree, &one_hot(5, 2), 5);
        assert_eq!((w.bonus(), w.path), (2, vec![0]));
    }
}
