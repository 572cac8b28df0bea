//! Generation over a [`Session`]: prefill, then steps, with stops checked token by token in emission
//! order — identical in AR and DDTree mode: a stop token (kept in the output), then the callback (called
//! with all tokens so far; true = stop), then `max_tokens`. Tokens of a step after the stop point are cut
//! with `Session::keep`, so after `generate` returns `session.committed() == prompt.len() +
//! tokens.len() − 1` (the last emitted token is never fed) and, in DDTree mode, the drafter context equals
//! the committed prefix. A run that fills the cache ends with `FinishReason::Length`.
//! Must match: greedy DDTree output == greedy AR output token for token (ddtree.md §3.1), and with the
//! same seed sampled DDTree == sampled AR (see sampling.rs for why the draws line up).
//! Tests: engine/tests/generate_loops.rs (mock target and drafter) and generate_tiny_model.rs.

use crate::api::{Drafter, Target};
use crate::session::Session;
use anyhow::{ensure, Result};
use std::time::Instant;

pub use crate::sampling::Sampling;
pub use crate::session::Mode;

#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub sampling: Sampling,
    /// Must be the session's mode (checked).
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
    /// Round budgets ([`crate::Emitted::budget`]: `--budget auto`'s bucket), summed over rounds.
    pub budgets: u64,
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
    /// Mean node budget per round (`--budget auto`: of the buckets it chose); 0 without rounds.
    pub fn mean_budget(&self) -> f64 {
        if self.verify_steps == 0 {
            0.0
        } else {
            self.budgets as f64 / self.verify_steps as f64
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
    fn record(&mut self, drafted: usize, accepted: usize, budget: usize, depths: usize) {
        if self.accepted_per_depth.len() < depths {
            self.accepted_per_depth.resize(depths, 0);
            self.acceptance_histogram.resize(depths + 1, 0);
        }
        self.verify_steps += 1;
        self.drafted += drafted as u64;
        self.budgets += budget as u64;
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

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
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

/// Generate from `req.prompt` in the session's mode. See the module comment for the contract.
pub fn generate(session: &mut Session<'_>, req: &GenRequest, on_tokens: &mut dyn FnMut(&[u32]) -> bool) -> Result<GenOutput> {
    let t0 = Instant::now();
    ensure!(req.mode == session.mode(), "request mode {:?} but the session runs {:?}", req.mode, session.mode());
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
    // Room for the whole generation up front (the caches never grow, nor a captured round re-captures, midway).
    // Best effort: when the device cannot hold that much (a max_tokens far beyond what a stop will allow), the
    // caches still grow on demand, as far as they can.
    let _ = session.reserve(req.prompt.len().saturating_add(req.max_tokens));
    let first = session.prefill(&req.prompt, &req.sampling)?;
    out.prefill_ms = ms(t0);
    out.ttft_ms = out.prefill_ms;
    let t_dec = Instant::now();
    let mut finish = emit(&mut out.tokens, first, req, on_tokens);
    let depths = session.block_size().saturating_sub(1);
    while finish.is_none() {
        if !session.can_step() {
            finish = Some(FinishReason::Length);
            break;
        }
        let step = session.step()?;
        if session.mode().drafts() {
            out.spec.record(step.drafted, step.accepted, step.budget, depths);
        }
        let mut kept = 0;
        for &tok in &step.tokens {
            kept += 1;
            finish = emit(&mut out.tokens, tok, req, on_tokens);
            if finish.is_some() {
                break;
            }
        }
        session.keep(kept)?;
    }
    out.finish_reason = finish.unwrap_or(FinishReason::Length);
    out.decode_ms = ms(t_dec);
    Ok(out)
}

/// One request on a target (and drafter) the caller keeps: a fresh [`Session`] in `req.mode` over the
/// borrowed parts, then [`generate`]. For tests and tools that hold concrete engine types.
pub fn generate_on(
    target: &mut dyn Target,
    drafter: Option<&mut dyn Drafter>,
    req: &GenRequest,
    on_tokens: &mut dyn FnMut(&[u32]) -> bool,
) -> Result<GenOutput> {
    let d = if req.mode.drafts() { drafter.map(|d| Box::new(d) as Box<dyn Drafter + '_>) } else { None };
    let mut session = Session::new(Box::new(target), d, req.mode)?;
    generate(&mut session, req, on_tokens)
}
