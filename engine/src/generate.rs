//! Generation loops written once against `api::Target` + `api::Drafter`: autoregressive and DDTree.
//!
//! AR: prefill the prompt as a chain, then one token per step (greedy argmax or a seeded sample).
//! DDTree (ddtree.md §3.5): prefill (the prompt's taps become drafter context), then rounds:
//! draft `[bonus, mask × (B−1)]` → build the tree (budget) → one target forward over `[bonus, nodes]`
//! with the tree's parents → walk → commit the accepted path → drafter context += taps of the accepted
//! nodes → the walk's last decision is the next bonus.
//! Must match: greedy DDTree output == greedy AR output token for token (ddtree.md §3.1), and with the
//! same seed sampled DDTree == sampled AR, because the decision for the token at absolute position p uses
//! the uniform of (seed, p) in both loops (sampling.rs header, ddtree/walk.rs) — exact whenever the
//! target's tree logits equal its chain logits.
//! Stops (identical in both modes, checked token by token in emission order): a stop token (kept in the
//! output), then the callback (called with all tokens so far; true = stop), then `max_tokens`. Tokens of
//! an accepted path after the stop point are dropped and only the nodes before it are committed, so after
//! `generate` returns, `target.committed() == prompt.len() + tokens.len() - 1` (the last emitted token is
//! never fed) and, in DDTree mode, `drafter.context_len() == target.committed()`.
//! The depth of a tree is capped so no node lands at or beyond `TargetInfo::max_positions`; a run that
//! fills the cache ends with `FinishReason::Length`.
//! Tests: engine/tests/generate_loops.rs (mock target and drafter) and generate_tiny_model.rs.

use crate::api::{Drafter, StepOut, Target};
use crate::ddtree::{build_tree, walk_sampled, DraftTree, Walk};
use crate::sampling::sample;
use anyhow::{bail, ensure, Result};
use std::time::Instant;

pub use crate::sampling::Sampling;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ar,
    /// DDTree with a node budget (root excluded).
    DDTree { budget: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub sampling: Sampling,
    pub mode: Mode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was emitted (it is the last output token).
    Stop,
    /// `max_tokens` reached, or the target's position limit.
    Length,
    /// The callback asked to stop.
    Callback,
}

/// Speculation statistics of a DDTree run (all zero / empty in AR mode). Counts are per verify round and
/// describe the walk before any stop cut.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    pub verify_steps: u64,
    /// Tree nodes drafted (root excluded), summed over rounds.
    pub drafted: u64,
    /// Tree nodes accepted (root excluded), summed over rounds.
    pub accepted: u64,
    /// [B−1]: entry d−1 = rounds whose accepted path reached depth d.
    pub accepted_per_depth: Vec<u64>,
    /// [B]: entry k = rounds that accepted exactly k drafted nodes.
    pub acceptance_histogram: Vec<u64>,
}

impl SpecStats {
    /// Mean tokens committed per round, bonus included (τ of the DDTree paper); 0 without rounds.
    pub fn acceptance_length(&self) -> f64 {
        if self.verify_steps == 0 {
            0.0
        } else {
            (self.accepted + self.verify_steps) as f64 / self.verify_steps as f64
        }
    }
    /// Fraction of drafted tree nodes that were accepted; 0 when nothing was drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    fn record(&mut self, drafted: usize, accepted: usize, depths: usize) {
        if self.accepted_per_depth.len() < depths {
            self.accepted_per_depth.resize(depths, 0);
            self.acceptance_histogram.resize(depths + 1, 0);
        }
        self.verify_steps += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.accepted_per_depth[..accepted].iter_mut().for_each(|c| *c += 1);
        self.acceptance_histogram[accepted] += 1;
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenOutput {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub spec: SpecStats,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub ttft_ms: f64,
}

/// Everything one DDTree round computed, before committing (what the golden tool records).
#[derive(Debug, Clone)]
pub struct RoundRecord {
    /// Position of the root (= `target.committed()` at the start of the round).
    pub start: usize,
    /// Draft rows used (tree depth limit, <= B−1).
    pub draft_rows: usize,
    /// [draft_rows, V] f32 raw draft logits.
    pub draft_logits: Vec<f32>,
    /// Tree (tokens, depths, parents, child maps, visibility); `tree.tokens[0]` is the root/bonus.
    pub tree: DraftTree,
    /// Target forward over the tree: logits [N+1, V], taps [N+1, n_tap*H].
    pub verify: StepOut,
    /// Accepted path (starts with 0) and the target's decisions along it; `walk.bonus()` is the next root.
    pub walk: Walk,
}

impl RoundRecord {
    /// Tokens this round emits, in order: the accepted nodes' tokens after the root, then the bonus.
    pub fn new_tokens(&self) -> Vec<u32> {
        self.walk.path[1..].iter().map(|&n| self.tree.tokens[n]).chain([self.walk.bonus()]).collect()
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Run the prompt as a chain, commit it, hand its taps to the drafter (if any). Returns the last row of
/// logits [V] (the distribution of the first generated token).
pub fn prefill(target: &mut dyn Target, drafter: Option<&mut dyn Drafter>, prompt: &[u32]) -> Result<Vec<f32>> {
    ensure!(!prompt.is_empty(), "empty prompt");
    let max = target.info().max_positions;
    ensure!(target.committed() + prompt.len() <= max, "prompt of {} tokens exceeds max_positions {max}", prompt.len());
    let parents: Vec<i32> = (0..prompt.len() as i32).map(|i| i - 1).collect();
    let out = target.forward(prompt, &parents)?;
    let v = target.info().vocab_size;
    ensure!(out.logits.len() == prompt.len() * v, "target returned {} logits for {} tokens x vocab {v}", out.logits.len(), prompt.len());
    let path: Vec<usize> = (0..prompt.len()).collect();
    target.commit(&path)?;
    if let Some(d) = drafter {
        d.extend_context(&out.taps, prompt.len())?;
    }
    Ok(out.logits[(prompt.len() - 1) * v..].to_vec())
}

/// One DDTree round from root token `root` (at position `target.committed()`): draft, build the tree,
/// verify, walk (the decision at depth d draws the uniform of position committed + d + 1). Commits
/// nothing. The tree depth is min(B−1, max_positions − 1 − committed).
pub fn ddtree_round(
    target: &mut dyn Target,
    drafter: &mut dyn Drafter,
    root: u32,
    budget: usize,
    sampling: &Sampling,
) -> Result<RoundRecord> {
    let start = target.committed();
    let (v, max) = (target.info().vocab_size, target.info().max_positions);
    ensure!(start < max, "KV cache full: {start} committed, max_positions {max}");
    ensure!(drafter.context_len() == start, "drafter context {} != target committed {start}", drafter.context_len());
    let l = drafter.block_size() - 1;
    let draft = drafter.draft(root, start)?;
    ensure!(draft.len() == l * v, "drafter returned {} logits, expected {l} rows x vocab {v}", draft.len());
    let rows = l.min(max - 1 - start);
    let draft_logits = draft[..rows * v].to_vec();
    let tree = build_tree(root, &draft_logits, rows, v, budget);
    let verify = target.forward(&tree.tokens, &tree.parents)?;
    ensure!(verify.logits.len() == tree.len() * v, "target returned {} logits for {} nodes x vocab {v}", verify.logits.len(), tree.len());
    let walk = walk_sampled(&tree, &verify.logits, v, sampling, start);
    Ok(RoundRecord { start, draft_rows: rows, draft_logits, tree, verify, walk })
}

/// Commit the first `keep` nodes of the round's accepted path (1 <= keep <= path length) in the target and
/// append their taps to the drafter context.
pub fn commit_round(target: &mut dyn Target, drafter: &mut dyn Drafter, rec: &RoundRecord, keep: usize) -> Result<()> {
    ensure!(keep >= 1 && keep <= rec.walk.path.len(), "commit_round: keep {keep} outside 1..={}", rec.walk.path.len());
    let path = &rec.walk.path[..keep];
    target.commit(path)?;
    let nodes = rec.tree.len();
    ensure!(rec.verify.taps.len().is_multiple_of(nodes) && !rec.verify.taps.is_empty(), "target produced no drafter taps");
    let w = rec.verify.taps.len() / nodes;
    let taps: Vec<f32> = path.iter().flat_map(|&n| rec.verify.taps[n * w..(n + 1) * w].iter().copied()).collect();
    drafter.extend_context(&taps, keep)
}

/// Reborrow an optional drafter for a shorter lifetime (the trait-object lifetime must shrink with it).
fn reborrow<'s>(d: &'s mut Option<&mut dyn Drafter>) -> Option<&'s mut dyn Drafter> {
    match d {
        Some(d) => Some(&mut **d),
        None => None,
    }
}

/// Append `tok` and decide whether generation ends with it.
fn emit(out: &mut Vec<u32>, tok: u32, req: &GenRequest, on_tokens: &mut dyn FnMut(&[u32]) -> bool) -> Option<FinishReason> {
    out.push(tok);
    if req.stop_token_ids.contains(&tok) {
        Some(FinishReason::Stop)
    } else if on_tokens(out) {
        Some(FinishReason::Callback)
    } else if out.len() >= req.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Generate from `req.prompt` (both sessions are reset first). See the module comment for the contract.
pub fn generate(
    target: &mut dyn Target,
    mut drafter: Option<&mut dyn Drafter>,
    req: &GenRequest,
    on_tokens: &mut dyn FnMut(&[u32]) -> bool,
) -> Result<GenOutput> {
    let t0 = Instant::now();
    target.reset();
    let ddtree_budget = match req.mode {
        Mode::Ar => None,
        Mode::DDTree { budget } => {
            let Some(d) = reborrow(&mut drafter) else { bail!("DDTree mode needs a drafter") };
            ensure!(!target.info().tap_layers.is_empty(), "DDTree mode needs a target with tap layers");
            d.reset();
            Some(budget)
        }
    };
    let mut out = GenOutput {
        tokens: Vec::new(),
        finish_reason: FinishReason::Length,
        spec: SpecStats::default(),
        prefill_ms: 0.0,
        decode_ms: 0.0,
        ttft_ms: 0.0,
    };
    if req.max_tokens == 0 {
        ensure!(!req.prompt.is_empty(), "empty prompt");
        return Ok(out);
    }
    let last = if ddtree_budget.is_some() {
        prefill(target, reborrow(&mut drafter), &req.prompt)?
    } else {
        prefill(target, None, &req.prompt)?
    };
    out.prefill_ms = ms(t0);
    // The first token sits right after the prompt.
    let first = sample(&last, &req.sampling, target.committed());
    out.ttft_ms = ms(t0);
    let t_dec = Instant::now();
    let mut finish = emit(&mut out.tokens, first, req, on_tokens);
    let v = target.info().vocab_size;
    let max = target.info().max_positions;
    while finish.is_none() {
        if target.committed() >= max {
            finish = Some(FinishReason::Length);
            break;
        }
        let root = *out.tokens.last().unwrap();
        match (ddtree_budget, reborrow(&mut drafter)) {
            (Some(budget), Some(d)) => {
                let rec = ddtree_round(target, d, root, budget, &req.sampling)?;
                out.spec.record(rec.tree.drafted(), rec.walk.accepted(), d.block_size() - 1);
                let mut kept = 0;
                for tok in rec.new_tokens() {
                    kept += 1;
                    finish = emit(&mut out.tokens, tok, req, on_tokens);
                    if finish.is_some() {
                        break;
                    }
                }
                // `kept` tokens emitted: the root plus the first kept−1 accepted nodes were fed.
                commit_round(target, d, &rec, kept)?;
            }
            _ => {
                let step = target.forward(&[root], &[-1])?;
                ensure!(step.logits.len() == v, "target returned {} logits for 1 token x vocab {v}", step.logits.len());
                target.commit(&[0])?;
                // `root` now sits at committed − 1; the new token goes to position committed.
                let tok = sample(&step.logits, &req.sampling, target.committed());
                finish = emit(&mut out.tokens, tok, req, on_tokens);
            }
        }
    }
    out.finish_reason = finish.unwrap_or(FinishReason::Length);
    out.decode_ms = ms(t_dec);
    Ok(out)
}
