//! A batch of sequences over one model (issue 15): `slots` [`Session`]s forked from the model (shared
//! weights; each slot its own latent KV cache, drafter context and tree workspaces), stepped together.
//!
//! [`Batch::step`] advances the given slots by one step each — an AR token or a whole DDTree round — in one
//! batched step of the model's backend (`api::BatchOps`, model/batch.rs: one target forward over every
//! slot's nodes, one captured graph and one read back for the whole batch). A slot that cannot join (probes
//! recording, the end of the cache, a tree that might not fill its budget) steps alone with
//! [`Session::step`], which gives the same tokens. Everything else — prefill, `keep`, sampling settings, the
//! auto budget — is the slot's own session, so a sequence's bookkeeping is the same alone and in a batch.
//!
//! KV memory ([`KvBudget`]): the bytes the slots' caches may hold are fixed when the batch is made (the
//! device's free memory after the weights, less room for a step's activations, or a given cap); a slot's
//! account is the rows its caches were sized for (the backends' growth rule: a power of two, at least 256),
//! and [`Batch::admit`] refuses a sequence that would take the total past the budget — the caller waits for
//! a slot to finish, or, when no sequence is running, gets the error that names both numbers. Idle slots'
//! storage is given back before a sequence is refused.
//!
//! Tests: engine/tests/batch_generate.rs (CPU: batched == one by one, every line).

use crate::api::{BatchItem, BatchOps, StepRun};
use crate::ddtree::cost::{batch_choice_by, CostModel, FeedRuns, REAL_WEIGHT};
use crate::session::{Emitted, Mode, Session};
use anyhow::{ensure, Context, Result};
use std::collections::HashMap;

/// The rows a cache allocates for `rows` rows (both backends grow by powers of two from 256 rows; the CPU's
/// exact growth is below it, so the account is an upper bound).
pub fn alloc_rows(rows: usize) -> usize {
    rows.checked_next_power_of_two().unwrap_or(usize::MAX).max(256)
}

/// Room kept free for the activations of a batch's largest step: its rows (every slot's tree, or one row per
/// slot in AR) times the widest per-row buffers a forward holds at once (the f32 logits and their bf16 copy
/// and top-K scratch, about 3 vocab rows; some 48 hidden-wide f32 buffers of the layers, the taps and the
/// MoE), plus 1 GiB for the captured graphs and the library workspaces. An estimate, not a measurement.
pub fn act_bytes(mode: Mode, slots: usize, vocab: usize, hidden: usize) -> usize {
    let per_slot = match mode {
        Mode::DDTree { budget } | Mode::DDTreeAuto { max: budget } => budget + 1,
        Mode::Chain => 16,
        Mode::Ar => 1,
    };
    let rows = slots.saturating_mul(per_slot);
    rows.saturating_mul(3 * vocab + 48 * hidden)
        .saturating_mul(4)
        .saturating_add(1 << 30)
}

/// The KV memory a batch may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBudget {
    /// Bytes the slots' caches may hold in all (None: not limited, the CPU without a cap).
    pub bytes: Option<usize>,
}

/// A sequence whose caches cannot fit in the batch's KV memory even alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a sequence of {positions} positions needs {} ({need} bytes, {rows} cache rows) of KV cache; the batch's KV \
         memory is {} ({budget} bytes)", size(*need), size(*budget))]
pub struct KvTooLarge {
    pub positions: usize,
    pub rows: usize,
    pub need: usize,
    pub budget: usize,
}

/// Bytes in MiB or GiB, two decimals.
fn size(b: usize) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / GIB)
    } else {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// Why a sequence was not admitted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// Not now: wait for a running sequence to finish.
    Wait,
}

/// A count and the wall seconds it took.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Tally {
    pub n: u64,
    pub s: f64,
}

impl Tally {
    fn add(&mut self, t: std::time::Instant) {
        self.n += 1;
        self.s += t.elapsed().as_secs_f64();
    }
}

/// Where a batch's wall time went, by kind of call (kdtree-run's `--summary` `time_split`): what the rest of a
/// generation's wall time is (the caller's own work between steps: records, stop checks, admission) follows
/// from it. Every figure is host wall time around the call, which ends with the call's read back.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct TimeSplit {
    /// [`Batch::prefill_many`] calls.
    pub prefill: Tally,
    /// Batched steps of AR mode, batched feed rounds (budget 0), batched drafted rounds.
    pub ar: Tally,
    pub feed: Tally,
    pub drafted: Tally,
    /// Of the batched steps above, those that were not steady (`api::StepRun`): a graph key's first run, eager,
    /// and its capture when it comes again (model/round.rs `Staging::capture_now`; keys change within a shape
    /// too, as caches move).
    pub new_shape: Tally,
    /// Steps of one session alone ([`Session::step`]): one token (AR or a feed round), or a drafted round.
    pub alone_one: Tally,
    pub alone_drafted: Tally,
}

impl TimeSplit {
    /// Seconds inside the batch's calls.
    pub fn total_s(&self) -> f64 {
        [
            self.prefill,
            self.ar,
            self.feed,
            self.drafted,
            self.alone_one,
            self.alone_drafted,
        ]
        .iter()
        .map(|t| t.s)
        .sum()
    }
}

/// `slots` sequences over one model, stepped together.
pub struct Batch {
    slots: Vec<Session<'static>>,
    ops: Option<Box<dyn BatchOps>>,
    mode: Mode,
    kv: KvBudget,
    /// Rows each slot's caches are accounted for (0 after a release).
    rows: Vec<usize>,
    /// Idle slots' marks (their committed length and pending token), rewound to before each step they join.
    ghosts: Vec<Option<(usize, u32)>>,
    /// Batched steps run, active slot-steps inside them, ghost slot-steps inside them, slot-steps run alone.
    pub batched_steps: usize,
    pub batched_slot_steps: usize,
    pub ghost_slot_steps: usize,
    pub alone_steps: usize,
    /// `--budget auto`: the batch's runs of feed rounds, and whether the next batched round must draft (a probe:
    /// the scores the decision weighs are the last drafted round's).
    feed: FeedRuns,
    probe: bool,
    /// `--budget auto`: the batch's drafted rounds' committed tokens per µs (of their shape's steady time), a
    /// running average (None before any).
    rate: Option<f64>,
    /// `--budget auto`: what the batch's steps cost by shape ([`ShapeCosts`]).
    costs: ShapeCosts,
    /// Batched feed rounds run, and batched rounds that mixed feeding (budget 0) and drafting sequences (a
    /// root-only tree for each feeding one: `--budget auto` never makes one, a batch decides for all).
    pub feed_steps: usize,
    pub mixed_steps: usize,
    /// Where the batch's time went.
    pub times: TimeSplit,
}

/// What a batch's steps cost by shape (rows of the forward, budget; 0 = a feed round), from their wall
/// times: where the cost model (one sequence's rounds, calibrated) does not know the batch's per-sequence
/// work, and what a shape costs before its graph replays.
///
/// A shape's first runs are dear (an eager run, then its capture: on an H200, the pair's drafted round of 4
/// sequences took 4.6 ms a probe against 0.63 ms replayed, bench/results run 119). Timing them as the shape's
/// cost made drafting look dear and the batch fed where drafting paid (run 119, batch 4: 100 % feed rounds
/// where budget 16 gives 1.32× AR); timing replays only, with nothing for the first runs, made batches of 16 and
/// 64 draft through many new shapes (run 120). So each shape's cost is its fastest steady run (a replay, less
/// any stash flush before it), and a shape not steady yet costs, on top, the runs it still needs before it
/// replays times what such a run has cost beyond a steady one (measured on the batch's own shapes;
/// [`NEW_SHAPE_EXCESS`] before any), spread over as many rounds as the batch has run at these rows (a batch
/// that has run k rounds is expected to run about k more).
#[derive(Debug, Default)]
struct ShapeCosts {
    /// The fastest steady time (µs) of each shape, any stash flush before it taken out.
    steady: HashMap<(usize, usize), f64>,
    /// Each shape's runs that were not steady, until it has a steady time: (count, µs summed).
    first: HashMap<(usize, usize), (usize, f64)>,
    /// Over the shapes measured both ways: (count, Σ (mean not-steady time − steady time) / steady time).
    excess: (usize, f64),
    /// Batched steps run at each row count.
    steps: HashMap<usize, usize>,
}

impl ShapeCosts {
    /// A step of `shape` that took `us` µs and ran as `run` says.
    fn record(&mut self, shape: (usize, usize), us: f64, run: StepRun) {
        *self.steps.entry(shape.0).or_default() += 1;
        let us = (us - run.flush_us).max(0.0);
        if run.steady {
            let t = self.steady.entry(shape).or_insert(us);
            *t = t.min(us);
        } else {
            let f = self.first.entry(shape).or_default();
            *f = (f.0 + 1, f.1 + us);
        }
        if let (Some(&s), Some(&(n, sum))) = (self.steady.get(&shape), self.first.get(&shape)) {
            self.first.remove(&shape);
            if s > 0.0 {
                self.excess = (self.excess.0 + 1, self.excess.1 + ((sum / n as f64 - s) / s).max(0.0));
            }
        }
    }

    /// The steady time of `shape`, µs.
    fn steady(&self, shape: (usize, usize)) -> Option<f64> {
        self.steady.get(&shape).copied()
    }

    /// What one not-steady run costs beyond a steady one, as a multiple of the steady time.
    fn excess(&self) -> f64 {
        match self.excess {
            (0, _) => NEW_SHAPE_EXCESS,
            (n, sum) => sum / n as f64,
        }
    }

    /// What `shape`'s first runs still cost beyond its steady time `est` (µs), per round the batch is expected
    /// to run at these rows; 0 once it is steady.
    fn new_cost(&self, shape: (usize, usize), est: f64) -> f64 {
        self.first_runs_left(shape) as f64 * self.excess() * est
            / self.steps.get(&shape.0).copied().unwrap_or(0).max(1) as f64
    }

    /// The not-steady runs `shape` still has before it replays: an eager run and a capture.
    fn first_runs_left(&self, shape: (usize, usize)) -> usize {
        match self.steady.contains_key(&shape) {
            true => 0,
            false => 2usize.saturating_sub(self.first.get(&shape).map_or(0, |f| f.0)),
        }
    }

    /// The costs a batch of `rows` rows decides with, between drafting bucket `b` and a feed round: the factor
    /// that turns the cost model's round time into the batch's (the model's over the steady time, at `b`, else
    /// at the nearest drafted bucket steady at these rows; 1 before any), the drafted round's steady time (µs;
    /// the model's scaled, before its own) and the feed round's (steady, else the model's; None without a
    /// measured feed round in the cost file).
    fn at(&self, rows: usize, b: usize, cost: &CostModel) -> (f64, f64, Option<f64>) {
        let model = |b: usize| cost.round_us_rows(rows, b);
        let near = self
            .steady
            .iter()
            .filter(|((r, tb), _)| *r == rows && *tb > 0)
            .min_by_key(|((_, tb), _)| (tb.abs_diff(b), *tb))
            .map(|((_, tb), &us)| model(*tb) / us);
        let scale = near.unwrap_or(1.0);
        let round = self.steady((rows, b)).unwrap_or(model(b) / scale);
        let feed = self.steady((rows, 0)).or_else(|| cost.feed_round_us(rows));
        (scale, round, feed.filter(|_| cost.feed_us.is_some()))
    }

    /// What a drafted round at bucket `b` costs a batch of `rows` rows now: its steady time and what its first
    /// runs still cost, spread ([`ShapeCosts::new_cost`]), µs.
    fn round_now(&self, rows: usize, b: usize, cost: &CostModel) -> f64 {
        let est = self.at(rows, b, cost).1;
        est + self.new_cost((rows, b), est)
    }
}

/// [`ShapeCosts::excess`] before the batch has measured one: a not-steady run costs this many steady runs more
/// (bench/results run 119: the pair's drafted round of 4 sequences, 4.6 ms before it replays, 0.63 ms after).
const NEW_SHAPE_EXCESS: f64 = 6.0;

impl Batch {
    /// [`crate::Loaded::batch`]: a batch of `slots` sequences in `mode` over `model` (sessions forked from it: no
    /// weight is copied).
    /// KV memory: what the device has free now, less room for the activations of the batch's largest step
    /// ([`act_bytes`]), at most `kv_cap` bytes when given (on the host: `kv_cap`, or not limited).
    pub(crate) fn over(model: &crate::Loaded, mode: Mode, slots: usize, kv_cap: Option<usize>) -> Result<Batch> {
        ensure!(slots >= 1, "a batch needs at least one slot");
        let mut sessions = Vec::with_capacity(slots);
        for _ in 0..slots {
            // Forked as a pair: a target runs device rounds (and joins batched rounds) with its own drafter.
            let (t, d) = match model.target.fork_pair(mode.drafts()) {
                Some(pair) => pair,
                None => {
                    let t = model
                        .target
                        .fork()
                        .context("this model's target cannot fork sessions for a batch")?;
                    let d = match mode.drafts() {
                        true => Some(
                            model
                                .drafter
                                .as_ref()
                                .context("this mode needs a drafter")?
                                .fork()
                                .context("this model's drafter cannot fork sessions for a batch")?,
                        ),
                        false => None,
                    };
                    (t, d)
                }
            };
            sessions.push(Session::new(t, d, mode)?);
        }
        let info = model.target.info();
        let free = model
            .target
            .mem_free()
            .map(|f| f.saturating_sub(act_bytes(mode, slots, info.vocab_size, info.hidden_size)));
        let kv = KvBudget {
            bytes: match (kv_cap, free) {
                (Some(cap), Some(free)) => Some(cap.min(free)),
                (cap, free) => cap.or(free),
            },
        };
        Ok(Batch {
            ops: model.target.batch_ops(),
            slots: sessions,
            mode,
            kv,
            rows: vec![0; slots],
            ghosts: vec![None; slots],
            batched_steps: 0,
            batched_slot_steps: 0,
            ghost_slot_steps: 0,
            alone_steps: 0,
            feed: FeedRuns::default(),
            probe: false,
            rate: None,
            costs: ShapeCosts::default(),
            feed_steps: 0,
            mixed_steps: 0,
            times: TimeSplit::default(),
        })
    }
}

impl Batch {
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    pub fn mode(&self) -> Mode {
        self.mode
    }
    pub fn kv_budget(&self) -> KvBudget {
        self.kv
    }
    /// Slot `i`'s session (prefill, keep, sampling, the auto budget's cost model).
    pub fn session(&mut self, i: usize) -> &mut Session<'static> {
        &mut self.slots[i]
    }
    pub fn sessions(&self) -> &[Session<'static>] {
        &self.slots
    }

    /// End slot `slot`'s sequence and give its caches' storage back (after a failed step: the slot's state is
    /// not trusted again, not even as a ghost).
    pub fn release(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.release();
            (self.rows[slot], self.ghosts[slot]) = (0, None);
        }
    }

    /// Bytes slot `slot`'s caches take when sized for `rows` rows.
    fn bytes(&self, slot: usize, rows: usize) -> usize {
        if rows == 0 {
            return 0;
        }
        self.slots[slot].row_bytes().saturating_mul(alloc_rows(rows))
    }

    /// Whether a generation of `positions` positions (prompt + max_tokens) may start in free slot `slot` now;
    /// `running`: the slots with a sequence in flight. Gives idle slots' storage back when that makes room.
    /// Err when it cannot fit even with nothing else running (the message names both sizes).
    pub fn admit(&mut self, slot: usize, positions: usize, running: &[usize]) -> Result<Admit> {
        let Some(budget) = self.kv.bytes else {
            return Ok(Admit::Yes);
        };
        let need_rows = self.slots[slot].rows_for(positions).max(self.rows[slot]);
        let need = self.bytes(slot, need_rows);
        if need > budget {
            return Err(KvTooLarge {
                positions,
                rows: alloc_rows(need_rows),
                need,
                budget,
            }
            .into());
        }
        let others = |b: &Batch| {
            (0..b.slots.len())
                .filter(|&i| i != slot)
                .map(|i| b.bytes(i, b.rows[i]))
                .sum::<usize>()
        };
        if others(self) + need > budget {
            // Give idle slots' storage back, largest first, until it fits.
            let mut idle: Vec<usize> = (0..self.slots.len())
                .filter(|&i| i != slot && !running.contains(&i) && self.rows[i] > 0)
                .collect();
            idle.sort_by_key(|&i| std::cmp::Reverse(self.bytes(i, self.rows[i])));
            for i in idle {
                if others(self) + need <= budget {
                    break;
                }
                self.slots[i].release();
                (self.rows[i], self.ghosts[i]) = (0, None);
            }
            if others(self) + need > budget {
                return Ok(Admit::Wait);
            }
        }
        self.rows[slot] = need_rows;
        Ok(Admit::Yes)
    }

    /// Prefill several free slots at once: `(slot, prompt, sampling)` each (distinct slots); each result is
    /// what [`Session::prefill`] gives that slot alone (the first token), the prompts run together in
    /// forwards of up to [`PREFILL_ROWS`] rows where the model can batch them.
    pub fn prefill_many(&mut self, items: &[(usize, &[u32], &crate::sampling::Sampling)]) -> Vec<Result<u32>> {
        let t = std::time::Instant::now();
        let out = self.prefill_many_untimed(items);
        self.times.prefill.add(t);
        out
    }

    fn prefill_many_untimed(&mut self, items: &[(usize, &[u32], &crate::sampling::Sampling)]) -> Vec<Result<u32>> {
        let mut out: Vec<Option<Result<u32>>> = items.iter().map(|_| None).collect();
        let mut ready = Vec::new();
        for (k, &(slot, prompt, s)) in items.iter().enumerate() {
            if slot >= self.slots.len() || items[..k].iter().any(|x| x.0 == slot) {
                out[k] = Some(Err(anyhow::anyhow!(
                    "slot {slot} is not a distinct slot of a batch of {}",
                    self.slots.len()
                )));
                continue;
            }
            match self.slots[slot].prefill_begin(prompt, s) {
                Ok(()) => ready.push(k),
                Err(e) => out[k] = Some(Err(e)),
            }
            self.ghosts[slot] = None;
        }
        // Chunks of up to PREFILL_ROWS prompt rows (at least one prompt each).
        let mut chunks: Vec<Vec<usize>> = Vec::new();
        let mut rows = 0;
        for k in ready {
            let n = items[k].1.len();
            match chunks.last_mut() {
                Some(c) if rows + n <= PREFILL_ROWS => c.push(k),
                _ => {
                    chunks.push(vec![k]);
                    rows = 0;
                }
            }
            rows += n;
        }
        for chunk in chunks {
            let mut alone = Vec::new();
            if let (Some(ops), true) = (self.ops.as_mut(), chunk.len() >= 2) {
                let mut refs: Vec<(usize, &mut Session<'static>)> = self
                    .slots
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| chunk.iter().any(|&k| items[k].0 == *i))
                    .collect();
                refs.sort_by_key(|(i, _)| chunk.iter().position(|&k| items[k].0 == *i));
                let mut batch_items = Vec::new();
                let mut joined = Vec::new();
                for (&k, (_, sess)) in chunk.iter().zip(refs.iter_mut()) {
                    match sess.prefill_item(items[k].1) {
                        Some(it) => {
                            batch_items.push(it);
                            joined.push(k);
                        }
                        None => alone.push(k),
                    }
                }
                if joined.len() >= 2 {
                    let r = ops.prefill(&mut batch_items);
                    drop(batch_items);
                    match r {
                        Ok(logits) => {
                            for (k, l) in joined.iter().zip(logits) {
                                out[*k] = Some(self.slots[items[*k].0].prefill_end(l));
                            }
                        }
                        Err(e) => {
                            let msg = format!("{e:#}");
                            for k in joined {
                                out[k] = Some(Err(anyhow::anyhow!("batched prefill: {msg}")));
                            }
                        }
                    }
                } else {
                    drop(batch_items);
                    alone.extend(joined);
                }
            } else {
                alone = chunk;
            }
            for k in alone {
                let (slot, prompt, s) = items[k];
                out[k] = Some(self.slots[slot].prefill(prompt, s));
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a prefill that never ran"))))
            .collect()
    }

    /// One step of each slot in `active` (distinct; each prefilled and able to step), in one batched step where
    /// the model can; the results in `active`'s order.
    ///
    /// Idle slots that have held a sequence join the batched step as ghosts: rewound to where their sequence
    /// ended before each step, their results dropped. So the batch's composition, and with it the captured
    /// graph of the step, stays the same while sequences finish and start (a new composition would capture
    /// again); the price is the ghosts' rows, at the end of a prompt file only.
    pub fn step(&mut self, active: &[usize]) -> Result<Vec<Emitted>> {
        for (k, &i) in active.iter().enumerate() {
            ensure!(i < self.slots.len(), "slot {i} of a batch of {}", self.slots.len());
            ensure!(!active[..k].contains(&i), "slot {i} twice in one step");
        }
        let mut out: Vec<Option<Emitted>> = vec![None; active.len()];
        let mut alone = Vec::new();
        match self.ops.as_mut() {
            None => alone = (0..active.len()).collect(),
            Some(ops) => {
                // `--budget auto`: one bucket for all, the one that maximizes the batch's expected committed tokens
                // per µs of the batch's round (ddtree::cost::batch_choice_by, each bucket at what it costs the
                // batch now: [`ShapeCosts::round_now`]); before any sequence has a round, the bucket most of them
                // chose (ties: the larger). A feed round for all (budget 0) when its tokens per µs over the
                // batch's rows beat that bucket's, in runs that double while the probe after each run says feed
                // again (ddtree::cost::FeedRuns).
                let autos: Vec<_> = active.iter().filter_map(|&i| self.slots[i].auto_budget()).collect();
                // The rows of the forward: the active sequences and the idle ones that join as ghosts.
                let rows = (0..self.slots.len())
                    .filter(|&i| active.contains(&i) || self.ghosts[i].is_some() || self.slots[i].mark().is_some())
                    .count();
                let auto = if autos.is_empty() {
                    None
                } else {
                    // Outside a run of feed rounds: the best bucket (before any sequence has scores: the bucket
                    // most of them are at, ties the larger), and (unless this round is the probe after a run)
                    // whether a run of feed rounds starts instead. The batch decides for all its sequences, so
                    // a round never mixes feeding and drafting sequences.
                    let mut bucket = 0;
                    if !self.feed.feeding() {
                        let scores: Vec<&[f64]> = autos.iter().map(|a| a.last_scores()).collect();
                        let a = autos[0];
                        // A batch may also draft 1 or 2 nodes a sequence: below the smallest bucket of a sequence
                        // alone, for when the batch's rows make every extra node dear.
                        let mut choices: Vec<usize> =
                            BATCH_SMALL.iter().copied().filter(|&b| b < a.buckets()[0]).collect();
                        choices.extend_from_slice(a.buckets());
                        let cost = a.cost();
                        let round_now = |n: usize| self.costs.round_now(rows, n, cost);
                        let choice = batch_choice_by(&scores, rows, &choices, cost, &round_now);
                        bucket = choice.map_or_else(|| majority(autos.iter().map(|a| a.bucket())), |(b, _)| b);
                        let seqs = scores.len() as f64;
                        match (choice, std::mem::take(&mut self.probe)) {
                            (Some((b, theta)), false) => {
                                let (_, est, feed_us) = self.costs.at(rows, b, cost);
                                // The sequences' realized acceptance over their surrogate's, on average; and what
                                // the batch's drafted rounds realized lately: feeding must beat both.
                                let real = autos.iter().map(|a| a.realized()).sum::<f64>() / autos.len() as f64;
                                let draft = (theta * real).max(self.rate.unwrap_or(0.0));
                                let wins = feed_us.is_some_and(|f| seqs / f >= draft);
                                let sure = scores.len() >= BATCH_SURE;
                                // Probes are spaced by what one costs once its shape replays (its first runs are
                                // paid once, not at every probe).
                                self.feed.decide(wins, est, feed_us.unwrap_or(f64::NAN), sure);
                            }
                            // No sequence has drafted yet (a new batch, or new lines after a run): what the
                            // calibration's rounds promise at these rows decides, as a measured verdict, at the
                            // bucket's steady cost (a batch that has run no round yet cannot spread a first run
                            // over the rounds before it: it would never draft).
                            (None, false) => {
                                if let Some((b, theta)) = cost.prior(rows, scores.len()) {
                                    let (scale, est, feed_us) = self.costs.at(rows, b, cost);
                                    let draft = (theta * scale).max(self.rate.unwrap_or(0.0));
                                    let wins = feed_us.is_some_and(|f| seqs / f >= draft);
                                    self.feed.decide(wins, est, feed_us.unwrap_or(f64::NAN), true);
                                }
                            }
                            (_, true) => {}
                        }
                    }
                    Some(if self.feed.feeding() {
                        self.feed.fed();
                        self.probe = !self.feed.feeding();
                        0
                    } else {
                        bucket
                    })
                };
                // Every slot in index order: the active ones, then idle ones as ghosts.
                let mut items: Vec<BatchItem<'_>> = Vec::new();
                // (slot, position in `active` or None = ghost, start)
                let mut joined: Vec<(usize, Option<usize>, usize)> = Vec::new();
                for (i, s) in self.slots.iter_mut().enumerate() {
                    let k = active.iter().position(|&a| a == i);
                    if k.is_some() {
                        self.ghosts[i] = None;
                    } else {
                        match self.ghosts[i] {
                            Some(m) => s.rewind(m)?,
                            None => match s.mark() {
                                Some(m) => self.ghosts[i] = Some(m),
                                None => continue,
                            },
                        }
                    }
                    let start = s.committed();
                    let Some(mut it) = s.batch_item(auto) else {
                        if let Some(k) = k {
                            alone.push(k);
                        }
                        continue;
                    };
                    if ops.can_batch(&mut it) {
                        items.push(it);
                        joined.push((i, k, start));
                    } else if let Some(k) = k {
                        alone.push(k);
                    }
                }
                let real = joined.iter().filter(|(_, k, _)| k.is_some()).count();
                let budgets: Vec<usize> = items
                    .iter()
                    .filter_map(|it| match it.kind {
                        crate::api::StepKind::Tree(b) => Some(b),
                        _ => None,
                    })
                    .collect();
                let mixed = budgets.contains(&0) && budgets.iter().any(|&b| b > 0);
                if real >= 2 {
                    let t0 = std::time::Instant::now();
                    let results = ops.step(&mut items)?;
                    drop(items);
                    let run = ops.last_run();
                    let mut fastest = None;
                    if let Some(b) = auto {
                        let us = t0.elapsed().as_secs_f64() * 1e6;
                        self.costs.record((joined.len(), b), us, run);
                        fastest = self.costs.steady((joined.len(), b)).filter(|_| b > 0);
                    }
                    let tally = match (self.mode, auto) {
                        (Mode::Ar, _) => &mut self.times.ar,
                        (_, Some(0)) => &mut self.times.feed,
                        _ => &mut self.times.drafted,
                    };
                    tally.add(t0);
                    if !run.steady {
                        self.times.new_shape.add(t0);
                    }
                    ensure!(
                        results.len() == joined.len(),
                        "a batched step gave {} results for {} sequences",
                        results.len(),
                        joined.len()
                    );
                    self.batched_steps += 1;
                    self.feed_steps += usize::from(auto == Some(0));
                    self.mixed_steps += usize::from(mixed);
                    self.batched_slot_steps += real;
                    self.ghost_slot_steps += joined.len() - real;
                    let mut tokens = 0;
                    for ((i, k, start), r) in joined.into_iter().zip(results) {
                        let e = self.slots[i].batched(start, r)?;
                        if let Some(k) = k {
                            tokens += e.tokens.len();
                            out[k] = Some(e);
                        }
                    }
                    if let Some(us) = fastest {
                        // A drafted round: its committed tokens per µs of its shape's steady time.
                        let now = tokens as f64 / us;
                        self.rate = Some(self.rate.map_or(now, |r| (1.0 - REAL_WEIGHT) * r + REAL_WEIGHT * now));
                    }
                } else {
                    // One sequence gains nothing from a batched forward: it steps as a session would.
                    drop(items);
                    alone.extend(joined.iter().filter_map(|(_, k, _)| *k));
                }
            }
        }
        alone.sort_unstable();
        for k in alone {
            let t = std::time::Instant::now();
            let e = self.slots[active[k]].step()?;
            match e.budget {
                0 => self.times.alone_one.add(t),
                _ => self.times.alone_drafted.add(t),
            }
            out[k] = Some(e);
            self.alone_steps += 1;
        }
        out.into_iter().map(|e| e.context("a slot got no step")).collect()
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The most common of `budgets` (ties: the larger); 0 for none.
fn majority(budgets: impl Iterator<Item = usize>) -> usize {
    let mut v: Vec<usize> = budgets.collect();
    v.sort_unstable();
    let mut best: Option<(usize, usize)> = None; // (count, budget)
    for c in v.chunk_by(|a, b| a == b) {
        if best.is_none_or(|(n, _)| c.len() >= n) {
            best = Some((c.len(), c[0]));
        }
    }
    best.map_or(0, |(_, b)| b)
}

/// A batch of at least this many sequences decides for all of them: its first verdict for feeding starts a run
/// at the probe-share floor ([`FeedRuns::decide`]'s `sure`), where one sequence's first verdict feeds one round.
const BATCH_SURE: usize = 4;

/// The budgets below [`crate::ddtree::cost::BUCKETS`] a batch's `--budget auto` may choose (each a round shape of
/// its own, captured once).
const BATCH_SMALL: [usize; 2] = [1, 2];

/// Prompt rows one batched prefill forward takes at most (its activations grow with them).
pub const PREFILL_ROWS: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    fn run(steady: bool, flush_us: f64) -> StepRun {
        StepRun { steady, flush_us }
    }

    fn model() -> CostModel {
        CostModel::from_rounds("test", &[(4, 500.0), (16, 600.0)], String::new())
            .and_then(|m| m.with_feed(300.0))
            .unwrap()
    }

    /// A shape's cost is its fastest steady run less its flush; its first runs (eager, capture) are kept apart
    /// and measure what a new shape costs; until a shape is steady its first runs still to come are charged,
    /// spread over the rounds the batch has run at those rows.
    #[test]
    fn shape_costs_time_steady_runs_and_charge_new_shapes_once() {
        let mut c = ShapeCosts::default();
        let (rows, b) = (4, 16);
        assert_eq!(c.first_runs_left((rows, b)), 2);
        assert_eq!(c.excess(), NEW_SHAPE_EXCESS);
        // The feed shape: an eager run, a capture, then replays (one after a flush of 200 µs).
        c.record((rows, 0), 2100.0, run(false, 0.0));
        c.record((rows, 0), 1500.0, run(false, 0.0));
        assert_eq!(c.steady((rows, 0)), None);
        c.record((rows, 0), 500.0, run(true, 200.0));
        c.record((rows, 0), 310.0, run(true, 0.0));
        assert_eq!(c.steady((rows, 0)), Some(300.0));
        // (mean of 2100 and 1500 − 300) / 300 from the first steady time, 300.
        assert!((c.excess() - 5.0).abs() < 1e-12, "{}", c.excess());
        assert_eq!(c.first_runs_left((rows, 0)), 0);
        // A drafted shape not run yet: its model time (scaled by nothing steady at these rows) and two first
        // runs at 5x, over the 4 steps run at these rows.
        let m = model();
        let (scale, est, feed) = c.at(rows, b, &m);
        assert_eq!((scale, est, feed), (1.0, m.round_us_rows(rows, b), Some(300.0)));
        assert!((c.round_now(rows, b, &m) - est * (1.0 + 2.0 * 5.0 / 4.0)).abs() < 1e-9);
        // Its eager run: one first run left, then steady at 700 µs: no charge, and the model's times at these
        // rows scale to it.
        c.record((rows, b), 9000.0, run(false, 0.0));
        assert_eq!(c.first_runs_left((rows, b)), 1);
        assert!((c.round_now(rows, b, &m) - est * (1.0 + 5.0 / 5.0)).abs() < 1e-9);
        c.record((rows, b), 700.0, run(true, 0.0));
        assert_eq!(c.round_now(rows, b, &m), 700.0);
        let (scale, est8, _) = c.at(rows, 8, &m);
        assert!((scale - m.round_us_rows(rows, b) / 700.0).abs() < 1e-12);
        assert!((est8 - m.round_us_rows(rows, 8) / scale).abs() < 1e-9);
        // Another row count shares nothing but the excess.
        assert_eq!(c.at(8, b, &m).0, 1.0);
        assert_eq!(c.first_runs_left((8, b)), 2);
    }
}
