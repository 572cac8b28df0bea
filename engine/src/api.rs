//! The interface between model code and everything that drives it.
//!
//! A backend (CPU now, CUDA later) implements [`Target`] and [`Drafter`]; the generation loops in
//! `generate.rs` (autoregressive and DDTree) are written once against these traits, and the tools
//! (`kdtree-run`, `kdtree-golden`) only see [`Model`]-level calls. Shapes are row-major f32 on the host.

use anyhow::Result;

/// Static facts about a loaded target model that the loops and tools need.
#[derive(Debug, Clone)]
pub struct TargetInfo {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// Largest position the KV cache accepts (exclusive): prompt + generated must stay below it.
    pub max_positions: usize,
    /// Target layers whose outputs (residual stream, before the final norm) are tapped for the drafter,
    /// in drafter order. Empty when no drafter is loaded.
    pub tap_layers: Vec<usize>,
}

/// Output of one target forward over a batch of tree nodes.
#[derive(Debug, Clone, Default)]
pub struct StepOut {
    /// [T, vocab] f32 logits, one row per input node.
    pub logits: Vec<f32>,
    /// [T, tap_layers.len() * hidden] f32, the drafter taps of each node (empty when tap_layers is empty).
    pub taps: Vec<f32>,
}

/// A target model session holding its latent KV cache.
///
/// Every forward is a *tree* hanging off the committed prefix: node `i` has parent `parents[i]`
/// (`-1` = child of the last committed token, i.e. a root; otherwise `parents[i] < i`). Node `i` sits at
/// position `committed() + depth(i)` where roots have depth 0, and attends to the whole committed prefix
/// plus its ancestors and itself. Prefill and plain decode are chains (`parents = [-1, 0, 1, ...]`).
/// Nothing is committed until [`Target::commit`].
pub trait Target {
    fn info(&self) -> &TargetInfo;
    /// Tokens in the committed KV cache.
    fn committed(&self) -> usize;
    /// Run the nodes; their KV goes to scratch slots after the committed prefix.
    fn forward(&mut self, tokens: &[u32], parents: &[i32]) -> Result<StepOut>;
    /// Commit nodes `path` of the last forward (a root-to-node path: path[0] is a root and each next
    /// entry is a child of the previous; for a chain, `0..k`). Their KV is compacted to positions
    /// `[committed, committed + path.len())`; all other scratch KV is dropped.
    fn commit(&mut self, path: &[usize]) -> Result<()>;
    /// Drop everything (new prompt).
    fn reset(&mut self);
}

/// A DFlash drafter session holding its context K/V cache (committed context only).
pub trait Drafter {
    /// Block size B: one bonus token then B-1 mask tokens.
    fn block_size(&self) -> usize;
    /// Number of committed context positions whose K/V are cached.
    fn context_len(&self) -> usize;
    /// Append committed context rows: `taps` is [n, n_taps * hidden] (the target's taps of the newly
    /// committed tokens, in order), at positions `[context_len, context_len + n)`.
    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()>;
    /// Draft one block `[bonus, mask × (B−1)]` at positions `[start, start + B)` (start = position of
    /// the bonus token = context_len). Returns [B-1, vocab] f32 logits for block positions 1..B-1.
    /// The context cache is unchanged.
    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>>;
    fn reset(&mut self);
}
