//! The engine's API at the tool boundary: a [`Session`] owns one sequence's generation state — the
//! target's latent KV cache and the drafter's context (inside its `Target` / `Drafter`), tree scratch
//! and the sampling settings (draws are keyed by (seed, position), sampling.rs) — and advances it one *step* per
//! call: one autoregressive token, or one whole DDTree round (draft → top-K → tree → verify → walk → commit
//! → drafter context += taps of the accepted nodes). A step returns only the emitted tokens and the round's
//! counters: on a GPU backend that is the one device→host copy per round; logits, trees and taps never cross the
//! boundary unless a caller asks for them with [`ProbeSet`].
//!
//! Where a round runs: a DDTree round goes to [`Target::device_round`] (the round on the target's own
//! backend: the drafter, top-K, tree, mask, verify, decisions, walk and commit where the ops run, one read
//! back) whenever the target can run it; otherwise, and when round probes are recorded, to the host round
//! below (`ddtree_round`: the tree built and walked here). Both give the same steps
//! (engine/tests/generate_device_round.rs on the CPU, cuda_round.rs on the GPU).
//!
//! Contract (checked by engine/tests/session.rs and the generation tests):
//! * `prefill(prompt, sampling)` resets both caches, runs the prompt as a chain with lm_head on the last
//!   row only, commits it, hands its taps to the drafter (DDTree mode), and returns the first token.
//! * After any call, `committed() == prompt.len() + emitted − 1`: the last emitted token is pending (it is
//!   the next step's input / root) and, in DDTree mode, the drafter context equals the committed prefix.
//! * `keep(n)` keeps only the first n tokens of the last step (a stop string or max_tokens cut inside an
//!   accepted path): the target and drafter are truncated to match, the n-th token becomes pending.
//! * Mode and budget are fixed per session (on a GPU they fix a CUDA graph's shape); sampling settings
//!   are per prompt. The depth of a tree is capped so no node reaches `TargetInfo::max_positions`.
//! * `Mode::DDTreeAuto` (`--budget auto`) needs [`Session::set_cost_model`]: each round runs at the bucket
//!   [`AutoBudget`] chose from the previous round's popped-node scores (ddtree/cost.rs; restarted at each
//!   prefill), read back with the walk; [`Emitted::budget`] says which. The tokens are those of any budget.
//!
//! One sequence per session; [`crate::Batch`] (session_batch.rs) steps many sessions forked from one model together,
//! through `Session::batch_item` / `Session::batched` (and `prefill_begin` / `prefill_item` / `prefill_end` for their
//! prompts), so a batched sequence keeps this bookkeeping.

use crate::api::{
    BatchItem, BatchOut, DeviceRound, Drafter, LogitRows, PrefillItem, StepKind, StepOut, Target, TargetInfo,
};
use crate::ddtree::{
    build_tree, build_tree_from_top_k, top_k_log_probs, walk_sampled, AutoBudget, CostModel, DraftTree, Walk,
};
use crate::model::Trace;
use crate::sampling::{sample, Sampling};
use anyhow::{bail, ensure, Context, Result};

/// Generation mode, fixed per session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ar,
    /// DDTree with a node budget (root excluded). Budget 0: feed rounds, each an AR step whose root's taps
    /// keep the drafter's context current (`kdtree-run calibrate` times them; `--budget auto` runs them where
    /// drafting does not pay, ddtree/cost.rs).
    DDTree {
        budget: usize,
    },
    /// DDTree with the budget of each round chosen by the CaDDTree rule from a measured cost model
    /// ([`Session::set_cost_model`]), among buckets of at most `max` nodes (ddtree/cost.rs).
    DDTreeAuto {
        max: usize,
    },
    /// The plain DFlash chain: one path of the drafter's argmax token at each of the B−1 block
    /// positions, verified and walked like a tree (the baseline DDTree is measured against).
    Chain,
}

impl Mode {
    /// Whether the mode drafts (needs a drafter and target taps).
    pub fn drafts(&self) -> bool {
        !matches!(self, Mode::Ar)
    }
}

/// What a session records during its steps, for checking (kdtree-golden records bundles with it and
/// `kdtree-run --verify` compares them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeSet {
    /// The logit row behind each emitted token's decision in AR mode and the prefill's last row.
    pub logits: bool,
    /// Per layer of every target forward: `layers.{L}.attn_out`, `layers.{L}.router.topk_ids` /
    /// `topk_weights`, `layers.{L}.mlp_out`, `layers.{L}.residual`, `final_norm`, `logits`.
    pub layers: bool,
    /// Per DDTree round: draft logits, tree, visibility, verify logits and taps, accepted path, bonus.
    pub rounds: bool,
}

/// What the probes captured since the last [`Session::take_probes`].
#[derive(Debug, Clone, Default)]
pub struct Probes {
    /// `[V]` rows, one per recorded decision (prefill's last row first).
    pub logits: Vec<Vec<f32>>,
    /// One trace per target forward (prefill, each step), in order.
    pub layers: Vec<Trace>,
    pub rounds: Vec<RoundRecord>,
}

/// Everything one DDTree round computed (what the round probe records).
#[derive(Debug, Clone)]
pub struct RoundRecord {
    /// Position of the root (= committed length at the start of the round).
    pub start: usize,
    /// Draft rows used (tree depth limit, <= B−1).
    pub draft_rows: usize,
    /// [draft_rows, V] f32 raw draft logits.
    pub draft_logits: Vec<f32>,
    /// Tree (tokens, depths, parents, child maps, visibility); `tree.tokens[0]` is the root.
    pub tree: DraftTree,
    /// Target forward over the tree: logits [N+1, V], taps [N+1, n_tap*H].
    pub verify: StepOut,
    /// Accepted path (starts with 0) and the target's decisions along it; `walk.bonus()` is the next root.
    pub walk: Walk,
}

impl RoundRecord {
    /// Tokens this round emits, in order: the accepted nodes' tokens after the root, then the bonus.
    pub fn new_tokens(&self) -> Vec<u32> {
        self.walk.path[1..]
            .iter()
            .map(|&n| self.tree.tokens[n])
            .chain([self.walk.bonus()])
            .collect()
    }
}

/// The result of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted {
    /// Tokens emitted by this step, in order (AR: one; DDTree: accepted path tokens then the bonus).
    pub tokens: Vec<u32>,
    /// DDTree counters (zero in AR mode): tree nodes drafted (root excluded), nodes accepted, and the
    /// round's depth limit (draft rows).
    pub drafted: usize,
    pub accepted: usize,
    pub depth_limit: usize,
    /// The round's node budget: the fixed one, the bucket `--budget auto` chose, the chain's length; 0 in AR.
    pub budget: usize,
}

/// One sequence's generation state over a target (and, in DDTree mode, a drafter).
pub struct Session<'a> {
    target: Box<dyn Target + 'a>,
    drafter: Option<Box<dyn Drafter + 'a>>,
    mode: Mode,
    sampling: Sampling,
    /// Last emitted token, not yet fed to the target (None before prefill).
    pending: Option<u32>,
    /// Committed length before the last step and the tokens it emitted (for `keep`).
    last: Option<(usize, Vec<u32>)>,
    probes: ProbeSet,
    captured: Probes,
    /// Run DDTree rounds where the target's ops run when it can ([`Target::device_round`]); off = always the
    /// host round (the reference the device round is tested against).
    device_round: bool,
    /// DDTree rounds this session ran where the target's ops run.
    device_rounds: usize,
    /// AR steps so far that ran where the target's ops run.
    device_steps: usize,
    /// `Mode::DDTreeAuto`'s budget choice (None until [`Session::set_cost_model`]).
    auto: Option<AutoBudget>,
    /// Prompt rows one prefill forward takes at most (0: all); [`Session::set_prefill_chunk`].
    prefill_chunk: usize,
    /// Run prefill chunks where the target's ops run when it can ([`Target::device_prefill`]); off = the host
    /// prefill (forward, taps read back, the drafter's context from them), the reference it is tested against.
    device_prefill: bool,
    /// Prefill chunks this session ran where the target's ops run.
    device_prefills: usize,
}

/// Prompt rows one prefill forward takes by default: a 128K-token prompt runs as 8 forwards whose ancestor mask
/// (rows² bits: 32 MiB) and activations fit beside the weights, where one forward's mask alone would take 2 GiB.
pub const DEFAULT_PREFILL_CHUNK: usize = 16384;

impl<'a> Session<'a> {
    /// A session in `mode`. DDTree needs a drafter and a target with tap layers.
    pub fn new(
        target: Box<dyn Target + 'a>,
        drafter: Option<Box<dyn Drafter + 'a>>,
        mode: Mode,
    ) -> Result<Session<'a>> {
        if mode.drafts() {
            ensure!(
                drafter.is_some(),
                "{mode:?} mode needs a drafter (the model directory has none; use --mode ar)"
            );
            ensure!(
                !target.info().tap_layers.is_empty(),
                "DDTree mode needs a target with tap layers"
            );
        }
        let sampling = Sampling::greedy();
        Ok(Session {
            target,
            drafter,
            mode,
            sampling,
            pending: None,
            last: None,
            probes: ProbeSet::default(),
            captured: Probes::default(),
            device_round: true,
            device_rounds: 0,
            device_steps: 0,
            auto: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            device_prefill: true,
            device_prefills: 0,
        })
    }

    /// The cost model `Mode::DDTreeAuto` chooses budgets with (an error in any other mode, or for a model
    /// that fails [`CostModel::check`]).
    pub fn set_cost_model(&mut self, cost: CostModel) -> Result<()> {
        let Mode::DDTreeAuto { max } = self.mode else {
            bail!("a cost model is only for --budget auto (mode {:?})", self.mode)
        };
        self.auto = Some(AutoBudget::new(max, cost)?);
        Ok(())
    }

    /// `Mode::DDTreeAuto`'s budget state (its buckets, the next round's budget).
    pub fn auto_budget(&self) -> Option<&AutoBudget> {
        self.auto.as_ref()
    }

    pub fn info(&self) -> &TargetInfo {
        self.target.info()
    }
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// Tokens in the target's committed KV cache.
    pub fn committed(&self) -> usize {
        self.target.committed()
    }
    /// Drafter block size B (0 without a drafter).
    pub fn block_size(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.block_size())
    }
    /// Whether another step fits under `max_positions` (the pending token needs a slot).
    pub fn can_step(&self) -> bool {
        self.pending.is_some() && self.target.committed() < self.target.info().max_positions
    }

    /// Record `set` during the following calls (replaces the previous set; captured data is kept).
    pub fn set_probes(&mut self, set: ProbeSet) {
        self.probes = set;
    }
    /// Everything captured so far (and clear it).
    pub fn take_probes(&mut self) -> Probes {
        std::mem::take(&mut self.captured)
    }

    fn traced<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if !self.probes.layers {
            return f(self);
        }
        self.target.start_trace();
        let out = f(self);
        if let Some(tr) = self.target.take_trace() {
            self.captured.layers.push(tr);
        }
        out
    }

    /// Start a new sequence: reset, run `prompt`, commit it, return the first generated token. A prompt longer than
    /// the prefill chunk ([`Session::set_prefill_chunk`]) runs as consecutive forwards of at most that many rows,
    /// each over the rows before it (committed) and committed in turn, so that the forward's mask and activations
    /// stay chunk-sized; every row's result is that of one forward over the whole prompt (a row depends on the
    /// rows it sees, not on how many rows its forward holds), up to the backend's summation order (the CPU: the
    /// same bits). Layer probes record the prompt as one forward.
    pub fn prefill(&mut self, prompt: &[u32], sampling: &Sampling) -> Result<u32> {
        self.prefill_begin(prompt, sampling)?;
        let v = self.target.info().vocab_size;
        let chunk = match self.prefill_chunk {
            0 => prompt.len(),
            _ if self.probes.layers => prompt.len(),
            c => c,
        };
        let mut logits = Vec::new();
        for (i, part) in prompt.chunks(chunk).enumerate() {
            let last = (i + 1) * chunk >= prompt.len();
            // Where the target's ops run, the drafter's context from taps that never leave the device (a 32K
            // prompt's taps are gigabytes: read back and sent again they took 3.5 s of a 5.9 s TTFT on the
            // K2.6 rank-0 slice), and none at all in AR.
            if self.device_prefill && !self.probes.layers {
                let d = match self.mode.drafts() {
                    true => Some(
                        self.drafter
                            .as_deref_mut()
                            .context("DDTree session without a drafter")?,
                    ),
                    false => None,
                };
                if let Some(out) = self.target.device_prefill(d.map(|d| d as &mut dyn Drafter), part, last) {
                    logits = out?;
                    self.device_prefills += 1;
                    continue;
                }
            }
            let rows = if last { LogitRows::Last } else { LogitRows::None };
            let out = self.traced(|s| {
                let parents: Vec<i32> = (0..part.len() as i32).map(|i| i - 1).collect();
                s.target.forward_rows(part, &parents, rows)
            })?;
            let path: Vec<usize> = (0..part.len()).collect();
            self.target.commit(&path)?;
            if self.mode.drafts() {
                let d = self.drafter.as_mut().context("DDTree session without a drafter")?;
                d.extend_context(&out.taps, part.len())?;
            }
            logits = out.logits;
        }
        ensure!(
            logits.len() == v,
            "target returned {} logits for the last prompt row, vocab {v}",
            logits.len()
        );
        self.prefill_end(logits)
    }

    /// Prompt rows one prefill forward takes at most (0: the whole prompt); [`DEFAULT_PREFILL_CHUNK`] unless set.
    /// Prompts longer than this prefill alone, not in a batched prefill.
    pub fn set_prefill_chunk(&mut self, rows: usize) {
        self.prefill_chunk = rows;
    }
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// [`Session::prefill`]'s checks and reset: a new sequence of `prompt` with `sampling` (nothing runs).
    pub(crate) fn prefill_begin(&mut self, prompt: &[u32], sampling: &Sampling) -> Result<()> {
        ensure!(!prompt.is_empty(), "empty prompt");
        let info = self.target.info();
        ensure!(
            prompt.len() <= info.max_positions,
            "prompt of {} tokens exceeds max_positions {}",
            prompt.len(),
            info.max_positions
        );
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            bail!("prompt token {bad} is outside the vocabulary of {}", info.vocab_size);
        }
        self.target.reset();
        if let Some(d) = self.drafter.as_mut() {
            d.reset();
        }
        self.sampling = sampling.clone();
        self.pending = None;
        self.last = None;
        if let Some(a) = self.auto.as_mut() {
            a.restart();
        }
        Ok(())
    }

    /// This session's prompt as one sequence of a batched prefill (after [`Session::prefill_begin`]); None
    /// when it must prefill alone (probes recording, or a prompt longer than the prefill chunk).
    pub(crate) fn prefill_item<'x>(&'x mut self, prompt: &'x [u32]) -> Option<PrefillItem<'x>> {
        if self.probes != ProbeSet::default() || (self.prefill_chunk > 0 && prompt.len() > self.prefill_chunk) {
            return None;
        }
        let drafter = match self.mode.drafts() {
            true => Some(self.drafter.as_deref_mut()? as &mut dyn Drafter),
            false => None,
        };
        Some(PrefillItem {
            target: &mut *self.target,
            drafter,
            prompt,
        })
    }

    /// The end of a prefill (the prompt committed, the drafter's context extended): the first token from the
    /// prompt's last-row logits.
    pub(crate) fn prefill_end(&mut self, logits: Vec<f32>) -> Result<u32> {
        let v = self.target.info().vocab_size;
        ensure!(
            logits.len() == v,
            "{} logits for the last prompt row, vocab {v}",
            logits.len()
        );
        // The first generated token sits right after the prompt (sampling.rs: draws keyed by position).
        let tok = sample(&logits, &self.sampling, self.target.committed());
        if self.probes.logits {
            self.captured.logits.push(logits);
        }
        self.pending = Some(tok);
        Ok(tok)
    }

    /// One AR step or one whole DDTree round from the pending token.
    pub fn step(&mut self) -> Result<Emitted> {
        let root = self.pending.context("step before prefill")?;
        let (start, max) = (self.target.committed(), self.target.info().max_positions);
        ensure!(start < max, "KV cache full: {start} committed, max_positions {max}");
        let emitted = match self.mode {
            Mode::Ar => self.traced(|s| s.ar_step(root))?,
            Mode::DDTree { budget } => self.traced(|s| s.ddtree_step(root, Some(budget)))?.0,
            Mode::DDTreeAuto { .. } => {
                let budget = self
                    .auto
                    .as_ref()
                    .context("--budget auto needs a cost model (Session::set_cost_model)")?
                    .budget();
                let (e, log_q) = self.traced(|s| s.ddtree_step(root, Some(budget)))?;
                let a = self.auto.as_mut().context("auto budget state lost")?;
                a.update_seen(&log_q, e.tokens.len());
                e
            }
            Mode::Chain => self.traced(|s| s.ddtree_step(root, None))?.0,
        };
        self.pending = emitted.tokens.last().copied();
        self.last = Some((start, emitted.tokens.clone()));
        Ok(emitted)
    }

    /// End the sequence and give its caches' storage back (a batch frees an idle slot's memory with it).
    pub fn release(&mut self) {
        self.target.release();
        if let Some(d) = self.drafter.as_mut() {
            d.release();
        }
        (self.pending, self.last) = (None, None);
    }

    /// Bytes one position of this session's caches takes: the target's latent row and, when it drafts, the
    /// drafter's context row.
    pub fn row_bytes(&self) -> usize {
        self.target.kv_row_bytes()
            + if self.mode.drafts() {
                self.drafter.as_ref().map_or(0, |d| d.ctx_row_bytes())
            } else {
                0
            }
    }

    /// Cache rows (positions plus a step's scratch) a generation of `positions` committed positions reserves
    /// ([`Session::reserve`]).
    pub fn rows_for(&self, positions: usize) -> usize {
        let p = positions.min(self.target.info().max_positions);
        let scratch = match self.mode {
            Mode::DDTree { budget } | Mode::DDTreeAuto { max: budget } => budget.saturating_add(1),
            Mode::Chain => self.drafter.as_ref().map_or(1, |d| d.block_size()),
            Mode::Ar => 1,
        };
        p.saturating_add(scratch)
    }

    /// The committed length and the pending token (a batch's snapshot of an idle slot, see
    /// [`Session::rewind`]); None before prefill.
    pub(crate) fn mark(&self) -> Option<(usize, u32)> {
        Some((self.target.committed(), self.pending?))
    }

    /// Back to a [`Session::mark`]: the caches keep `len` committed rows and `root` is pending again (a batch
    /// steps an idle slot as a ghost, results dropped, and rewinds it before the next step).
    pub(crate) fn rewind(&mut self, (len, root): (usize, u32)) -> Result<()> {
        if self.target.committed() != len {
            self.target.truncate(len)?;
            if let (true, Some(d)) = (self.mode.drafts(), self.drafter.as_mut()) {
                d.truncate_context(len)?;
            }
        }
        (self.pending, self.last) = (Some(root), None);
        Ok(())
    }

    /// This session's next step as one sequence of a batched step ([`crate::Batch`]); None when it must step
    /// alone ([`Session::step`]): before prefill, at the cache's end, with probes recording, with device
    /// rounds off, or `--budget auto` without its cost model.
    /// `auto`: the batch's common budget for a `--budget auto` session (the batch picks one bucket for all its
    /// sequences, so the round keeps one shape; the tokens do not depend on the budget).
    pub(crate) fn batch_item(&mut self, auto: Option<usize>) -> Option<BatchItem<'_>> {
        let root = self.pending?;
        if !self.device_round
            || self.probes != ProbeSet::default()
            || self.target.committed() >= self.target.info().max_positions
        {
            return None;
        }
        let kind = match self.mode {
            Mode::Ar => StepKind::Ar,
            Mode::DDTree { budget } => StepKind::Tree(budget),
            Mode::DDTreeAuto { .. } => StepKind::Tree(auto.or_else(|| self.auto.as_ref().map(AutoBudget::budget))?),
            Mode::Chain => StepKind::Chain,
        };
        let drafter = match self.mode.drafts() {
            true => Some(self.drafter.as_deref_mut()? as &mut dyn Drafter),
            false => None,
        };
        Some(BatchItem {
            target: &mut *self.target,
            drafter,
            root,
            kind,
            sampling: &self.sampling,
        })
    }

    /// The step a batched step ran for this session (from committed length `start`, the [`Session::batch_item`]
    /// it was given), with [`Session::step`]'s bookkeeping.
    pub(crate) fn batched(&mut self, start: usize, out: BatchOut) -> Result<Emitted> {
        let emitted = match out {
            BatchOut::Token(tok) => {
                ensure!(
                    self.mode == Mode::Ar,
                    "a batched AR token for a {:?} session",
                    self.mode
                );
                self.device_steps += 1;
                Emitted {
                    tokens: vec![tok],
                    drafted: 0,
                    accepted: 0,
                    depth_limit: 0,
                    budget: 0,
                }
            }
            BatchOut::Round(r) => {
                ensure!(self.mode.drafts(), "a batched round for an AR session");
                let budget = match self.mode {
                    Mode::DDTree { budget } => Some(budget),
                    // The batch's budget (the round drafted that many nodes).
                    Mode::DDTreeAuto { .. } => Some(r.drafted),
                    _ => None,
                };
                self.device_rounds += 1;
                let (e, log_q) = round_emitted(r, budget);
                if let Some(a) = self.auto.as_mut() {
                    a.update_seen(&log_q, e.tokens.len());
                }
                e
            }
        };
        self.pending = emitted.tokens.last().copied();
        self.last = Some((start, emitted.tokens.clone()));
        Ok(emitted)
    }

    fn ar_step(&mut self, root: u32) -> Result<Emitted> {
        // Where the target's ops run when it can (the same token; no logits come back, so not with probes).
        if self.device_round && !self.probes.logits && !self.probes.layers {
            if let Some(tok) = self.target.device_step(root, &self.sampling) {
                self.device_steps += 1;
                return Ok(Emitted {
                    tokens: vec![tok?],
                    drafted: 0,
                    accepted: 0,
                    depth_limit: 0,
                    budget: 0,
                });
            }
        }
        let v = self.target.info().vocab_size;
        let out = self.target.forward_rows(&[root], &[-1], LogitRows::All)?;
        ensure!(
            out.logits.len() == v,
            "target returned {} logits for 1 token x vocab {v}",
            out.logits.len()
        );
        self.target.commit(&[0])?;
        // `root` now sits at committed − 1; the new token goes to position committed.
        let tok = sample(&out.logits, &self.sampling, self.target.committed());
        if self.probes.logits {
            self.captured.logits.push(out.logits);
        }
        Ok(Emitted {
            tokens: vec![tok],
            drafted: 0,
            accepted: 0,
            depth_limit: 0,
            budget: 0,
        })
    }

    /// Room for a generation of `positions` committed positions (prompt + new tokens): the target's cache with
    /// a round's scratch rows on top, the drafter's context with a block, so nothing grows midway.
    pub fn reserve(&mut self, positions: usize) -> Result<()> {
        let p = positions.min(self.target.info().max_positions);
        self.target.reserve(self.rows_for(positions))?;
        if let Some(d) = self.drafter.as_deref_mut() {
            let block = d.block_size();
            d.reserve(p.saturating_add(block));
        }
        Ok(())
    }

    /// Whether DDTree rounds and AR steps may run where the target's ops run (default on; the tokens are the
    /// same).
    pub fn set_device_round(&mut self, on: bool) {
        self.device_round = on;
    }

    /// Whether prefill chunks may run where the target's ops run, the drafter's context from taps that stay
    /// there (default on; the state, logits and tokens are the same bit for bit).
    pub fn set_device_prefill(&mut self, on: bool) {
        self.device_prefill = on;
    }

    /// DDTree rounds so far that ran where the target's ops run ([`Session::set_device_round`]).
    pub fn device_rounds(&self) -> usize {
        self.device_rounds
    }

    /// Prefill chunks so far that ran where the target's ops run ([`Session::set_device_prefill`]).
    pub fn device_prefills(&self) -> usize {
        self.device_prefills
    }

    /// AR steps so far that ran where the target's ops run ([`Target::device_step`]; the same switch).
    pub fn device_steps(&self) -> usize {
        self.device_steps
    }

    /// One round; `budget` None = the chain. Also returns the popped nodes' scores (pop order).
    fn ddtree_step(&mut self, root: u32, budget: Option<usize>) -> Result<(Emitted, Vec<f64>)> {
        let d = self
            .drafter
            .as_deref_mut()
            .context("DDTree session without a drafter")?;
        let rows = d.block_size().saturating_sub(1);
        if let (true, false) = (self.device_round, self.probes.rounds) {
            let r = match budget {
                Some(budget) => self.target.device_round(d, root, budget, &self.sampling),
                None => self.target.device_chain(d, root, &self.sampling),
            };
            if let Some(r) = r {
                self.device_rounds += 1;
                return Ok(round_emitted(r?, budget));
            }
        }
        let rec = ddtree_round(&mut *self.target, d, root, budget, &self.sampling)?;
        let path = &rec.walk.path;
        self.target.commit(path)?;
        let nodes = rec.tree.len();
        ensure!(
            !rec.verify.taps.is_empty() && rec.verify.taps.len().is_multiple_of(nodes),
            "target produced no drafter taps"
        );
        let w = rec.verify.taps.len() / nodes;
        let taps: Vec<f32> = path
            .iter()
            .flat_map(|&n| rec.verify.taps[n * w..(n + 1) * w].iter().copied())
            .collect();
        d.extend_context(&taps, path.len())?;
        let e = Emitted {
            tokens: rec.new_tokens(),
            drafted: rec.tree.drafted(),
            accepted: rec.walk.accepted(),
            depth_limit: rec.draft_rows,
            budget: budget.unwrap_or(rows),
        };
        let log_q = rec.tree.log_q[1..].to_vec();
        if self.probes.rounds {
            self.captured.rounds.push(rec);
        }
        Ok((e, log_q))
    }

    /// Keep only the first `n` tokens of the last step (1 <= n <= its token count): the target and the
    /// drafter forget the nodes after them, and the n-th token becomes the pending one.
    pub fn keep(&mut self, n: usize) -> Result<()> {
        let (start, toks) = self.last.as_ref().context("keep: no step to cut")?;
        ensure!(n >= 1 && n <= toks.len(), "keep: {n} outside 1..={}", toks.len());
        if n == toks.len() {
            return Ok(());
        }
        // The step committed its root plus len−1 accepted nodes; keeping n tokens keeps root + n−1 nodes.
        let len = start + n;
        self.target.truncate(len)?;
        if let (true, Some(d)) = (self.mode.drafts(), self.drafter.as_mut()) {
            d.truncate_context(len)?;
        }
        self.pending = Some(toks[n - 1]);
        self.last = Some((*start, toks[..n].to_vec()));
        Ok(())
    }
}

/// What a device round (alone or batched) emitted, and its popped nodes' scores; `budget` None = the chain (its
/// budget is its rows).
fn round_emitted(r: DeviceRound, budget: Option<usize>) -> (Emitted, Vec<f64>) {
    let accepted = r.walk.accepted();
    let e = Emitted {
        tokens: r.walk.decisions,
        drafted: r.drafted,
        accepted,
        depth_limit: r.draft_rows,
        budget: budget.unwrap_or(r.draft_rows),
    };
    (e, r.log_q)
}

/// One DDTree round from root token `root` (at position `target.committed()`): draft, build the tree,
/// verify, walk (the decision at depth d draws the uniform of position committed + d + 1). Commits
/// nothing. The tree depth is min(B−1, max_positions − 1 − committed). Budget 0 is a feed round: no draft,
/// the root-only tree (an AR step's forward and decision, with the taps the drafter's context needs).
/// `budget` None: the chain (top-1 of each draft row, one path of the rows' length).
fn ddtree_round(
    target: &mut dyn Target,
    drafter: &mut dyn Drafter,
    root: u32,
    budget: Option<usize>,
    sampling: &Sampling,
) -> Result<RoundRecord> {
    let start = target.committed();
    let (v, max) = (target.info().vocab_size, target.info().max_positions);
    ensure!(
        drafter.context_len() == start,
        "drafter context {} != target committed {start}",
        drafter.context_len()
    );
    let l = drafter.block_size() - 1;
    // A feed round (budget 0) drafts nothing: the root alone is verified, its taps feed the drafter's context.
    let (rows, draft_logits) = if budget == Some(0) {
        (0, Vec::new())
    } else {
        let draft = drafter.draft(root, start)?;
        ensure!(
            draft.len() == l * v,
            "drafter returned {} logits, expected {l} rows x vocab {v}",
            draft.len()
        );
        let rows = l.min(max - 1 - start);
        (rows, draft[..rows * v].to_vec())
    };
    let tree = match budget {
        Some(budget) => build_tree(root, &draft_logits, rows, v, budget),
        None => build_tree_from_top_k(root, &top_k_log_probs(&draft_logits, rows, v, 1), rows),
    };
    let verify = target.forward_rows(&tree.tokens, &tree.parents, LogitRows::All)?;
    ensure!(
        verify.logits.len() == tree.len() * v,
        "target returned {} logits for {} nodes x vocab {v}",
        verify.logits.len(),
        tree.len()
    );
    let walk = walk_sampled(&tree, &verify.logits, v, sampling, start);
    Ok(RoundRecord {
        start,
        draft_rows: rows,
        draft_logits,
        tree,
        verify,
        walk,
    })
}
