//! [`DFlashDrafter`] as the engine's `api::Drafter`: context, drafting, the device round's pieces.

use super::{DFlashDrafter, DrafterDims};
use crate::api::Drafter;
use crate::backend::Backend;
use anyhow::{bail, ensure, Result};

impl<B: Backend> Drafter for DFlashDrafter<B> {
    fn block_size(&self) -> usize {
        self.dims.block
    }

    fn context_len(&self) -> usize {
        // The written rows, then the stash's.
        self.b.pos_get(&self.ctx_pos) + self.stashed()
    }

    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()> {
        let DrafterDims { hidden: h, n_taps, .. } = self.dims;
        if taps.len() != n * n_taps * h {
            bail!(
                "extend_context: taps has {} values, expected n={n} x {n_taps} taps x H={h}",
                taps.len()
            );
        }
        if n == 0 {
            return Ok(());
        }
        let taps = self.b.act_from_host(taps.to_vec());
        self.extend_context_act(&taps, n)
    }

    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>> {
        let logits = self.draft_act(bonus, start)?;
        let logits = self.b.to_host(&logits);
        self.b.check()?;
        Ok(logits)
    }

    fn truncate_context(&mut self, len: usize) -> Result<()> {
        let have = self.context_len();
        ensure!(
            len <= have,
            "truncate_context to {len}: the context holds {have} positions"
        );
        // Rows past the committed length are scratch: only the lengths move (the storage stays). A cut inside
        // the stash keeps its first rows.
        let written = self.b.pos_get(&self.ctx_pos);
        match len.checked_sub(written) {
            Some(keep) if self.stashed() > 0 => self.stash_keep(keep),
            _ => {
                self.stash_keep(0);
                self.b.pos_set(&mut self.ctx_pos, len);
            }
        }
        Ok(())
    }

    fn reset(&mut self) {
        self.b.pos_set(&mut self.ctx_pos, 0);
        self.stash_keep(0);
    }
    fn reserve(&mut self, rows: usize) {
        let have = self.b.pos_get(&self.ctx_pos);
        self.reserve_context(rows.saturating_sub(have));
    }
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(DFlashDrafter::fork(self)))
    }
    fn ctx_row_bytes(&self) -> usize {
        // K and V of every layer, f32.
        self.dims.layers * 2 * self.dims.kv_heads * self.dims.head_dim * std::mem::size_of::<f32>()
    }
    fn release(&mut self) {
        self.b.pos_set(&mut self.ctx_pos, 0);
        self.stash = None;
        for c in &mut self.cache {
            (c.k, c.v) = (self.b.act_from_host(Vec::new()), self.b.act_from_host(Vec::new()));
        }
        self.moves += 1;
    }
}
