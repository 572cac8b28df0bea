//! The target tables the drafter borrows ([`TargetTables`]: embed_tokens, lm_head): the target's own
//! vocab-parallel shards, or whole tables in memory ([`DenseTables`], CPU and tests).

use crate::backend::Backend;
use crate::cpu::{ops, CpuBackend};
use half::bf16;

/// The target's token table and LM head, borrowed by the drafter (it has neither of its own).
pub trait TargetTables<B: Backend = CpuBackend>: Send + Sync {
    fn hidden_size(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// `embed_tokens` rows of `tokens`: [n, H].
    fn embed(&self, tokens: &[u32]) -> B::Act;
    /// [`TargetTables::embed`] of `n` ids already where the ops run.
    fn embed_ids(&self, ids: &B::Ids, n: usize) -> B::Act;
    /// `lm_head(x)` for x [n, H]: [n, V] logits in global vocab order.
    fn lm_head(&self, x: &B::Act, n: usize) -> B::Act;
}

/// Whole (vocab-gathered) bf16 tables held in memory (CPU; tests).
pub struct DenseTables {
    pub hidden: usize,
    pub vocab: usize,
    /// [V, H] bf16
    pub embed_tokens: Vec<bf16>,
    /// [V, H] bf16
    pub lm_head: Vec<bf16>,
}

impl TargetTables for DenseTables {
    fn hidden_size(&self) -> usize {
        self.hidden
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        ops::embedding_bf16(&[&self.embed_tokens], self.hidden, tokens)
    }
    fn embed_ids(&self, ids: &Vec<u32>, n: usize) -> Vec<f32> {
        self.embed(&ids[..n])
    }
    fn lm_head(&self, x: &Vec<f32>, n: usize) -> Vec<f32> {
        ops::lm_head_bf16(x, n, self.hidden, &[&self.lm_head])
    }
}

/// The target's own per-rank tables (vocab-parallel `[V/R, H]` shards), used without a copy: embed looks
/// up the owning rank's row; lm_head runs each rank's shard and places its columns at the rank's vocab
/// offset (global vocab order, ddtree.md §5.6 item 10).
impl<B: Backend> TargetTables<B> for crate::model::Weights<B> {
    fn hidden_size(&self) -> usize {
        self.cfg.hidden
    }
    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }
    fn embed(&self, tokens: &[u32]) -> B::Act {
        crate::model::Weights::embed(self, tokens)
    }
    fn embed_ids(&self, ids: &B::Ids, n: usize) -> B::Act {
        crate::model::Weights::embed_ids(self, ids, n)
    }
    fn lm_head(&self, x: &B::Act, n: usize) -> B::Act {
        crate::model::Weights::lm_head(self, x, n)
    }
}
