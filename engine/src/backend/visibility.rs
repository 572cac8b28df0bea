//! Ancestor-or-self visibility of tree nodes as per-row bitmasks: the one mask type of the engine (the
//! draft tree's and the target's tree attention).
//!
//! Node i sees node j iff j is i or an ancestor of i (the committed prefix is always visible and is not
//! part of the mask). Row i has `ceil(rows / 64)` u64 words, bit j % 64 of word j / 64 = node j; it is
//! built by OR-copying the parent's row, valid because `parents[i] < i` (ddtree.md §2.2, §6.1: any width,
//! multi-word). A forest is allowed (`-1` = root, e.g. several roots hanging off the committed prefix).
//! A node's depth is its row's popcount − 1. Tests: below and engine/tests/ddtree_tree.rs.

use anyhow::{ensure, Result};

/// Ancestor visibility as bitmasks: `bits[i * words + j / 64] >> (j % 64) & 1` = node j visible to node i.
#[derive(Debug, Clone, PartialEq)]
pub struct Visibility {
    /// Rows = nodes (N + 1 for a draft tree).
    pub rows: usize,
    /// u64 words per row = max(1, ceil(rows / 64)).
    pub words: usize,
    /// [rows, words] u64.
    pub bits: Vec<u64>,
}

impl Visibility {
    /// Build from `parents` (`-1` = root, otherwise an earlier node: `0 <= parents[i] < i`):
    /// row i = row(parents[i]) | {i}. Any other parent is an error naming the node.
    pub fn from_parents(parents: &[i32]) -> Result<Self> {
        let rows = parents.len();
        let words = rows.div_ceil(64).max(1);
        let mut bits = vec![0u64; rows * words];
        for (i, &p) in parents.iter().enumerate() {
            ensure!(
                p >= -1 && (p as i64) < i as i64,
                "parents[{i}] = {p}: must be -1 (root) or an earlier node (< {i})"
            );
            if p >= 0 {
                let p = p as usize;
                let (done, cur) = bits.split_at_mut(i * words);
                cur[..words].copy_from_slice(&done[p * words..(p + 1) * words]);
            }
            bits[i * words + i / 64] |= 1u64 << (i % 64);
        }
        Ok(Visibility { rows, words, bits })
    }
    /// One root, seeing itself.
    pub fn root_only() -> Self {
        Visibility {
            rows: 1,
            words: 1,
            bits: vec![1],
        }
    }
    /// Whether this is a chain: node i sees exactly nodes 0..=i (a prefill's mask), so attention may take it as
    /// plain causal.
    pub fn is_causal(&self) -> bool {
        (0..self.rows).all(|i| {
            self.row(i).iter().enumerate().all(|(w, &word)| {
                let want = match (i + 1).saturating_sub(64 * w) {
                    0 => 0,
                    n if n >= 64 => u64::MAX,
                    n => (1u64 << n) - 1,
                };
                word == want
            })
        })
    }
    /// Row i: [words] u64.
    pub fn row(&self, i: usize) -> &[u64] {
        &self.bits[i * self.words..(i + 1) * self.words]
    }
    /// Whether node i sees node j.
    pub fn visible(&self, i: usize, j: usize) -> bool {
        (self.row(i)[j / 64] >> (j % 64)) & 1 == 1
    }
    /// The nodes node i sees, ascending (its ancestors, then itself).
    pub fn visible_nodes(&self, i: usize) -> Vec<usize> {
        let mut out = Vec::new();
        for (w, &word) in self.row(i).iter().enumerate() {
            let mut b = word;
            while b != 0 {
                out.push(w * 64 + b.trailing_zeros() as usize);
                b &= b - 1;
            }
        }
        out
    }
    /// Depth of node i (roots 0) = its number of ancestors.
    pub fn depth(&self, i: usize) -> usize {
        self.row(i).iter().map(|w| w.count_ones() as usize).sum::<usize>() - 1
    }
    /// [rows] depth of every node.
    pub fn depths(&self) -> Vec<usize> {
        (0..self.rows).map(|i| self.depth(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn multi_word_rows_copy_the_parent() {
        // A chain of 130 nodes: row i has bits 0..=i set, spread over 3 words.
        let parents: Vec<i32> = (0..130i32).map(|i| i - 1).collect();
        let v = Visibility::from_parents(&parents).unwrap();
        assert_eq!(v.words, 3);
        assert_eq!(v.row(129), &[u64::MAX, u64::MAX, 0b11]);
        assert_eq!(v.row(63), &[u64::MAX, 0, 0]);
        assert_eq!(v.row(64), &[u64::MAX, 1, 0]);
        assert!(v.visible(100, 0) && v.visible(100, 100) && !v.visible(100, 101));
        assert_eq!(v.depth(129), 129);
        assert_eq!(Visibility::from_parents(&[-1]).unwrap(), Visibility::root_only());
    }

    #[test]
    fn forest_rows_are_ancestor_sets_up_to_2049_nodes() {
        // Random forests (several roots) of 200 and 2049 nodes; compare with a walk up the parent chain.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for n in [200usize, 2049] {
            let parents: Vec<i32> = (0..n)
                .map(|i| {
                    if i == 0 || rng.random_range(0..10) == 0 {
                        -1
                    } else {
                        rng.random_range(0..i as i32)
                    }
                })
                .collect();
            let m = Visibility::from_parents(&parents).unwrap();
            assert_eq!(m.words, n.div_ceil(64));
            for i in (0..n).step_by(if n > 1000 { 7 } else { 1 }) {
                let mut want = vec![i];
                let mut p = parents[i];
                while p >= 0 {
                    want.push(p as usize);
                    p = parents[p as usize];
                }
                assert_eq!(m.depth(i), want.len() - 1, "depth of {i}");
                want.sort();
                assert_eq!(m.visible_nodes(i), want, "row {i}");
                for j in (0..n).step_by(13) {
                    assert_eq!(m.visible(i, j), want.contains(&j));
                }
            }
            assert_eq!(m.depths().len(), n);
        }
    }

    #[test]
    fn bad_parents_are_errors_not_panics() {
        for bad in [&[-1, 1][..], &[-2], &[0], &[-1, 0, 5], &[-1, i32::MIN]] {
            let e = Visibility::from_parents(bad).unwrap_err().to_string();
            assert!(e.contains("parents["), "{bad:?}: {e}");
        }
        assert_eq!(Visibility::from_parents(&[]).unwrap().rows, 0);
    }

    #[test]
    fn is_causal_only_for_chains() {
        for n in [1usize, 2, 63, 64, 65, 130] {
            let chain: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
            assert!(Visibility::from_parents(&chain).unwrap().is_causal(), "chain of {n}");
            if n > 2 {
                let mut tree = chain.clone();
                tree[n - 1] = 0; // the last node skips its predecessor
                assert!(!Visibility::from_parents(&tree).unwrap().is_causal(), "tree of {n}");
            }
        }
        let siblings = Visibility::from_parents(&[-1, 0, 0]).unwrap();
        assert!(!siblings.is_causal());
    }
}
