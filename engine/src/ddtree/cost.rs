//! `--budget auto`: the cost-aware budget of CaDDTree (arXiv 2606.01813; shared reference ddtree.md §4.3).
//! A [`CostModel`] gives the time of a round that drafts n nodes, `C_d + C_v(n + 1)` (µs, measured on one
//! device by timing whole rounds: `kdtree-run calibrate`); [`best_nodes`] is CaDDTree's greedy stop over a
//! tree's popped prefix probabilities; [`AutoBudget`] turns it into the budget of the next round, chosen
//! from fixed buckets (each a captured graph shape on a GPU) one round late, the same on every backend.
//!
//! The rule: with p_1 >= p_2 >= ... the prefix probabilities of the popped nodes (exp of the builder's
//! `log_q`, pop order), θ(n) = (1 + Σ_{i<=n} p_i) / (C_d + C_v(n + 1)) is the expected tokens committed per
//! µs of a round of n nodes (the surrogate acceptance of DDTree Prop. 1 plus the bonus); n* is the first n
//! with θ(n + 1) <= θ(n), or the tree's size when θ never stops rising. CaDDTree proves θ unimodal when
//! C_v is convex, so the greedy stop is the maximum then.
//! A feed round (budget 0: the AR step, whose drafter stashes the root's taps for its context, no draft)
//! commits one token for `feed_us` (measured by calibrate too): when its 1 / C_feed beats the best θ of the
//! last drafted round, the sequence feeds instead of drafting, and drafts again to probe after 1, 2, 4, ... up
//! to [`MAX_FEED_RUN`] feed rounds (a feed round learns nothing about the drafter's acceptance); the runs go on
//! from one sequence to the next. A cost file without `feed_us` never feeds.
//! The JSON form (schema [`COST_SCHEMA`]) is parsed and checked here; the tools own its file.
//! Tests: below; the session's use in engine/tests/generate_tiny_model.rs; the file in kdtree-run.

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

/// Version of the JSON form; a file of another version is refused.
pub const COST_SCHEMA: u32 = 1;

/// The budgets `--budget auto` chooses from (each a captured round shape on a GPU), capped by its max.
pub const BUCKETS: [usize; 7] = [4, 8, 16, 32, 64, 128, 256];

/// The bucket of a sequence's first round (before any tree has been seen).
pub const START_BUCKET: usize = 16;

/// The share of a run's time a probe may cost beyond the feed round it replaces: a run is at least
/// (C_probe − C_feed) / (PROBE_SHARE · C_feed) feed rounds ([`FeedRuns::decide`]).
pub const PROBE_SHARE: f64 = 1.0 / 32.0;

/// The weight of the last drafted round in the running ratio of realized to surrogate tokens
/// ([`AutoBudget::update_seen`]), and the bounds of one round's ratio.
pub const REAL_WEIGHT: f64 = 0.25;
pub const REAL_RANGE: (f64, f64) = (0.125, 8.0);

/// The longest run of feed rounds between two probing (drafting) rounds: a probe that does not pay costs a
/// drafted round instead of a feed round once in this many tokens (on the K2.6 rank-0 slice with 3 layers,
/// where the drafter weighs most, a b4 probe is ~3.4 feed rounds: under 1 % of a run).
pub const MAX_FEED_RUN: usize = 256;

/// Measured round cost on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// [`COST_SCHEMA`].
    pub schema: u32,
    /// The device it was measured on (a slug: "cpu", "cuda-nvidia-h200").
    pub device: String,
    /// The budget-independent part of a round, µs: C_d (calibration: the measured round times extrapolated
    /// to zero drafted nodes, so `C_d + C_v(B + 1)` is the measured round at every bucket B).
    pub draft_us: f64,
    /// (nodes verified, root included; µs) points of C_v, nodes strictly increasing, µs non-decreasing;
    /// linear between points and beyond them (clamped at 0).
    pub verify: Vec<(usize, f64)>,
    /// A feed round (budget 0: the AR step plus the root's taps into the drafter's context, no draft), µs;
    /// None (a file from before feed rounds): `--budget auto` always drafts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feed_us: Option<f64>,
    /// (bucket, committed tokens a round) of the calibration's rounds (greedy, on its prompt): what `--budget
    /// auto` expects of drafting before a sequence has drafted ([`CostModel::prior`]); empty in a file from
    /// before them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<(usize, f64)>,
    /// How it was measured (free text: rounds per point, prompt, context).
    #[serde(default)]
    pub note: String,
}

impl CostModel {
    /// Parse and [`CostModel::check`] the JSON form.
    pub fn from_json(text: &str) -> Result<CostModel> {
        let m: CostModel = serde_json::from_str(text).context("not a cost model (JSON)")?;
        m.check()?;
        Ok(m)
    }

    /// The JSON form (pretty, one point per line pair).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a cost model serializes")
    }

    /// The invariants the rule relies on; the message names the first broken one.
    pub fn check(&self) -> Result<()> {
        ensure!(
            self.schema == COST_SCHEMA,
            "cost model schema {} (this build reads schema {COST_SCHEMA}; recalibrate)",
            self.schema
        );
        ensure!(!self.device.is_empty(), "cost model: empty device");
        ensure!(
            self.draft_us.is_finite() && self.draft_us >= 0.0,
            "cost model: draft_us {} is not a finite time >= 0",
            self.draft_us
        );
        ensure!(!self.verify.is_empty(), "cost model: no verify points");
        for (i, &(n, us)) in self.verify.iter().enumerate() {
            ensure!(n >= 1, "cost model: verify[{i}] has {n} nodes (at least the root)");
            ensure!(
                us.is_finite() && us >= 0.0,
                "cost model: verify[{i}] = {us} µs is not a finite time >= 0"
            );
            if i > 0 {
                let (pn, pus) = self.verify[i - 1];
                ensure!(n > pn, "cost model: verify nodes must increase: {pn} then {n}");
                ensure!(
                    us >= pus,
                    "cost model: verify cost must not fall: {pus} µs at {pn} nodes, {us} µs at {n}"
                );
            }
        }
        ensure!(
            self.round_us(0) > 0.0,
            "cost model: a round of 0 drafted nodes costs {} µs (must be > 0)",
            self.round_us(0)
        );
        if let Some(f) = self.feed_us {
            ensure!(
                f.is_finite() && f > 0.0,
                "cost model: feed_us {f} is not a finite time > 0"
            );
        }
        for (i, &(b, t)) in self.tokens.iter().enumerate() {
            ensure!(b >= 1, "cost model: tokens[{i}] is for a budget of {b} (at least 1)");
            ensure!(
                t.is_finite() && t >= 1.0,
                "cost model: tokens[{i}] = {t} tokens a round (a round commits at least its bonus token)"
            );
        }
        Ok(())
    }

    /// The model with the calibration's committed tokens a round at each bucket, checked.
    pub fn with_tokens(self, tokens: Vec<(usize, f64)>) -> Result<CostModel> {
        let m = CostModel { tokens, ..self };
        m.check()?;
        Ok(m)
    }

    /// What drafting promises before any round of `seqs` sequences in a forward of `rows` rows: the calibrated
    /// bucket with the most expected tokens per µs (`seqs` × its tokens a round over
    /// [`CostModel::round_us_rows`]) and that rate; None without calibrated tokens.
    pub fn prior(&self, rows: usize, seqs: usize) -> Option<(usize, f64)> {
        let rows = rows.max(seqs).max(1);
        self.tokens
            .iter()
            .map(|&(b, t)| (b, seqs as f64 * t / self.round_us_rows(rows, b)))
            .fold(None, |best: Option<(usize, f64)>, (b, th)| match best {
                Some((_, bt)) if bt >= th => best,
                _ => Some((b, th)),
            })
    }

    /// The model with the measured feed round `us` (µs), checked.
    pub fn with_feed(self, us: f64) -> Result<CostModel> {
        let m = CostModel {
            feed_us: Some((us * 1e3).round() / 1e3),
            ..self
        };
        m.check()?;
        Ok(m)
    }

    /// A feed round of `rows` sequences in one forward, µs: the measured feed round with the verify of the
    /// other rows added (C_v(rows) − C_v(1)); None without a measured feed round.
    pub fn feed_round_us(&self, rows: usize) -> Option<f64> {
        let extra = (self.verify_us(rows.max(1)) - self.verify_us(1)).max(0.0);
        self.feed_us.map(|f| f + extra)
    }

    /// C_v of a tree of `nodes` nodes (root included), µs: linear between the points, extended linearly past
    /// both ends, never below 0; one point = flat.
    pub fn verify_us(&self, nodes: usize) -> f64 {
        let v = &self.verify;
        let x = nodes as f64;
        if v.len() == 1 {
            return v[0].1;
        }
        // The segment [i, i+1] holding x, or the first / last one outside the points.
        let i = v.windows(2).position(|w| x <= w[1].0 as f64).unwrap_or(v.len() - 2);
        let ((x0, y0), (x1, y1)) = ((v[i].0 as f64, v[i].1), (v[i + 1].0 as f64, v[i + 1].1));
        (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
    }

    /// A whole round that drafts `n` nodes: `C_d + C_v(n + 1)`, µs.
    pub fn round_us(&self, n: usize) -> f64 {
        self.draft_us + self.verify_us(n + 1)
    }
    /// A batched round of `rows` sequences with `n` drafted nodes each: [`CostModel::round_us`] with every
    /// sequence's nodes and root in the one verify forward.
    pub fn round_us_rows(&self, rows: usize, n: usize) -> f64 {
        self.draft_us + self.verify_us(rows.max(1) * (n + 1))
    }

    /// The model of measured round times `(budget, µs)` (budgets strictly increasing): C_d = the round time
    /// extrapolated to 0 drafted nodes through the first two points, clamped to [0.05, 0.95] × the first round
    /// (a round always drafts, and noise can tilt the line either way: no slower second round puts all of the
    /// first round in C_d and none in its verify; a much slower one meets 0 nodes below zero, and C_v extended
    /// down from the first point would make a round of 0 nodes free; with one point, 0.05 × it), C_v(B + 1) =
    /// round(B) − C_d made non-decreasing (a running max: timing noise must not make a larger tree look
    /// cheaper), so every verify cost is > 0 and a round costs at least C_d > 0.
    pub fn from_rounds(device: &str, rounds: &[(usize, f64)], note: String) -> Result<CostModel> {
        ensure!(!rounds.is_empty(), "no measured rounds");
        let (b0, t0) = rounds[0];
        let draft = match rounds.get(1) {
            Some(&(b1, t1)) => (t0 - b0 as f64 * (t1 - t0) / (b1 as f64 - b0 as f64)).clamp(0.05 * t0, 0.95 * t0),
            None => 0.05 * t0,
        };
        let ns = |x: f64| (x * 1e3).round() / 1e3; // to the nanosecond: a readable file, no float residue
        let mut top = 0.0f64;
        let verify = rounds
            .iter()
            .map(|&(b, t)| {
                top = top.max(ns(t - draft));
                (b + 1, top)
            })
            .collect();
        let m = CostModel {
            schema: COST_SCHEMA,
            device: device.to_string(),
            draft_us: ns(draft),
            verify,
            feed_us: None,
            tokens: Vec::new(),
            note,
        };
        m.check()?;
        Ok(m)
    }
}

/// CaDDTree's greedy stop: the number of popped nodes (prefix log-probs `log_q`, pop order) that maximizes
/// θ(n) = (1 + Σ_{i<=n} exp(log_q_i)) / round_us(n) under `cost`, found as the first n with θ(n + 1) <= θ(n)
/// (at most `log_q.len()`). A NaN score counts as probability 0 (as the builder counts it as -inf).
pub fn best_nodes(log_q: &[f64], cost: &CostModel) -> usize {
    best_theta(log_q, cost).0
}

/// [`best_nodes`] and θ there: the expected tokens per µs of a round of that many nodes.
pub fn best_theta(log_q: &[f64], cost: &CostModel) -> (usize, f64) {
    let mut phi = 1.0; // the bonus token always commits
    let mut theta = phi / cost.round_us(0);
    for (n, &lq) in log_q.iter().enumerate() {
        let p = lq.exp();
        let next_phi = phi + if p.is_nan() { 0.0 } else { p };
        let next = next_phi / cost.round_us(n + 1);
        if next <= theta || next.is_nan() {
            return (n, theta);
        }
        (phi, theta) = (next_phi, next);
    }
    (log_q.len(), theta)
}

/// One budget for all sequences of a batched round in auto mode (`--budget auto --max-batch N`): the bucket that
/// maximizes the batch's expected committed tokens per µs,
/// θ(B) = Σ_s (1 + Σ_{j < B} p_s,j) / (C_d + C_v(rows × (B + 1))),
/// where p_s,j are sequence s's popped-node probabilities of its last round (`scores`, pop order; a sequence
/// without a round yet adds its bonus token only) and `rows` is the number of sequences the forward holds. So
/// the verify cost is that of the batch's total rows: as the batch grows, a node must beat the batch's tokens
/// per µs to be drafted, and the budget falls towards AR's one row per sequence when the measured verify cost
/// per row climbs. Buckets up to the largest tree seen are weighed with what was seen; when the best of them is
/// that largest tree and its last node still paid off, the next larger bucket is tried (as [`AutoBudget`]
/// grows a tree that was too small to stop). None when no sequence has a round yet.
pub fn batch_bucket(scores: &[&[f64]], rows: usize, buckets: &[usize], cost: &CostModel) -> Option<usize> {
    batch_choice(scores, rows, buckets, cost).map(|(b, _)| b)
}

/// [`batch_bucket`] and the batch's θ there (expected committed tokens per µs of the batch's round).
pub fn batch_choice(scores: &[&[f64]], rows: usize, buckets: &[usize], cost: &CostModel) -> Option<(usize, f64)> {
    let rows_ = rows.max(scores.len()).max(1);
    batch_choice_by(scores, rows, buckets, cost, &|n| cost.round_us_rows(rows_, n))
}

/// [`batch_choice`] with the buckets weighed by `round_us(b)`, what a round at bucket b costs the batch (µs:
/// its measured time where it has one, and what a shape it has not captured yet costs first); whether the
/// largest tree seen grows past itself is still the model's call (a tree too small to stop).
pub fn batch_choice_by(
    scores: &[&[f64]],
    rows: usize,
    buckets: &[usize],
    cost: &CostModel,
    round_us: &dyn Fn(usize) -> f64,
) -> Option<(usize, f64)> {
    let seen = scores.iter().map(|s| s.len()).max().filter(|&n| n > 0)?;
    let p = |lq: f64| {
        let p = lq.exp();
        if p.is_nan() {
            0.0
        } else {
            p
        }
    };
    let rows = rows.max(scores.len()).max(1);
    let tokens = |n: usize| -> f64 {
        scores
            .iter()
            .map(|s| 1.0 + s.iter().take(n).map(|&q| p(q)).sum::<f64>())
            .sum()
    };
    let theta = |n: usize| tokens(n) / round_us(n);
    let model = |n: usize| tokens(n) / cost.round_us_rows(rows, n);
    let known: Vec<usize> = buckets.iter().copied().filter(|&b| b <= seen).collect();
    let Some(&first) = known.first() else {
        return buckets.first().map(|&b| (b, theta(b)));
    };
    let best = known
        .iter()
        .copied()
        .fold(first, |a, b| if theta(b) > theta(a) { b } else { a });
    let grows = best == seen && model(seen) > model(seen - 1);
    Some(match buckets.iter().find(|&&b| b > best) {
        Some(&next) if grows => (next, theta(best)),
        _ => (best, theta(best)),
    })
}

/// Whether a feed round of the batch (`seqs` sequences, each committing one token, in a forward of `rows`
/// rows) beats `theta`, the batch's best drafted round ([`batch_choice`]); false without a measured feed round.
pub fn batch_feeds(seqs: usize, rows: usize, theta: f64, cost: &CostModel) -> bool {
    cost.feed_round_us(rows.max(seqs).max(1))
        .is_some_and(|f| seqs as f64 / f >= theta)
}

/// Runs of feed rounds between probing rounds, for one sequence or a batch: a run of `run` feed rounds when
/// feeding wins after a drafted round, doubling (up to [`MAX_FEED_RUN`]) each time it wins again after the
/// probe, back to 1 when drafting wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedRuns {
    /// Feed rounds left in the current run (0: the next round drafts).
    pub left: usize,
    /// The next run's length.
    pub run: usize,
}

impl Default for FeedRuns {
    fn default() -> FeedRuns {
        FeedRuns { left: 0, run: 1 }
    }
}

impl FeedRuns {
    /// After a drafted round that took `probe_us` where a feed round takes `feed_us`: whether feeding won;
    /// starts a run (or ends the doubling). A first win feeds one round (one round's scores may be a bad
    /// position of a drafter that pays) unless the verdict is `sure`; from the second win in a row (or a sure
    /// first) the run is long enough that the next probe costs at most [`PROBE_SHARE`] of it beyond a feed
    /// round, and no longer than [`MAX_FEED_RUN`].
    pub fn decide(&mut self, feed_wins: bool, probe_us: f64, feed_us: f64, sure: bool) {
        if feed_wins {
            let least = ((probe_us - feed_us) / (PROBE_SHARE * feed_us)).ceil();
            let least = if least.is_finite() {
                least.clamp(1.0, MAX_FEED_RUN as f64) as usize
            } else {
                1
            };
            self.left = if self.run == 1 && !sure { 1 } else { self.run.max(least) };
            self.run = (2 * self.left).min(MAX_FEED_RUN);
        } else {
            *self = FeedRuns::default();
        }
    }
    /// Whether the next round feeds.
    pub fn feeding(&self) -> bool {
        self.left > 0
    }
    /// After a feed round.
    pub fn fed(&mut self) {
        self.left = self.left.saturating_sub(1);
    }
}

/// The budgets [`AutoBudget`] chooses from under a cap `max` (>= 1): the [`BUCKETS`] below it, then `max`.
pub fn buckets(max: usize) -> Vec<usize> {
    let mut b: Vec<usize> = BUCKETS.iter().copied().filter(|&b| b < max).collect();
    b.push(max);
    b
}

/// The budget of each round of one session in auto mode, chosen one round late: round r runs at bucket
/// B_r; from round r's popped-node scores, n* = [`best_nodes`]; B_{r+1} = the smallest bucket >= n* when the
/// rule stopped inside the tree (n* < B_r), else the next larger bucket (the tree was too small to stop).
/// Each sequence starts at [`START_BUCKET`] (or the largest bucket below it). With a measured feed round
/// ([`CostModel::feed_us`]): when 1 / C_feed >= the larger of θ(n*) × [`AutoBudget::realized`] and the drafted
/// rounds' recent tokens per µs ([`AutoBudget::rate`]), the next rounds feed (budget 0) instead, `run` of them,
/// then one drafts at B_{r+1} to probe; `run` doubles (up to [`MAX_FEED_RUN`]) each time a probe says feed
/// again and is back to 1 when drafting wins.
#[derive(Debug, Clone)]
pub struct AutoBudget {
    cost: CostModel,
    buckets: Vec<usize>,
    /// Index of the next drafting round's bucket.
    at: usize,
    /// The popped nodes' scores of this sequence's last drafted round (empty before its first): what
    /// [`batch_bucket`] weighs.
    last: Vec<f64>,
    /// The feed rounds' runs.
    feed: FeedRuns,
    /// The drafted rounds' committed tokens over their surrogate's (1 + Σ p over the popped nodes), a running
    /// average (1 before any): how far the drafter's own probabilities under- or overstate what it gets
    /// accepted. It scales θ where feeding and drafting are weighed.
    real: f64,
    /// The drafted rounds' committed tokens per µs of their modelled cost, a running average with the same
    /// weight (None before any): what drafting has realized lately. A feed round must beat it too.
    rate: Option<f64>,
}

impl AutoBudget {
    pub fn new(max: usize, cost: CostModel) -> Result<AutoBudget> {
        if max == 0 {
            bail!("--budget-max must be at least 1");
        }
        cost.check()?;
        let buckets = buckets(max);
        let mut a = AutoBudget {
            cost,
            buckets,
            at: 0,
            last: Vec::new(),
            feed: FeedRuns::default(),
            real: 1.0,
            rate: None,
        };
        a.restart();
        // Before any round: feeding from the start where the calibration's best drafted round commits fewer
        // tokens per µs than a feed round (a measured verdict: its run starts at the probe-share floor).
        if let (Some((b, theta)), Some(feed)) = (a.cost.prior(1, 1), a.cost.feed_us) {
            a.feed
                .decide(batch_feeds(1, 1, theta, &a.cost), a.cost.round_us(b), feed, true);
        }
        Ok(a)
    }
    /// A new sequence: back to the start bucket. The feed runs go on: the last sequence's probes are the
    /// best guess for this one (the same pair), so a run in progress continues and the run length stays;
    /// the first probe where drafting pays ends them.
    pub fn restart(&mut self) {
        self.at = self.buckets.iter().rposition(|&b| b <= START_BUCKET).unwrap_or(0);
        self.last.clear();
    }
    /// The popped nodes' scores of this sequence's last round (empty before its first).
    pub fn last_scores(&self) -> &[f64] {
        &self.last
    }
    /// The running ratio of realized to surrogate tokens of the drafted rounds (1 before any).
    pub fn realized(&self) -> f64 {
        self.real
    }
    /// The running average of the drafted rounds' committed tokens per µs (None before any).
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
    /// After a drafted round whose popped nodes scored `log_q` and that committed `tokens` tokens (the bonus
    /// included): its ratio of `tokens` to the surrogate's 1 + Σ p enters [`AutoBudget::realized`], its tokens
    /// per µs of a round of that many nodes [`AutoBudget::rate`], then [`AutoBudget::update`]. A feed round
    /// (`log_q` empty) is [`AutoBudget::update`] alone.
    pub fn update_seen(&mut self, log_q: &[f64], tokens: usize) -> usize {
        if !log_q.is_empty() {
            let expected = 1.0 + log_q.iter().map(|&q| q.exp()).filter(|p| p.is_finite()).sum::<f64>();
            let r = (tokens as f64 / expected).clamp(REAL_RANGE.0, REAL_RANGE.1);
            self.real = (1.0 - REAL_WEIGHT) * self.real + REAL_WEIGHT * r;
            let now = tokens as f64 / self.cost.round_us(log_q.len());
            self.rate = Some(self.rate.map_or(now, |a| (1.0 - REAL_WEIGHT) * a + REAL_WEIGHT * now));
        }
        self.update(log_q)
    }
    /// The bucket the next drafted round takes (whether or not the next round feeds).
    pub fn bucket(&self) -> usize {
        self.buckets[self.at]
    }
    /// This round's budget: 0 for a feed round.
    pub fn budget(&self) -> usize {
        if self.feed.feeding() {
            0
        } else {
            self.buckets[self.at]
        }
    }
    /// Whether this round feeds (budget 0).
    pub fn feeding(&self) -> bool {
        self.feed.feeding()
    }
    pub fn buckets(&self) -> &[usize] {
        &self.buckets
    }
    pub fn cost(&self) -> &CostModel {
        &self.cost
    }
    /// After a round whose popped nodes scored `log_q` (empty: a feed round, or a drafted round of no nodes):
    /// set the next round's budget; returns n* (0 after a feed round).
    pub fn update(&mut self, log_q: &[f64]) -> usize {
        if log_q.is_empty() {
            // A feed round: one fewer before the probe (the last drafted round's scores stay).
            self.feed.fed();
            return 0;
        }
        self.last.clear();
        self.last.extend_from_slice(log_q);
        let (n, theta) = best_theta(log_q, &self.cost);
        self.at = if n < self.buckets[self.at] {
            self.buckets.iter().position(|&b| b >= n).unwrap_or(self.at)
        } else {
            (self.at + 1).min(self.buckets.len() - 1)
        };
        // The next probe drafts at the bucket just chosen.
        let (probe, feed) = (
            self.cost.round_us(self.buckets[self.at]),
            self.cost.feed_us.unwrap_or(f64::NAN),
        );
        // Feeding must beat both this round's promise (θ at n*, scaled by the realized ratio) and what the drafted
        // rounds realized lately: one weak round's scores do not start a run where drafting pays on average.
        let draft = (theta * self.real).max(self.rate.unwrap_or(0.0));
        self.feed
            .decide(batch_feeds(1, 1, draft, &self.cost), probe, feed, false);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round time = `fixed` + `per_node` × nodes verified (root included).
    fn linear(fixed: f64, per_node: f64) -> CostModel {
        CostModel {
            schema: COST_SCHEMA,
            device: "test".into(),
            draft_us: fixed,
            verify: vec![(1, per_node), (257, 257.0 * per_node)],
            feed_us: None,
            tokens: Vec::new(),
            note: String::new(),
        }
    }

    fn logs(p: &[f64]) -> Vec<f64> {
        p.iter().map(|x| x.ln()).collect()
    }

    /// θ(n) over every n, by the definition (the slow form of the rule).
    fn argmax_theta(p: &[f64], c: &CostModel) -> usize {
        let theta = |n: usize| (1.0 + p[..n].iter().sum::<f64>()) / c.round_us(n);
        (0..=p.len()).fold(0, |best, n| if theta(n) > theta(best) { n } else { best })
    }

    #[test]
    fn unimodal_scores_stop_at_the_maximum_of_theta() {
        // Fixed cost 100, 1 per node: a node pays off while p_i > θ·1, i.e. while p_i beats the tokens per µs
        // so far. Geometric p_i = 0.8^i: θ rises then falls once.
        let c = linear(100.0, 1.0);
        let p: Vec<f64> = (1..=200).map(|i| 0.8f64.powi(i)).collect();
        let n = best_nodes(&logs(&p), &c);
        assert_eq!(n, argmax_theta(&p, &c));
        // By hand: θ(n) = (1 + Σ) / (101 + n) rises while the next p beats it: p_14 = 0.8^14 = 0.0440 >
        // θ(13) = 0.0419, p_15 = 0.0352 < θ(14) = 0.0419: the stop is inside, at 14.
        assert_eq!(n, 14);
    }

    #[test]
    fn flat_scores_and_flat_cost() {
        // Every node equally likely: with a rising cost, θ = (1 + n p) / (a + n) rises forever when p > 1/a.
        let c = linear(100.0, 1.0);
        assert_eq!(best_nodes(&logs(&[0.5; 40]), &c), 40, "p = 0.5 > θ: take every node");
        assert_eq!(
            best_nodes(&logs(&[0.001; 40]), &c),
            0,
            "p = 0.001 < θ(0) = 1/101: take none"
        );
        // A free verify (flat cost) takes every node with p > 0, none with p = 0.
        let flat = CostModel {
            verify: vec![(1, 5.0)],
            ..linear(100.0, 0.0)
        };
        assert_eq!(best_nodes(&logs(&[0.3, 0.2, 0.1]), &flat), 3);
        assert_eq!(best_nodes(&[f64::NEG_INFINITY, f64::NAN], &flat), 0);
    }

    #[test]
    fn all_ones_take_the_whole_tree_and_the_cap_holds() {
        // p = 1: each node adds one token for one µs on top of a 10 µs round, θ → 1 from below: never stops,
        // so n* is the tree's size (the budget cap).
        let c = linear(10.0, 1.0);
        for n in [0usize, 1, 7, 256] {
            assert_eq!(best_nodes(&vec![0.0; n], &c), n);
        }
    }

    #[test]
    fn verify_cost_interpolates_and_extrapolates() {
        let c = CostModel {
            verify: vec![(5, 10.0), (9, 30.0), (17, 30.0), (33, 62.0)],
            ..linear(3.0, 0.0)
        };
        assert_eq!(c.verify_us(5), 10.0);
        assert_eq!(c.verify_us(7), 20.0);
        assert_eq!(c.verify_us(12), 30.0);
        assert_eq!(
            c.verify_us(65),
            126.0,
            "past the last point: the last slope, 2 per node"
        );
        assert_eq!(c.verify_us(3), 0.0, "before the first: the first slope, clamped at 0");
        assert_eq!(c.round_us(8), 33.0);
        let mut last = 0.0;
        for n in 1..100 {
            assert!(c.verify_us(n) >= last, "monotone at {n}");
            last = c.verify_us(n);
        }
    }

    #[test]
    fn from_rounds_reproduces_the_measured_rounds() {
        let rounds = [(4, 120.0), (8, 140.0), (16, 130.0), (32, 260.0)];
        let c = CostModel::from_rounds("cpu", &rounds, "t".into()).unwrap();
        assert_eq!(
            c.draft_us, 100.0,
            "the line through (4, 120) and (8, 140) meets 0 nodes at 100"
        );
        assert_eq!(c.round_us(4), 120.0);
        assert_eq!(c.round_us(8), 140.0);
        assert_eq!(c.round_us(16), 140.0, "noise made 16 cheaper than 8: held at 8's cost");
        assert_eq!(c.round_us(32), 260.0);
        let back = CostModel::from_json(&c.to_json()).unwrap();
        assert_eq!(back, c, "JSON round trip");
    }

    /// Noise once made the second measured round faster than the first (seen in `auto_cli` on a loaded
    /// machine): the line through them met 0 nodes above the first round, C_d was clamped to all of it, C_v = 0
    /// and `calibrate` refused its own model.
    #[test]
    fn noisy_rounds_still_give_a_valid_model() {
        for rounds in [[(4, 120.0), (8, 110.0)], [(4, 120.0), (8, 120.0)], [(1, 5.0), (2, 1.0)]] {
            let c = CostModel::from_rounds("cpu", &rounds, "t".into()).unwrap();
            assert!((c.draft_us - 0.95 * rounds[0].1).abs() < 1e-9, "{rounds:?}");
            assert!(c.verify_us(rounds[0].0 + 1) > 0.0, "{rounds:?}");
            assert!((c.round_us(rounds[0].0) - rounds[0].1).abs() < 1e-9, "{rounds:?}");
        }
    }

    /// The other tilt (CI, 2026-12-03, `auto_cli` on a loaded 2-core machine): the second round far slower than
    /// the first, so the line met 0 nodes below zero, C_d was clamped to 0, C_v extended down from the first
    /// point reached 0 at one node, and `calibrate` refused its own model ("a round of 0 drafted nodes costs 0
    /// µs"). C_d now keeps at least 5 % of the first round.
    #[test]
    fn steep_noisy_rounds_still_give_a_valid_model() {
        let measured = [(4, 19258.9), (8, 43281.9), (16, 67393.0)];
        for rounds in [&measured[..], &[(4, 100.0), (8, 300.0)], &[(4, 50.0)]] {
            let c = CostModel::from_rounds("cpu", rounds, "t".into()).unwrap();
            assert!((c.draft_us - 0.05 * rounds[0].1).abs() < 1e-9, "{rounds:?}: {c:?}");
            assert!(c.round_us(0) > 0.0, "{rounds:?}");
            for &(b, t) in rounds {
                assert!((c.round_us(b) - t).abs() < 1e-6, "{rounds:?}: round {b}");
            }
            CostModel::from_json(&c.to_json()).unwrap();
        }
    }

    #[test]
    fn bad_models_are_refused_with_the_reason() {
        let good = linear(1.0, 1.0);
        let bad = |f: &dyn Fn(&mut CostModel), want: &str| {
            let mut m = good.clone();
            f(&mut m);
            let e = format!("{:#}", CostModel::from_json(&m.to_json()).unwrap_err());
            assert!(e.contains(want), "{e}");
        };
        bad(&|m| m.schema = 2, "schema 2");
        bad(&|m| m.verify = vec![], "no verify points");
        bad(&|m| m.verify = vec![(3, 1.0), (3, 2.0)], "must increase");
        bad(&|m| m.verify = vec![(3, 2.0), (5, 1.0)], "must not fall");
        bad(&|m| m.draft_us = -1.0, "draft_us");
        bad(&|m| (m.draft_us, m.verify) = (0.0, vec![(1, 0.0)]), "must be > 0");
        for text in [
            "",
            "{",
            "[]",
            r#"{"schema":1}"#,
            &good.to_json().replace("\"note\"", "\"extra\": 1, \"note\""),
        ] {
            assert!(CostModel::from_json(text).is_err(), "{text}");
        }
    }

    /// The batch's bucket: with a cheap verify, confident drafts keep their trees; as the verify cost per row
    /// climbs (or the batch grows), the bucket falls to the smallest; a batch that has seen only small trees
    /// whose last node still pays grows by one bucket; no rounds yet: None.
    #[test]
    fn the_batch_bucket_weighs_the_batch_rows() {
        let bs = buckets(64);
        let confident = logs(&(1..=16).map(|i| 0.95f64.powi(i)).collect::<Vec<_>>());
        let weak = logs(&(1..=16).map(|i| 0.3f64.powi(i)).collect::<Vec<_>>());
        // Fixed cost 1000 µs, 1 µs a row: one confident sequence grows past the 16 nodes it has seen.
        let cheap = linear(1000.0, 1.0);
        assert_eq!(batch_bucket(&[&confident], 1, &bs, &cheap), Some(32));
        // The same draft when a row costs 10x the fixed part: the smallest bucket.
        let dear = linear(100.0, 1000.0);
        assert_eq!(batch_bucket(&[&confident], 1, &bs, &dear), Some(4));
        // 64 sequences of weak drafts at 1 µs a row: every extra node costs 64 rows.
        let many: Vec<&[f64]> = vec![&weak[..]; 64];
        assert_eq!(batch_bucket(&many, 64, &bs, &cheap), Some(4));
        // The slow form: the chosen bucket maximizes θ among the buckets weighed (those up to the 16 nodes
        // seen); a bucket past them means 16 was the best and its last node still paid off.
        let theta = |b: usize, s: &[&[f64]], rows: usize, c: &CostModel| {
            let t: f64 = s
                .iter()
                .map(|s| 1.0 + s[..b.min(s.len())].iter().map(|q| q.exp()).sum::<f64>())
                .sum();
            t / c.round_us_rows(rows, b)
        };
        let mixed: Vec<&[f64]> = vec![&confident[..], &weak[..], &confident[..], &weak[..]];
        for (c, rows) in [
            (linear(500.0, 4.0), 4),
            (linear(500.0, 40.0), 4),
            (linear(50.0, 1.0), 16),
        ] {
            let b = batch_bucket(&mixed, rows, &bs, &c).unwrap();
            let weighed = b.min(16);
            for other in [4, 8, 16] {
                assert!(
                    theta(weighed, &mixed, rows, &c) >= theta(other, &mixed, rows, &c),
                    "{b} vs {other}"
                );
            }
            if b > 16 {
                assert!(theta(16, &mixed, rows, &c) > theta(15, &mixed, rows, &c));
            }
        }
        // Sequences without a round add their bonus token only; none with a round: None.
        assert_eq!(batch_bucket(&[&[], &[]], 2, &bs, &cheap), None);
        let fresh: Vec<&[f64]> = vec![&confident[..], &[]];
        assert!(batch_bucket(&fresh, 2, &bs, &cheap).is_some());
    }

    /// Weighed by the batch's own costs: a bucket that costs more than the model says (its measured time, or
    /// a first capture on top) loses to the next best; the same costs as the model give batch_choice's answer.
    #[test]
    fn the_batch_choice_weighs_the_batch_own_round_costs() {
        let bs = buckets(64);
        let confident = logs(&(1..=16).map(|i| 0.9f64.powi(i)).collect::<Vec<_>>());
        let four: Vec<&[f64]> = vec![&confident[..]; 4];
        let c = linear(200.0, 2.0);
        let model = |n: usize| c.round_us_rows(4, n);
        let plain = batch_choice(&four, 4, &bs, &c).unwrap();
        assert_eq!(batch_choice_by(&four, 4, &bs, &c, &model), Some(plain));
        let b = plain.0.min(16);
        assert!(b > 4, "{plain:?}");
        // The chosen bucket's shape not captured yet: its round costs 10x once more, amortized over one round.
        let dear = |n: usize| if n == b { 11.0 * model(n) } else { model(n) };
        let (other, theta) = batch_choice_by(&four, 4, &bs, &c, &dear).unwrap();
        assert_ne!(other, b);
        let tokens = |n: usize| 4.0 * (1.0 + confident[..n].iter().map(|q| q.exp()).sum::<f64>());
        assert!((theta - tokens(other) / model(other)).abs() <= 1e-12 * theta, "{theta}");
    }

    #[test]
    fn buckets_follow_the_rule_one_round_late() {
        assert_eq!(buckets(256), BUCKETS.to_vec());
        assert_eq!(buckets(100), vec![4, 8, 16, 32, 64, 100]);
        assert_eq!(buckets(3), vec![3]);
        let c = linear(100.0, 1.0);
        let mut a = AutoBudget::new(64, c.clone()).unwrap();
        assert_eq!(a.budget(), 16);
        // A tree that never stops: grow one bucket per round, up to the cap.
        for want in [32, 64, 64] {
            let b = a.budget();
            assert_eq!(a.update(&vec![0.0; b]), b);
            assert_eq!(a.budget(), want);
        }
        // Stops at 14 inside a 64 tree: the smallest bucket holding 14.
        let p: Vec<f64> = (1..=64).map(|i| 0.8f64.powi(i).ln()).collect();
        assert_eq!(a.update(&p), 14);
        assert_eq!(a.budget(), 16);
        // Hopeless scores: n* = 0 -> the smallest bucket; a tree smaller than its bucket that never stopped
        // (n* = its size < the bucket) -> the smallest bucket holding it.
        assert_eq!(a.update(&[-20.0; 16]), 0);
        assert_eq!(a.budget(), 4);
        a.update(&[0.0; 4]);
        assert_eq!(a.budget(), 8);
        a.update(&[0.0; 5]);
        assert_eq!(a.budget(), 8);
        a.restart();
        assert_eq!(a.budget(), 16);
        assert_eq!(AutoBudget::new(8, c.clone()).unwrap().budget(), 8);
        assert!(AutoBudget::new(0, c).is_err());
    }

    #[test]
    fn feed_rounds_run_where_drafting_does_not_pay_and_probes_back_off() {
        // Fixed cost 100, 1 a node; a feed round 50: 1/50 beats any θ below 0.02.
        let c = linear(100.0, 1.0).with_feed(50.0).unwrap();
        assert_eq!(c.feed_round_us(1), Some(50.0));
        // A batch of 4 rows pays 3 more rows of verify.
        assert_eq!(c.feed_round_us(4), Some(53.0));
        assert_eq!(linear(100.0, 1.0).feed_round_us(1), None);
        let mut a = AutoBudget::new(64, c.clone()).unwrap();
        assert_eq!((a.budget(), a.feeding()), (16, false));
        // Hopeless scores: θ(0) = 1/101 < 1/50: feed one round, then probe at the smallest bucket.
        let hopeless = [-20.0; 16];
        assert_eq!(a.update(&hopeless), 0);
        assert_eq!((a.budget(), a.feeding()), (0, true));
        assert_eq!(a.update(&[]), 0);
        assert_eq!(a.budget(), 4, "the probe drafts at the bucket the rule chose");
        // Each probe that says feed again: a run long enough that the probe (a round of 4 nodes) costs
        // PROBE_SHARE of it beyond a feed round (36 rounds), then doubling up to MAX_FEED_RUN.
        let least = ((c.round_us(4) - 50.0) / (PROBE_SHARE * 50.0)).ceil() as usize;
        assert_eq!(least, 36);
        let mut runs = Vec::new();
        for _ in 0..5 {
            a.update(&hopeless[..a.budget()]);
            let mut n = 0;
            while a.feeding() {
                assert_eq!(a.budget(), 0);
                a.update(&[]);
                n += 1;
            }
            runs.push(n);
        }
        assert_eq!(runs, vec![36, 72, 144, 256, 256]);
        // A new sequence goes on with the run in progress.
        a.update(&hopeless[..a.budget()]);
        a.update(&[]);
        a.restart();
        assert_eq!((a.budget(), a.feeding()), (0, true));
        while a.feeding() {
            a.update(&[]);
        }
        // The probe drafts at the start bucket (16). One where drafting pays (4 certain nodes, then hopeless
        // ones: θ(4) = 5/105 > 1/50) drafts on at the smallest bucket holding them, and the next hopeless
        // probe feeds one round again.
        assert_eq!(a.budget(), 16);
        let four: Vec<f64> = [0.0; 4].iter().chain(&hopeless[..12]).copied().collect();
        assert_eq!(a.update(&four), 4);
        assert_eq!((a.budget(), a.feeding()), (4, false));
        a.update(&hopeless[..4]);
        assert!(a.feeding());
        a.update(&[]);
        assert!(!a.feeding(), "the run was back to 1");
        // The last drafted round's scores stay through the feed rounds (what a batch weighs).
        assert_eq!(a.last_scores(), &hopeless[..4]);
        a.restart();
        assert_eq!((a.budget(), a.feeding(), a.last_scores().len()), (16, false, 0));
        // Without a measured feed round, hopeless scores keep drafting at the smallest bucket.
        let mut a = AutoBudget::new(64, linear(100.0, 1.0)).unwrap();
        a.update(&hopeless);
        assert_eq!((a.budget(), a.feeding()), (4, false));
        // The JSON form keeps the feed round; a file without it still loads.
        let back = CostModel::from_json(&c.to_json()).unwrap();
        assert_eq!(back, c);
        let old = linear(100.0, 1.0).to_json();
        assert!(!old.contains("feed_us"));
        assert_eq!(CostModel::from_json(&old).unwrap().feed_us, None);
        assert!(linear(100.0, 1.0).with_feed(0.0).is_err());
        assert!(linear(100.0, 1.0).with_feed(f64::NAN).is_err());
    }

    #[test]
    fn realized_acceptance_scales_the_feed_decision() {
        // Fixed cost 100, 1 a node; a feed round 50. Scores of 4 nodes at p = 0.1: θ(4) = 1.4 / 104 < 1/50,
        // so the surrogate alone feeds.
        let c = linear(100.0, 1.0).with_feed(50.0).unwrap();
        let weak = [0.1f64.ln(); 4];
        let mut a = AutoBudget::new(4, c.clone()).unwrap();
        assert_eq!(a.realized(), 1.0);
        a.update(&weak);
        assert!(a.feeding(), "the surrogate alone feeds");
        // The same scores with 5 tokens committed a round (everything accepted): each round's ratio is
        // 5 / 1.4, capped at 8, and after a few the running ratio makes the tree worth drafting.
        let mut a = AutoBudget::new(4, c.clone()).unwrap();
        let mut feeds = 0;
        for _ in 0..6 {
            a.update_seen(&weak, 5);
            while a.feeding() {
                a.update(&[]);
                feeds += 1;
            }
        }
        assert!(a.realized() > 2.0, "{}", a.realized());
        assert!(
            feeds <= 2,
            "{feeds} feed rounds where the drafted rounds commit 5 tokens"
        );
        a.update_seen(&weak, 5);
        assert!(!a.feeding());
        // Rounds that commit the bonus alone pull it back down, and feeding wins again.
        for _ in 0..12 {
            a.update_seen(&weak, 1);
            while a.feeding() {
                a.update(&[]);
            }
        }
        assert!(a.realized() < 1.0, "{}", a.realized());
        a.update_seen(&weak, 1);
        assert!(a.feeding());
        // A feed round's empty scores leave the ratio as it was.
        let r = a.realized();
        a.update_seen(&[], 1);
        assert_eq!(a.realized(), r);
    }

    #[test]
    fn calibrated_tokens_decide_before_any_round() {
        // Fixed 100, 1 a node verified; a feed round 50.
        let c = linear(100.0, 1.0).with_feed(50.0).unwrap();
        assert_eq!(c.prior(1, 1), None, "no calibrated tokens, no prior");
        assert!(
            !AutoBudget::new(16, c.clone()).unwrap().feeding(),
            "without a prior the first round drafts"
        );
        // The bonus alone at every bucket (a drafter that never hits): 1 / 105 < 1 / 50, feed from the start, a run
        // at the floor: (105 − 50) / (50 / 32) = 35.2 → 36 feed rounds before the first probe.
        let never = c.clone().with_tokens(vec![(4, 1.0), (16, 1.0)]).unwrap();
        let (b, theta) = never.prior(1, 1).unwrap();
        assert_eq!(b, 4);
        assert!((theta - 1.0 / 105.0).abs() < 1e-12, "{theta}");
        let mut a = AutoBudget::new(16, never.clone()).unwrap();
        let mut fed = 0;
        while a.feeding() {
            a.update(&[]);
            fed += 1;
        }
        assert_eq!(fed, 36);
        // 4 tokens at bucket 16 (4 / 117 > 1 / 50): draft first, at the start bucket.
        let good = c.clone().with_tokens(vec![(4, 1.5), (16, 4.0)]).unwrap();
        assert_eq!(good.prior(1, 1).unwrap().0, 16);
        let a = AutoBudget::new(16, good.clone()).unwrap();
        assert_eq!((a.feeding(), a.budget()), (false, START_BUCKET));
        // A batch's rows: 64 sequences of bucket 16 verify 64 × 17 rows: 256 / 1188 < 64 / 113, so it feeds.
        let (_, theta) = good.prior(64, 64).unwrap();
        assert!(batch_feeds(64, 64, theta, &good));
        // The file form keeps them; a round that commits less than its bonus is refused.
        assert_eq!(CostModel::from_json(&good.to_json()).unwrap(), good);
        assert!(c.clone().with_tokens(vec![(4, 0.5)]).is_err());
        assert!(c.with_tokens(vec![(0, 2.0)]).is_err());
    }

    #[test]
    fn a_batch_feeds_when_its_rows_make_drafting_dear() {
        // Fixed 100, 1 a node verified; a feed round 50 (+ 1 a row beyond the first in a batch).
        let c = linear(100.0, 1.0).with_feed(50.0).unwrap();
        // Every sequence's tree certain to 4 nodes then hopeless.
        let sure: Vec<f64> = [0.0, 0.0, 0.0, 0.0].into_iter().chain([-20.0; 60]).collect();
        let scores: Vec<&[f64]> = vec![&sure; 8];
        let choices = [1, 2, 4, 8, 16, 32, 64];
        // 8 rows: θ(4) = 8·5 / (100 + 40) = 0.286 against feeding's 8 / 57 = 0.140: draft 4.
        let (b, theta) = batch_choice(&scores, 8, &choices, &c).unwrap();
        assert_eq!(b, 4);
        assert!((theta - 40.0 / 140.0).abs() < 1e-12, "{theta}");
        assert!(!batch_feeds(8, 8, theta, &c));
        // 64 rows of the same trees: θ(4) = 64·5 / (100 + 320) = 0.762; θ(2) = 64·3 / 292 = 0.658; feeding
        // 64 / 113 = 0.566: still draft. Hopeless trees instead: θ(1) = 64 / 228 = 0.281 < 0.566: feed.
        let (b, theta) = batch_choice(&vec![&sure[..]; 64], 64, &choices, &c).unwrap();
        assert_eq!(b, 4);
        assert!(!batch_feeds(64, 64, theta, &c));
        let hopeless = [-20.0; 64];
        let (_, theta) = batch_choice(&vec![&hopeless[..]; 64], 64, &choices, &c).unwrap();
        assert!(batch_feeds(64, 64, theta, &c));
        // Without a measured feed round a batch never feeds.
        assert!(!batch_feeds(64, 64, 0.0, &linear(100.0, 1.0)));
        // The runs: 1, then doubling while feeding wins, back to 1 when drafting wins (a probe that costs
        // little more than a feed round); from the second win in a row at least enough feed rounds that the
        // probe's extra cost is PROBE_SHARE of the run, capped at MAX_FEED_RUN (a probe of 2 and of 100 feed
        // rounds).
        let runs = |probe: f64, wins: &[bool]| {
            let (mut f, mut lens) = (FeedRuns::default(), Vec::new());
            for &win in wins {
                f.decide(win, probe, 10.0, false);
                let mut n = 0;
                while f.feeding() {
                    f.fed();
                    n += 1;
                }
                lens.push(n);
            }
            lens
        };
        assert_eq!(runs(10.2, &[true, true, true, false, true]), vec![1, 2, 4, 0, 1]);
        assert_eq!(runs(20.0, &[true, true, true, false, true]), vec![1, 32, 64, 0, 1]);
        assert_eq!(runs(1000.0, &[true, true, true]), vec![1, MAX_FEED_RUN, MAX_FEED_RUN]);
        assert_eq!(runs(f64::NAN, &[true, true]), vec![1, 2]);
        // A sure verdict (a batch's, over all its sequences) starts at the floor from its first win.
        let mut f = FeedRuns::default();
        f.decide(true, 20.0, 10.0, true);
        assert_eq!(f.left, 32);
        f.decide(false, 20.0, 10.0, true);
        assert_eq!(f, FeedRuns::default());
    }
}
