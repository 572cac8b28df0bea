//! The MLA latent KV cache (the CPU backend's `Kv`; the tree visibility mask is `backend::Visibility`).
//!
//! Cache: per layer and per token, the normalised latent `c_kv` (kv_lora) followed by the RoPE'd shared key
//! `k_pe` (rope) — 512 + 64 = 576 f32 on K2.6 (k26-format §4.3). Rows `[0, committed)` are the committed
//! prefix; a forward appends its T nodes as scratch rows `[committed, committed + T)`; `commit(path)` moves
//! the accepted nodes' rows to `[committed, committed + path.len())` and drops the rest (ddtree.md §3.4).
//!
//! Mask: node i sees the whole committed prefix plus its ancestors and itself, one bit per node in
//! `ceil(T/64)` u64 words per row (any budget, ddtree.md §6.1); a row is its parent's row OR its own bit,
//! which works because `parents[i] < i`. Tests: below, engine/tests/target_model.rs (tree == chain,
//! commit compaction).

use anyhow::{ensure, Result};

/// Latent KV cache of all layers.
#[derive(Debug, Clone)]
pub struct LatentCache {
    /// kv_lora + rope.
    pub width: usize,
    /// Per layer `[committed + scratch, width]` f32.
    pub rows: Vec<Vec<f32>>,
    pub committed: usize,
    /// Scratch nodes written by the last forward (0 after commit/reset).
    pub scratch: usize,
}

impl LatentCache {
    pub fn new(layers: usize, width: usize) -> LatentCache {
        LatentCache {
            width,
            rows: vec![Vec::new(); layers],
            committed: 0,
            scratch: 0,
        }
    }
    /// Drop any scratch rows (start of a forward).
    pub fn drop_scratch(&mut self) {
        let keep = self.committed * self.width;
        self.rows.iter_mut().for_each(|r| r.truncate(keep));
        self.scratch = 0;
    }
    /// Append `[t, width]` rows to layer `l` as scratch.
    pub fn append(&mut self, l: usize, rows: &[f32]) {
        assert_eq!(
            rows.len() % self.width,
            0,
            "append: {} values is not a multiple of width {}",
            rows.len(),
            self.width
        );
        self.rows[l].extend_from_slice(rows);
    }
    /// Keep scratch nodes `path` (indices into the last forward), in order, as the next committed rows.
    pub fn commit(&mut self, path: &[usize]) -> Result<()> {
        for (k, &p) in path.iter().enumerate() {
            ensure!(
                p < self.scratch,
                "commit: path[{k}] = {p} but the last forward had {} nodes",
                self.scratch
            );
        }
        for layer in self.rows.iter_mut() {
            crate::cpu::ops::kv_compact(layer, self.width, self.committed, path);
        }
        self.committed += path.len();
        self.scratch = 0;
        Ok(())
    }
    /// Keep only the committed rows `[0, len)`, dropping scratch.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        ensure!(
            len <= self.committed,
            "truncate to {len}: only {} rows are committed",
            self.committed
        );
        self.committed = len;
        self.drop_scratch();
        Ok(())
    }
    pub fn reset(&mut self) {
        self.rows.iter_mut().for_each(Vec::clear);
        self.committed = 0;
        self.scratch = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_gathers_path_rows() {
        let mut c = LatentCache::new(2, 3);
        for l in 0..2 {
            c.append(l, &[0.0, 0.0, 0.0]); // committed row
        }
        c.committed = 1;
        for l in 0..2 {
            c.append(l, &(0..15).map(|v| (v + 100 * l) as f32).collect::<Vec<_>>());
            // 5 scratch rows
        }
        c.scratch = 5;
        c.commit(&[0, 2, 3]).unwrap();
        assert_eq!(c.committed, 4);
        assert_eq!(
            c.rows[1],
            vec![0.0, 0.0, 0.0, 100.0, 101.0, 102.0, 106.0, 107.0, 108.0, 109.0, 110.0, 111.0]
        );
        assert!(c.commit(&[0]).is_err(), "no scratch after a commit");
    }
}
