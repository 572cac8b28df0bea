//! `--budget auto` (Mode::DDTreeAuto, ddtree/cost.rs) on the CPU backend, trained pair models/kdtree-tiny:
//! * greedy auto emits the AR tokens (lossless whatever the budgets), moves between several buckets, and
//!   the device-path round (`Target::device_round`, several tree shapes in one session) gives the host
//!   round's steps, budgets included;
//! * each round's budget is the lagged rule applied to the previous round's tree scores (recomputed here
//!   from the recorded trees with a fresh `AutoBudget`), restarting at the start bucket on each prefill.
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
    let mut s = m.session(Mode::DDTreeAuto { max: MAX }).unwrap();
    s.set_cost_model(cost()).unwrap();
    s.set_device_round(device);
    s.set_probes(ProbeSet {
        rounds: probes,
        ..ProbeSet::default()
    });
    let mut out = Vec::new();
    for p in PROMPTS {
        let mut toks = vec![s.prefill(p, &Sampling::greedy()).unwrap()];
        let mut steps = Vec::new();
        while toks.len() < n {
            let e = s.step().unwrap();
            toks.extend(&e.tokens);
            steps.push(e);
        }
        toks.truncate(n);
        let scores = s
            .take_probes()
            .rounds
            .iter()
            .map(|r| r.tree.log_q[1..].to_vec())
            .collect();
        out.push((toks, steps, scores));
    }
    if device {
        assert!(s.device_rounds() > 0, "no auto round ran on the device path");
    }
    out
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
            a.update(lq);
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
