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
use crate::session_batch::Batch;
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
/// describe the walk before any stop cut. Deserializes from a record's `spec` object (missing counters are
/// 0, derived rates are ignored), so a summary adds records up with [`SpecStats::merge`].
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct SpecStats {
    pub verify_steps: u64,
    /// Tree nodes drafted (root excluded), summed over rounds.
    pub drafted: u64,
    /// Round budgets ([`crate::Emitted::budget`]: `--budget auto`'s bucket), summed over rounds.
    pub budgets: u64,
    /// Feed rounds among the rounds (budget 0: `--budget auto` where drafting does not pay).
    pub feed_rounds: u64,
    /// Tree nodes accepted (root excluded), summed over rounds.
    pub accepted: u64,
    /// [B−1]: entry d−1 = rounds whose accepted path reached depth d.
    pub accepted_per_depth: Vec<u64>,
    /// [B]: entry k = rounds that accepted exactly k drafted nodes.
    pub acceptance_histogram: Vec<u64>,
}

impl SpecStats {
    /// Add `o`'s counters into `self` (per-depth counts entry by entry, the shorter padded with zeros).
    pub fn merge(&mut self, o: &SpecStats) {
        fn add(dst: &mut Vec<u64>, src: &[u64]) {
            if dst.len() < src.len() {
                dst.resize(src.len(), 0);
            }
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
        self.verify_steps += o.verify_steps;
        self.drafted += o.drafted;
        self.budgets += o.budgets;
        self.feed_rounds += o.feed_rounds;
        self.accepted += o.accepted;
        add(&mut self.accepted_per_depth, &o.accepted_per_depth);
        add(&mut self.acceptance_histogram, &o.acceptance_histogram);
    }
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
        self.feed_rounds += u64::from(budget == 0);
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
fn emit(
    out: &mut Vec<u32>,
    tok: u32,
    req: &GenRequest,
    on_tokens: &mut dyn FnMut(&[u32]) -> bool,
) -> Option<FinishReason> {
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

/// One request's generation in progress: its tokens so far, its counters and clocks, and whether it has
/// finished. [`generate`] drives one over a session; [`generate_batch`] drives many over a [`Batch`].
pub struct Progress {
    out: GenOutput,
    finish: Option<FinishReason>,
    t0: Instant,
    t_dec: Instant,
    depths: usize,
    drafts: bool,
}

impl Progress {
    /// Prefill `req.prompt` on `session` (room for the whole generation first) and take the first token.
    pub fn start(
        session: &mut Session<'_>,
        req: &GenRequest,
        on_tokens: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<Progress> {
        let mut p = Progress::begin(session, req)?;
        if !p.finished() {
            let first = session.prefill(&req.prompt, &req.sampling)?;
            p.first(first, req, on_tokens);
        }
        Ok(p)
    }

    /// Everything before the prefill: the mode check, `max_tokens` 0 (finished at once), room for the whole
    /// generation up front (the caches never grow, nor a captured round re-captures, midway; best effort:
    /// when the device cannot hold that much, a max_tokens far beyond what a stop will allow, the caches still
    /// grow on demand, as far as they can).
    pub fn begin(session: &mut Session<'_>, req: &GenRequest) -> Result<Progress> {
        let t0 = Instant::now();
        ensure!(
            req.mode == session.mode(),
            "request mode {:?} but the session runs {:?}",
            req.mode,
            session.mode()
        );
        let out = GenOutput {
            tokens: Vec::new(),
            finish_reason: FinishReason::Length,
            spec: SpecStats::default(),
            prefill_ms: 0.0,
            decode_ms: 0.0,
            ttft_ms: 0.0,
        };
        let (depths, drafts) = (session.block_size().saturating_sub(1), session.mode().drafts());
        let mut p = Progress {
            out,
            finish: None,
            t0,
            t_dec: t0,
            depths,
            drafts,
        };
        if req.max_tokens == 0 {
            ensure!(!req.prompt.is_empty(), "empty prompt");
            p.finish = Some(FinishReason::Length);
            return Ok(p);
        }
        let _ = session.reserve(req.prompt.len().saturating_add(req.max_tokens));
        Ok(p)
    }

    /// The prefill's first token.
    pub fn first(&mut self, tok: u32, req: &GenRequest, on_tokens: &mut dyn FnMut(&[u32]) -> bool) {
        self.out.prefill_ms = ms(self.t0);
        self.out.ttft_ms = self.out.prefill_ms;
        self.t_dec = Instant::now();
        self.finish = emit(&mut self.out.tokens, tok, req, on_tokens);
    }

    pub fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// The session cannot step again (its cache is full): the generation ends with `Length`.
    pub fn cut(&mut self) {
        self.finish.get_or_insert(FinishReason::Length);
    }

    /// Take one step's tokens in order until the generation ends; returns how many the session keeps
    /// (`Session::keep`).
    pub fn absorb(
        &mut self,
        step: &crate::session::Emitted,
        req: &GenRequest,
        on_tokens: &mut dyn FnMut(&[u32]) -> bool,
    ) -> usize {
        if self.drafts {
            self.out
                .spec
                .record(step.drafted, step.accepted, step.budget, self.depths);
        }
        let mut kept = 0;
        for &tok in &step.tokens {
            kept += 1;
            self.finish = emit(&mut self.out.tokens, tok, req, on_tokens);
            if self.finish.is_some() {
                break;
            }
        }
        kept
    }

    /// The finished generation.
    pub fn end(mut self) -> GenOutput {
        self.out.finish_reason = self.finish.unwrap_or(FinishReason::Length);
        if !self.out.tokens.is_empty() {
            self.out.decode_ms = ms(self.t_dec);
        }
        self.out
    }
}

/// Generate from `req.prompt` in the session's mode. See the module comment for the contract.
pub fn generate(
    session: &mut Session<'_>,
    req: &GenRequest,
    on_tokens: &mut dyn FnMut(&[u32]) -> bool,
) -> Result<GenOutput> {
    let mut p = Progress::start(session, req, on_tokens)?;
    while !p.finished() {
        if !session.can_step() {
            p.cut();
            break;
        }
        let step = session.step()?;
        let kept = p.absorb(&step, req, on_tokens);
        session.keep(kept)?;
    }
    Ok(p.end())
}

/// A per-token callback (all tokens so far; true = stop), boxed for a [`Job`].
pub type OnTokens<'c> = Box<dyn FnMut(&[u32]) -> bool + 'c>;

/// One request of [`generate_batch`]: the request and its per-token callback (stop strings).
pub struct Job<'c> {
    pub req: GenRequest,
    pub on_tokens: OnTokens<'c>,
}

/// Continuous batching over `batch`: `next()` gives the requests in order (with the caller's index), each
/// starts in a free slot as soon as one is free (and its KV fits: [`Batch::admit`]; otherwise it waits for
/// a running one to finish), every tick steps all running sequences together ([`Batch::step`]), and each
/// finished generation goes to `done(index, result)` at once (in finishing order; the caller restores input
/// order). A request that fails (prefill, a KV cache it can never fit) gets its error and the others go on;
/// an error of a batched step fails the sequences of that step. Every sequence's tokens are those
/// [`generate`] gives it alone (the stops are checked the same way, token by token).
pub fn generate_batch<'c>(
    batch: &mut Batch,
    next: &mut dyn FnMut() -> Option<(usize, Job<'c>)>,
    done: &mut dyn FnMut(usize, Result<GenOutput>) -> Result<()>,
) -> Result<()> {
    struct Running<'c> {
        index: usize,
        job: Job<'c>,
        p: Progress,
    }
    let n = batch.len();
    let mut slots: Vec<Option<Running<'c>>> = (0..n).map(|_| None).collect();
    let mut waiting: Option<(usize, Job<'c>)> = None;
    let mut exhausted = false;
    loop {
        // Admit: fill free slots in order while requests fit, then prefill the admitted ones together.
        let mut admitted: Vec<(usize, usize, Job<'c>, Progress)> = Vec::new();
        while let Some(slot) = (0..n).find(|&i| slots[i].is_none() && !admitted.iter().any(|a| a.0 == i)) {
            let Some((index, job)) = waiting.take().or_else(|| if exhausted { None } else { next() }) else {
                exhausted = true;
                break;
            };
            let running: Vec<usize> = (0..n)
                .filter(|&i| slots[i].is_some())
                .chain(admitted.iter().map(|a| a.0))
                .collect();
            let positions = job.req.prompt.len().saturating_add(job.req.max_tokens);
            match batch.admit(slot, positions, &running) {
                Err(e) => done(index, Err(e))?,
                Ok(crate::session_batch::Admit::Wait) => {
                    waiting = Some((index, job));
                    break;
                }
                Ok(crate::session_batch::Admit::Yes) => match Progress::begin(batch.session(slot), &job.req) {
                    Err(e) => done(index, Err(e))?,
                    Ok(p) if p.finished() => done(index, Ok(p.end()))?,
                    Ok(p) => admitted.push((slot, index, job, p)),
                },
            }
        }
        if !admitted.is_empty() {
            let firsts = {
                let items: Vec<(usize, &[u32], &Sampling)> = admitted
                    .iter()
                    .map(|(slot, _, job, _)| (*slot, &job.req.prompt[..], &job.req.sampling))
                    .collect();
                batch.prefill_many(&items)
            };
            for ((slot, index, mut job, mut p), first) in admitted.into_iter().zip(firsts) {
                match first {
                    Err(e) => done(index, Err(e))?,
                    Ok(tok) => {
                        p.first(tok, &job.req, &mut job.on_tokens);
                        if p.finished() {
                            done(index, Ok(p.end()))?;
                        } else {
                            slots[slot] = Some(Running { index, job, p });
                        }
                    }
                }
            }
        }
        // Sequences at the cache's end finish with Length; the rest step together.
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.is_some() && !batch.session(i).can_step() {
                let mut r = slot.take().expect("checked");
                r.p.cut();
                done(r.index, Ok(r.p.end()))?;
            }
        }
        let active: Vec<usize> = (0..n).filter(|&i| slots[i].is_some()).collect();
        if active.is_empty() {
            if waiting.is_none() && exhausted {
                return Ok(());
            }
            continue;
        }
        match batch.step(&active) {
            Err(e) => {
                // Every sequence of the failed step fails; their slots start afresh.
                let msg = crate::generate::chain(&e);
                for &i in &active {
                    let r = slots[i].take().expect("active");
                    batch.release(i);
                    done(r.index, Err(anyhow::anyhow!("{msg}")))?;
                }
            }
            Ok(steps) => {
                for (&i, step) in active.iter().zip(steps) {
                    let r = slots[i].as_mut().expect("active");
                    let kept = r.p.absorb(&step, &r.job.req, &mut r.job.on_tokens);
                    let kept = batch.session(i).keep(kept);
                    if let Err(e) = kept {
                        let r = slots[i].take().expect("active");
                        batch.release(i);
                        done(r.index, Err(e))?;
                        continue;
                    }
                    if r.p.finished() {
                        let r = slots[i].take().expect("active");
                        done(r.index, Ok(r.p.end()))?;
                    }
                }
            }
        }
    }
}

/// An error and its causes on one line.
fn chain(e: &anyhow::Error) -> String {
    e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ")
}

/// One request on a target (and drafter) the caller keeps: a fresh [`Session`] in `req.mode` over the
/// borrowed parts, then [`generate`]. For tests and tools that hold concrete engine types.
pub fn generate_on(
    target: &mut dyn Target,
    drafter: Option<&mut dyn Drafter>,
    req: &GenRequest,
    on_tokens: &mut dyn FnMut(&[u32]) -> bool,
) -> Result<GenOutput> {
    let d = if req.mode.drafts() {
        drafter.map(|d| Box::new(d) as Box<dyn Drafter + '_>)
    } else {
        None
    };
    let mut session = Session::new(Box::new(target), d, req.mode)?;
    generate(&mut session, req, on_tokens)
}
