//! The interface between model code and everything that drives it.
//!
//! A backend (CPU now, CUDA later) implements [`Target`] and [`Drafter`]; the generation loops in
//! `session.rs` (autoregressive steps and DDTree rounds) are written once against these traits; the tools
//! (`kdtree-run`, `kdtree-golden`) see only the [`crate::Session`] API. Shapes are row-major f32 on the host.

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

/// Which rows of a forward need logits (lm_head is the largest matmul of a step at K2.6 sizes:
/// a prefill computes only the last row; a tree verify needs every row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitRows {
    /// One row per node: `[T, vocab]`.
    #[default]
    All,
    /// Only the last node's row: `[1, vocab]`.
    Last,
    /// No logits (e.g. a prefill chunk that is not the last).
    None,
}

/// Output of one target forward over a batch of tree nodes.
/// A device's captured-graph counters ([`Target::graph_stats`]): graphs captured, the host seconds their
/// captures took (recording, instantiating, the first launch queued), graph launches (captures included).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GraphStats {
    pub captures: u64,
    pub capture_s: f64,
    pub launches: u64,
}

#[derive(Debug, Clone, Default)]
pub struct StepOut {
    /// [rows, vocab] f32 logits: rows = T, 1 or 0 per the forward's [`LogitRows`].
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
    /// Run the nodes; their KV goes to scratch slots after the committed prefix. Logits only for `rows`.
    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut>;
    /// [`Target::forward_rows`] with logits for every node.
    fn forward(&mut self, tokens: &[u32], parents: &[i32]) -> Result<StepOut> {
        self.forward_rows(tokens, parents, LogitRows::All)
    }
    /// Commit nodes `path` of the last forward (a root-to-node path: path[0] is a root and each next
    /// entry is a child of the previous; for a chain, `0..k`). Their KV is compacted to positions
    /// `[committed, committed + path.len())`; all other scratch KV is dropped.
    fn commit(&mut self, path: &[usize]) -> Result<()>;
    /// Keep only the committed prefix `[0, len)` (len <= committed): undoes the tail of a commit when a
    /// stop string or max_tokens cuts inside an accepted path. Drops any scratch.
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Drop everything (new prompt).
    fn reset(&mut self);
    /// Room for `rows` cache rows (committed + a forward's scratch) so that a generation of that length never
    /// grows the cache, nor re-captures a device round, midway. Backends that grow freely ignore it.
    fn reserve(&mut self, _rows: usize) -> Result<()> {
        Ok(())
    }
    /// Start recording named per-layer tensors of every forward (probes; see model/trace.rs for names).
    /// Backends without probes ignore it.
    fn start_trace(&mut self) {}
    /// Stop recording and return what was recorded (None when nothing was recording).
    fn take_trace(&mut self) -> Option<crate::model::Trace> {
        None
    }
    /// One whole DDTree round from root token `root` (at position `committed()`) where the target's ops
    /// run: draft, top-K, tree, verify, walk, commit and the drafter's context, with one read back to the
    /// host (the walk). None when this target cannot run it with `drafter` (another backend, a recording
    /// trace, a depth limit cut by max_positions, a tree that might not fill `budget`): the caller runs the
    /// host round, which gives the same tokens.
    fn device_round(
        &mut self,
        _drafter: &mut dyn Drafter,
        _root: u32,
        _budget: usize,
        _s: &crate::sampling::Sampling,
    ) -> Option<Result<DeviceRound>> {
        None
    }
    /// The chain round (the top-1 of each draft row as one path) where the target's ops run, as
    /// [`Target::device_round`]; None when this target cannot: the caller runs the host chain round.
    fn device_chain(
        &mut self,
        _drafter: &mut dyn Drafter,
        _root: u32,
        _s: &crate::sampling::Sampling,
    ) -> Option<Result<DeviceRound>> {
        None
    }
    /// One chunk of a prefill where the target's ops run: `tokens` as a chain after the committed prefix,
    /// committed, and, with `drafter` (this model's own), its context extended by the chunk's taps without their
    /// being read back. Returns the last row's logits `[V]` when `last`, else nothing. None when this target
    /// cannot (another backend, another model's drafter, a recording trace): the caller runs
    /// [`Target::forward_rows`], [`Target::commit`] and [`Drafter::extend_context`], which leave the same state.
    fn device_prefill(
        &mut self,
        _drafter: Option<&mut dyn Drafter>,
        _tokens: &[u32],
        _last: bool,
    ) -> Option<Result<Vec<f32>>> {
        None
    }
    /// One AR step from root token `root` (at position `committed()`) where the target's ops run: the forward
    /// of the one token, the decision (greedy, or sampled at position `committed() + 1`) and the commit, with
    /// one read back (the token); a device backend captures it as one CUDA graph. None when this target
    /// cannot (a recording trace, the position limit): the caller runs the host step, which gives the same
    /// token.
    fn device_step(&mut self, _root: u32, _s: &crate::sampling::Sampling) -> Option<Result<u32>> {
        None
    }
    /// A new, empty session over the same weights (no copy): one per sequence of a [`crate::Batch`]. None
    /// when this target cannot fork (a batch then cannot be built over it).
    fn fork(&self) -> Option<Box<dyn Target>> {
        None
    }
    /// The batched step over sessions forked from this target ([`BatchOps`]); None when it has none (a
    /// batch then steps its sequences one by one: the same tokens).
    fn batch_ops(&self) -> Option<Box<dyn BatchOps>> {
        None
    }
    /// A new, empty session over the same weights together with, when `drafts`, a new session of this
    /// target's own drafter (`model::Model`: the pair that runs device rounds): one sequence of a
    /// [`crate::Batch`]. None when this target has no drafter of its own (the caller forks the two apart).
    fn fork_pair(&self, _drafts: bool) -> Option<Sessions> {
        None
    }
    /// Which model this session belongs to (`model::Model`: its target and drafter sessions give the same
    /// id; a [`BatchOps`] finds its sequences by it). None for a session of no such model.
    fn model_id(&self) -> Option<usize> {
        None
    }
    /// The concrete target, for the tensor-parallel wrappers (tp/; None by default).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
    /// Bytes one position of this session's KV cache takes (0: not accounted).
    fn kv_row_bytes(&self) -> usize {
        0
    }
    /// Drop the sequence and give the cache's storage back.
    fn release(&mut self) {
        self.reset()
    }
    /// Free memory where the ops run (None: not measured, the host).
    fn mem_free(&self) -> Option<usize> {
        None
    }
    /// The captured graphs' counters of the device this target runs on, since it opened (None: no graphs).
    fn graph_stats(&self) -> Option<GraphStats> {
        None
    }
}

/// A target session and, when it drafts, its drafter session (one sequence).
pub type Sessions = (Box<dyn Target>, Option<Box<dyn Drafter>>);

/// What kind of step a sequence of a batch takes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Ar,
    /// A DDTree round of this node budget.
    Tree(usize),
    /// The chain round.
    Chain,
}

/// One sequence of a batched step: its target and drafter (forked from one model), the token going in (at
/// position `target.committed()`), the step, its sampling.
pub struct BatchItem<'x> {
    pub target: &'x mut dyn Target,
    pub drafter: Option<&'x mut dyn Drafter>,
    pub root: u32,
    pub kind: StepKind,
    pub sampling: &'x crate::sampling::Sampling,
}

/// What a batched step gave one sequence (everything already committed, as the single-sequence device
/// step and round leave it).
#[derive(Debug, Clone, PartialEq)]
pub enum BatchOut {
    Token(u32),
    Round(DeviceRound),
}

/// Batched steps over sessions forked from one target: every sequence's step in one target forward (the
/// projections and the MoE over all their rows, attention per sequence over its own cache), one captured
/// graph and one read back for the whole batch.
pub trait BatchOps {
    /// Whether `item` can join a batched step now (otherwise it steps alone: same tokens).
    fn can_batch(&mut self, item: &mut BatchItem<'_>) -> bool;
    /// One step of every item (all of one kind: all AR, or all rounds), in one forward.
    fn step(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>>;
    /// The prefills of several sequences in one forward: each prompt, a chain at positions `0..len`, into its
    /// reset target (committed) and, when it drafts, its drafter's context; returns each prompt's last-row
    /// logits `[V]` (the session samples its first token from them).
    fn prefill(&mut self, items: &mut [PrefillItem<'_>]) -> Result<Vec<Vec<f32>>>;
    /// How the last [`BatchOps::step`] ran (what its wall time stands for).
    fn last_run(&self) -> StepRun {
        StepRun {
            steady: true,
            flush_us: 0.0,
        }
    }
}

/// How a batched step ran: `steady` when it replayed a captured graph, or captured nothing (a backend
/// without graphs), so its time is what the shape costs from now on (not a first, eager run or a capture);
/// `flush_us`, the part of its wall time (µs) its drafters spent writing their stashed context rows before
/// it (work that feed rounds put off; 0 when none did).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepRun {
    pub steady: bool,
    pub flush_us: f64,
}

/// One sequence of a batched prefill (see [`BatchOps::prefill`]).
pub struct PrefillItem<'x> {
    pub target: &'x mut dyn Target,
    pub drafter: Option<&'x mut dyn Drafter>,
    pub prompt: &'x [u32],
}

/// What a device round returns: the walk (accepted path, the target's decisions along it = the emitted
/// tokens), the popped nodes' scores (`log_q` of nodes 1..=drafted, pop order; read with the walk), the
/// nodes drafted and the draft rows (depth limit). Everything is already committed.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceRound {
    pub walk: crate::ddtree::Walk,
    pub log_q: Vec<f64>,
    pub drafted: usize,
    pub draft_rows: usize,
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
    /// Keep only context positions `[0, len)` (len <= context_len), the drafter side of `Target::truncate`.
    fn truncate_context(&mut self, len: usize) -> Result<()>;
    fn reset(&mut self);
    /// Room for `rows` context rows in all (see [`Target::reserve`]).
    fn reserve(&mut self, _rows: usize) {}
    /// Which model this drafter belongs to ([`Target::model_id`]): a target runs device rounds only with
    /// its own model's drafter.
    fn model_id(&self) -> Option<usize> {
        None
    }
    /// The concrete drafter, for the tensor-parallel wrappers (tp/; None by default).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
    /// A new, empty session over the same weights ([`Target::fork`]).
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        None
    }
    /// Bytes one context position takes (0: not accounted).
    fn ctx_row_bytes(&self) -> usize {
        0
    }
    /// Drop the context and give its storage back.
    fn release(&mut self) {
        self.reset()
    }
}

/// A borrowed target is a target (lets a [`crate::Session`] run over a model the caller keeps).
impl<T: Target + ?Sized> Target for &mut T {
    fn info(&self) -> &TargetInfo {
        (**self).info()
    }
    fn committed(&self) -> usize {
        (**self).committed()
    }
    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        (**self).forward_rows(tokens, parents, rows)
    }
    fn commit(&mut self, path: &[usize]) -> Result<()> {
        (**self).commit(path)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        (**self).truncate(len)
    }
    fn reset(&mut self) {
        (**self).reset()
    }
    fn reserve(&mut self, rows: usize) -> Result<()> {
        (**self).reserve(rows)
    }
    fn start_trace(&mut self) {
        (**self).start_trace()
    }
    fn take_trace(&mut self) -> Option<crate::model::Trace> {
        (**self).take_trace()
    }
    fn device_round(
        &mut self,
        drafter: &mut dyn Drafter,
        root: u32,
        budget: usize,
        s: &crate::sampling::Sampling,
    ) -> Option<Result<DeviceRound>> {
        (**self).device_round(drafter, root, budget, s)
    }
    fn device_chain(
        &mut self,
        drafter: &mut dyn Drafter,
        root: u32,
        s: &crate::sampling::Sampling,
    ) -> Option<Result<DeviceRound>> {
        (**self).device_chain(drafter, root, s)
    }
    fn device_prefill(
        &mut self,
        drafter: Option<&mut dyn Drafter>,
        tokens: &[u32],
        last: bool,
    ) -> Option<Result<Vec<f32>>> {
        (**self).device_prefill(drafter, tokens, last)
    }
    fn device_step(&mut self, root: u32, s: &crate::sampling::Sampling) -> Option<Result<u32>> {
        (**self).device_step(root, s)
    }
    fn fork(&self) -> Option<Box<dyn Target>> {
        (**self).fork()
    }
    fn batch_ops(&self) -> Option<Box<dyn BatchOps>> {
        (**self).batch_ops()
    }
    fn fork_pair(&self, drafts: bool) -> Option<Sessions> {
        (**self).fork_pair(drafts)
    }
    fn model_id(&self) -> Option<usize> {
        (**self).model_id()
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        (**self).as_any_mut()
    }
    fn kv_row_bytes(&self) -> usize {
        (**self).kv_row_bytes()
    }
    fn release(&mut self) {
        (**self).release()
    }
    fn mem_free(&self) -> Option<usize> {
        (**self).mem_free()
    }
    fn graph_stats(&self) -> Option<GraphStats> {
        (**self).graph_stats()
    }
}

/// A borrowed drafter is a drafter.
impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn block_size(&self) -> usize {
        (**self).block_size()
    }
    fn context_len(&self) -> usize {
        (**self).context_len()
    }
    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()> {
        (**self).extend_context(taps, n)
    }
    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>> {
        (**self).draft(bonus, start)
    }
    fn truncate_context(&mut self, len: usize) -> Result<()> {
        (**self).truncate_context(len)
    }
    fn reset(&mut self) {
        (**self).reset()
    }
    fn reserve(&mut self, rows: usize) {
        (**self).reserve(rows)
    }
    fn model_id(&self) -> Option<usize> {
        (**self).model_id()
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        (**self).as_any_mut()
    }
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        (**self).fork()
    }
    fn ctx_row_bytes(&self) -> usize {
        (**self).ctx_row_bytes()
    }
    fn release(&mut self) {
        (**self).release()
    }
}
