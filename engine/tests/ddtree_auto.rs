//! `--budget auto` (Mode::DDTreeAuto, ddtree/cost.rs) on the CPU backend, trained pair models/kdtree-tiny:
//! * greedy auto emits the AR tokens (lossless whatever the budgets), moves between several buckets, and
//!   the device-path round (`Target::device_round`, several tree shapes in one session) gives the host
//!   round's steps, budgets included;
//! * each round's budget is the lagged rule applied to the previous round's tree scores (recomputed here
//!   from the recorded trees with a fresh `AutoBudget`), restarting at the start bucket on each prefill;
//! * with a measured feed round, auto feeds (budget 0) where drafting does not pay and probes again, still
//!   emitting the AR tokens, and a round drafted after feed rounds drafts from the same context (the same
//!   draft logits, bit for bit) as a session that prefilled those tokens.
//!
//! The GPU twin (device scores == CPU tree scores, auto rounds captured per bucket) is in cuda_round.rs.

mod round_common;

use kdtree_engine::ddtree::cost::{CostModel, COST_SCHEMA, START_BUCKET};
use kdtree_engine::ddtree::AutoBudget;
use kdtree_engine::generate::Sampling;
use kdtree_engine::{open, Device, Emitted, Loaded, Mode, ProbeSet};
use round_common::*;

/// Rounds cost 100 µs plus 4 µs a node: large trees only where the drafter is sure.
fn cost() -> CostModel {
    CostModel {
        schema: COST_SCHEMA,
        device: "test".into(),
        draft_us: 100.0,
        verify: vec![(1, 4.0), (257, 1028.0)],
        feed_us: None,
        tokens: Vec::new(),
        note: String::new(),
    }
}

const MAX: usize = 64;
const PROMPTS: [&[u32]; 2] = [&[1, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11], &[400, 401, 402, 9]];

/// One prompt's run: its tokens, its rounds, and each recorded round's popped-node scores.
type PromptRun = (Vec<u32>, Vec<Emitted>, Vec<Vec<f64>>);

/// `n` tokens of greedy auto on `prompt` (two prompts in one session: the second restarts), the device path
/// on or off, round trees recorded when `probes`.
fn auto_run(m: &mut Loaded, device: bool, probes: bool, n: usize) -> Vec<PromptRun> {
    auto_run_with(m, &cost(), &Sampling::greedy(), device, probes, n).0
}

/// [`auto_run`] under `cost` and sampling `sampling`; also each prompt's recorded draft logits (one per
/// drafted round, empty for feed rounds) when `probes`.
fn auto_run_with(
    m: &mut Loaded,
    cost: &CostModel,
    sampling: &Sampling,
    device: bool,
    probes: bool,
    n: usize,
) -> (Vec<PromptRun>, Vec<Vec<Vec<f32>>>) {
    let mut s = m.session(Mode::DDTreeAuto { max: MAX }).unwrap();
    s.set_cost_model(cost.clone()).unwrap();
    s.set_device_round(device);
    s.set_probes(ProbeSet {
        rounds: probes,
        ..ProbeSet::default()
    });
    let (mut out, mut drafts) = (Vec::new(), Vec::new());
    for p in PROMPTS {
        let mut toks = vec![s.prefill(p, sampling).unwrap()];
        let mut steps = Vec::new();
        while toks.len() < n {
            let e = s.step().unwrap();
            toks.extend(&e.tokens);
            steps.push(e);
        }
        toks.truncate(n);
        let rounds = s.take_probes().rounds;
        let scores = rounds.iter().map(|r| r.tree.log_q[1..].to_vec()).collect();
        drafts.push(rounds.into_iter().map(|r| r.draft_logits).collect());
        out.push((toks, steps, scores));
    }
    if device {
        assert!(s.device_rounds() > 0, "no auto round ran on the device path");
    }
    (out, drafts)
}

#[test]
fn greedy_auto_equals_ar_and_follows_the_lagged_rule() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let n = 40;
    let dev = auto_run(&mut m, true, false, n);
    let host = auto_run(&mut m, false, true, n);
    let mut seen = std::collections::BTreeSet::new();
    for (i, p) in PROMPTS.iter().enumerate() {
        let (ar, _) = run_ar(&mut m, p, &Sampling::greedy(), false, n - 1);
        let ((dt, ds, _), (ht, hs, scores)) = (&dev[i], &host[i]);
        assert_eq!(dt, &ar, "prompt {i}: greedy auto (device path) differs from AR");
        assert_eq!(
            ds, hs,
            "prompt {i}: device-path auto rounds differ from host rounds (tokens, counters or budgets)"
        );
        assert_eq!(ht, &ar, "prompt {i}: greedy auto (host rounds) differs from AR");
        // The lagged rule, replayed from the recorded trees.
        let mut a = AutoBudget::new(MAX, cost()).unwrap();
        assert_eq!(
            hs[0].budget, START_BUCKET,
            "prompt {i}: the first round runs at the start bucket"
        );
        for (r, (e, lq)) in hs.iter().zip(scores).enumerate() {
            assert_eq!(e.budget, a.budget(), "prompt {i} round {r}: budget");
            assert_eq!(lq.len(), e.drafted, "prompt {i} round {r}: one score per drafted node");
            a.update_seen(lq, e.tokens.len());
            seen.insert(e.budget);
        }
        let budgets: Vec<usize> = hs.iter().map(|e| e.budget).collect();
        println!(
            "PARITY ddtree_auto_vs_ar(cpu,prompt={i},max={MAX}) exact ({n} tokens, {} rounds, budgets {budgets:?})",
            hs.len()
        );
    }
    assert!(
        seen.len() >= 2,
        "the rule never left one bucket ({seen:?}): the test's cost model does not exercise it"
    );
    assert!(
        seen.iter().all(|b| [4, 8, 16, 32, 64].contains(b)),
        "budgets off the bucket set: {seen:?}"
    );
}

#[test]
fn auto_needs_a_cost_model_and_only_auto_takes_one() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    {
        let mut s = m.session(Mode::DDTreeAuto { max: 8 }).unwrap();
        s.prefill(PROMPTS[1], &Sampling::greedy()).unwrap();
        let e = format!("{:#}", s.step().unwrap_err());
        assert!(e.contains("cost model"), "{e}");
        assert!(
            s.set_cost_model(CostModel { schema: 9, ..cost() }).is_err(),
            "a bad model is refused"
        );
    }
    let mut s = m.session(Mode::DDTree { budget: 8 }).unwrap();
    assert!(s.set_cost_model(cost()).is_err(), "a fixed budget takes no cost model");
}

/// Feed rounds cost 40 µs: against the test model's rounds (100 µs + 4 a node) they win wherever a tree's
/// expected tokens fall below ~2.5 + 0.1 a node, so a run both feeds and drafts.
#[test]
fn auto_feeds_where_drafting_does_not_pay_and_keeps_the_drafter_context() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let cost = cost().with_feed(40.0).unwrap();
    let n = 48;
    let greedy = Sampling::greedy();
    let (dev, _) = auto_run_with(&mut m, &cost, &greedy, true, false, n);
    let (host, drafts) = auto_run_with(&mut m, &cost, &greedy, false, true, n);
    let (mut fed, mut probed) = (0, 0);
    let mut a = AutoBudget::new(MAX, cost.clone()).unwrap();
    for (i, p) in PROMPTS.iter().enumerate() {
        let (ar, _) = run_ar(&mut m, p, &Sampling::greedy(), false, n - 1);
        let ((dt, ds, _), (ht, hs, scores)) = (&dev[i], &host[i]);
        assert_eq!(
            dt, &ar,
            "prompt {i}: greedy auto with feed rounds (device path) differs from AR"
        );
        assert_eq!(
            ht, &ar,
            "prompt {i}: greedy auto with feed rounds (host rounds) differs from AR"
        );
        assert_eq!(ds, hs, "prompt {i}: device-path rounds differ from host rounds");
        // The rule replayed: feed rounds draft nothing and emit one token; a new prompt restarts the rule (its
        // feed runs go on).
        a.restart();
        let mut at = 1; // tokens before round r: the prefill's
        for (r, (e, lq)) in hs.iter().zip(scores).enumerate() {
            assert_eq!(e.budget, a.budget(), "prompt {i} round {r}: budget");
            if e.budget == 0 {
                assert_eq!((e.drafted, e.tokens.len(), lq.len()), (0, 1, 0), "prompt {i} round {r}");
                assert!(drafts[i][r].is_empty(), "prompt {i} round {r}: a feed round drafted");
                fed += 1;
            } else if r > 0 && hs[r - 1].budget == 0 {
                // A probe after feed rounds drafts from the context the feed rounds kept: the same draft
                // logits as a session that prefilled every token so far and drafts its first round.
                let prefix: Vec<u32> = p.iter().copied().chain(ht[..at - 1].iter().copied()).collect();
                let mut s = m.session(Mode::DDTreeAuto { max: MAX }).unwrap();
                s.set_cost_model(cost.clone()).unwrap();
                s.set_probes(ProbeSet {
                    rounds: true,
                    ..ProbeSet::default()
                });
                let root = s.prefill(&prefix, &Sampling::greedy()).unwrap();
                assert_eq!(root, ht[at - 1], "prompt {i} round {r}: the prefill's token");
                s.step().unwrap();
                let fresh = &s.take_probes().rounds[0].draft_logits;
                assert!(!fresh.is_empty());
                assert!(
                    fresh.iter().zip(&drafts[i][r]).all(|(x, y)| x.to_bits() == y.to_bits())
                        && fresh.len() == drafts[i][r].len(),
                    "prompt {i} round {r}: the probe's draft differs from a fresh session's at {} tokens",
                    prefix.len()
                );
                probed += 1;
            }
            a.update_seen(lq, e.tokens.len());
            at += e.tokens.len();
        }
        let budgets: Vec<usize> = hs.iter().map(|e| e.budget).collect();
        println!("PARITY ddtree_auto_feed_vs_ar(cpu,prompt={i},max={MAX}) exact ({n} tokens, budgets {budgets:?})");
    }
    assert!(
        fed > 0 && probed > 0,
        "{fed} feed rounds, {probed} probes after them: the cost does not exercise them"
    );
    // Sampled: a feed round draws its token with the uniform of the AR step at that position, so sampled auto
    // with feed rounds emits sampled AR's tokens for the same seed.
    let t1 = Sampling {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        seed: 13,
    };
    let (sampled, _) = auto_run_with(&mut m, &cost, &t1, true, false, n);
    for (i, p) in PROMPTS.iter().enumerate() {
        let (ar, _) = run_ar(&mut m, p, &t1, false, n - 1);
        assert_eq!(
            sampled[i].0, ar,
            "prompt {i}: sampled auto with feed rounds differs from sampled AR"
        );
        assert!(
            sampled[i].1.iter().any(|e| e.budget == 0),
            "prompt {i}: no sampled feed round"
        );
    }
}
