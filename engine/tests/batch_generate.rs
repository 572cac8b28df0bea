//! Batched generation (engine/src/session_batch.rs, model/batch.rs, generate::generate_batch) on the CPU backend:
//! every request's output — tokens, finish reason, speculation counters — equals what `generate` gives it
//! alone, for AR, DDTree (two budgets) and the chain; greedy and sampled; mixed prompt lengths, max_tokens,
//! sampling overrides and stops (a stop token inside an accepted path, a callback stop); batches smaller than
//! the request list (slots refilled as sequences finish) and larger. And the batched steps really ran
//! (several sequences in one forward), and the KV admission control serialises what does not fit and
//! refuses, with both sizes named, what never fits.

mod round_common;

use kdtree_engine::generate::{generate, generate_batch, FinishReason, GenOutput, GenRequest, Job, Sampling};
use kdtree_engine::{open, Device, Loaded, Mode};
use round_common::*;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

/// A request and its callback stop: generation ends once this token has been emitted `n` times.
#[derive(Clone)]
struct Case {
    req: GenRequest,
    callback_stop: Option<(u32, usize)>,
}

fn callback(stop: Option<(u32, usize)>) -> impl FnMut(&[u32]) -> bool {
    move |toks: &[u32]| stop.is_some_and(|(t, n)| toks.iter().filter(|&&x| x == t).count() >= n)
}

fn alone(m: &mut Loaded, cases: &[Case]) -> Vec<GenOutput> {
    cases
        .iter()
        .map(|c| {
            let mut s = m.session(c.req.mode).unwrap();
            generate(&mut s, &c.req, &mut callback(c.callback_stop)).unwrap()
        })
        .collect()
}

/// What [`batched`] returns: the outputs in input order, the batch's counters (batched steps, slot-steps in
/// them, steps alone) and the most sequences that were running at once.
type Batched = (Vec<Result<GenOutput, String>>, (usize, usize, usize), usize);

/// Runs `cases` through a batch of `slots` (see [`Batched`]).
fn batched(m: &Loaded, cases: &[Case], slots: usize, kv_bytes: Option<usize>) -> Batched {
    let mode = cases[0].req.mode;
    let mut batch = m.batch(mode, slots, kv_bytes).unwrap();
    let mut it = cases.iter().cloned().enumerate();
    let outs: Rc<RefCell<BTreeMap<usize, Result<GenOutput, String>>>> = Default::default();
    let (running, peak) = (Rc::new(RefCell::new(0usize)), Rc::new(RefCell::new(0usize)));
    let mut next = || {
        let (i, c) = it.next()?;
        let (r, p) = (running.clone(), peak.clone());
        *r.borrow_mut() += 1;
        let peak_now = *r.borrow();
        let mut p = p.borrow_mut();
        *p = (*p).max(peak_now);
        Some((
            i,
            Job {
                req: c.req,
                on_tokens: Box::new(callback(c.callback_stop)),
            },
        ))
    };
    let o = outs.clone();
    let r = running.clone();
    let mut done = |i: usize, out: anyhow::Result<GenOutput>| {
        *r.borrow_mut() -= 1;
        assert!(
            o.borrow_mut().insert(i, out.map_err(|e| format!("{e:#}"))).is_none(),
            "request {i} finished twice"
        );
        Ok(())
    };
    generate_batch(&mut batch, &mut next, &mut done).unwrap();
    let outs = std::mem::take(&mut *outs.borrow_mut());
    assert_eq!(outs.len(), cases.len(), "every request finishes once");
    let peak = *peak.borrow();
    (
        outs.into_values().collect(),
        (batch.batched_steps, batch.batched_slot_steps, batch.alone_steps),
        peak,
    )
}

fn same(a: &GenOutput, b: &GenOutput) -> bool {
    a.tokens == b.tokens && a.finish_reason == b.finish_reason && a.spec == b.spec
}

/// The requests of one mode: prompts of 1..12 tokens, greedy and two sampled settings, max_tokens 1..40, a
/// stop token that the alone run emits mid-way (inside an accepted path in DDTree mode), a callback stop.
fn cases(m: &mut Loaded, mode: Mode) -> Vec<Case> {
    let prompts: [&[u32]; 6] = [
        &[1, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11],
        &[400, 401, 402, 9],
        &[5],
        &[88, 99, 1000, 3, 3, 3, 77],
        &[2, 4, 6, 8, 10],
        &[1234, 17],
    ];
    let settings = [
        Sampling::greedy(),
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 5,
        },
        Sampling {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            seed: 9,
        },
    ];
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let v = m.info().vocab_size as u32;
        let req = GenRequest {
            prompt: p.iter().map(|&t| t % v).collect(),
            max_tokens: [40, 24, 1, 33, 17, 40][i],
            stop_token_ids: vec![],
            sampling: settings[i % 3].clone(),
            mode,
        };
        out.push(Case {
            req,
            callback_stop: None,
        });
    }
    // A stop token taken from the middle of an alone run (greedy): the batched run must cut at the same place.
    let probe = alone(m, &out[..1]);
    let stop_tok = probe[0].tokens[probe[0].tokens.len() / 2];
    let mut c = out[0].clone();
    c.req.stop_token_ids = vec![stop_tok];
    out.push(c);
    let mut c = out[1].clone();
    c.callback_stop = Some((probe[0].tokens[3], 1));
    c.req.sampling = Sampling::greedy();
    c.req.prompt = out[0].req.prompt.clone();
    out.push(c);
    out
}

#[test]
fn batched_generation_equals_one_by_one_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    for mode in [
        Mode::Ar,
        Mode::DDTree { budget: 8 },
        Mode::DDTree { budget: 32 },
        Mode::Chain,
    ] {
        let cases = cases(&mut m, mode);
        let want = alone(&mut m, &cases);
        assert_eq!(
            want[6].finish_reason,
            FinishReason::Stop,
            "{mode:?}: the stop-token case stops"
        );
        assert_eq!(
            want[7].finish_reason,
            FinishReason::Callback,
            "{mode:?}: the callback case stops"
        );
        for slots in [1, 3, 8] {
            let (got, (steps, slot_steps, alone_steps), peak) = batched(&m, &cases, slots, None);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let g = g
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{mode:?} batch {slots}: request {i} failed: {e}"));
                assert!(
                    same(g, w),
                    "{mode:?} batch {slots}: request {i} differs from its run alone:\n batched {:?} {:?}\n alone   \
                     {:?} {:?}",
                    g.tokens,
                    g.finish_reason,
                    w.tokens,
                    w.finish_reason
                );
            }
            // (One request has max_tokens 1: it ends at its prefill, so it may never run beside all the others.)
            assert!(
                peak <= slots && peak >= slots.min(cases.len() - 1),
                "{mode:?} batch {slots}: {peak} sequences at once: slots refilled as sequences finish"
            );
            if slots > 1 {
                assert!(
                    steps > 0 && slot_steps >= 2 * steps,
                    "{mode:?} batch {slots}: {steps} batched steps over {slot_steps} slot-steps ({alone_steps} alone)"
                );
            }
            eprintln!(
                "{mode:?} batch {slots}: {} requests equal; {steps} batched steps ({slot_steps} slot-steps), \
                 {alone_steps} alone",
                cases.len()
            );
        }
    }
}

#[test]
fn batched_generation_equals_one_by_one_over_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    kdtree_convert::synth::write("tiny", &tmp.path().join("hf"), 3, true, None).unwrap();
    convert(&tmp.path().join("hf"), &tmp.path().join("tiny2"), 2);
    let mut m = open(&tmp.path().join("tiny2"), Device::Cpu).unwrap();
    for mode in [Mode::Ar, Mode::DDTree { budget: 16 }] {
        let cases = cases(&mut m, mode);
        let want = alone(&mut m, &cases);
        let (got, (steps, ..), _) = batched(&m, &cases, 4, None);
        assert!(steps > 0);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                same(g.as_ref().unwrap(), w),
                "{mode:?}: request {i} differs from its run alone"
            );
        }
    }
}

#[test]
fn kv_admission_serialises_what_does_not_fit_and_refuses_what_never_fits() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let mode = Mode::DDTree { budget: 8 };
    let mut cases = cases(&mut m, mode);
    let want = alone(&mut m, &cases);
    // Room for exactly one sequence's caches (every request here fits in 256 rows).
    let row = m.batch(mode, 1, None).unwrap().sessions()[0].row_bytes();
    assert!(row > 0, "the CPU session accounts its cache rows");
    let one = row * kdtree_engine::session_batch::alloc_rows(64);
    let (got, _, _) = batched(&m, &cases, 4, Some(one));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            same(g.as_ref().unwrap(), w),
            "request {i} differs under a one-sequence KV budget"
        );
    }
    // Two sequences' worth: at most two run at once, and the outputs are still the same.
    let (got, _, peak) = batched(&m, &cases, 4, Some(2 * one));
    assert!(got.iter().zip(&want).all(|(g, w)| same(g.as_ref().unwrap(), w)));
    assert!(
        peak <= 2 + 1,
        "admission lets at most two sequences hold KV (peak {peak} counts the one waiting)"
    );
    // A request that can never fit fails alone, with both sizes named; the others still run.
    cases[2].req.max_tokens = 100_000;
    let (got, _, _) = batched(&m, &cases, 4, Some(2 * one));
    let err = got[2]
        .as_ref()
        .expect_err("a sequence larger than the KV budget is refused");
    assert!(err.contains("of KV cache") && err.contains("KV memory is"), "{err}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate().filter(|(i, _)| *i != 2) {
        assert!(
            same(g.as_ref().unwrap(), w),
            "request {i} differs next to a refused one"
        );
    }
}

/// `--budget auto` in a batch: each round takes one bucket for every sequence (the one most of them chose),
/// so the budgets — and the speculation counters — may differ from a run alone, never the tokens. Also with
/// a measured feed round (40 µs: the sequences feed alone, and the batch feeds when all of them do).
#[test]
fn batched_auto_budget_gives_the_alone_tokens() {
    for feed in [None, Some(40.0)] {
        batched_auto(feed, Vec::new());
    }
    // With calibrated tokens that say drafting never pays (the bonus alone at every bucket): the batch feeds from
    // its first step, a run at the probe-share floor, and the tokens are still the alone ones.
    let never: Vec<(usize, f64)> = [4, 8, 16, 32, 64].iter().map(|&b| (b, 1.0)).collect();
    batched_auto(Some(40.0), never);
}

fn batched_auto(feed: Option<f64>, tokens: Vec<(usize, f64)>) {
    use kdtree_engine::ddtree::cost::{CostModel, COST_SCHEMA};
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let cost = CostModel {
        schema: COST_SCHEMA,
        device: "test".into(),
        draft_us: 100.0,
        verify: vec![(1, 4.0), (257, 1028.0)],
        feed_us: feed,
        tokens: tokens.clone(),
        note: String::new(),
    };
    let mode = Mode::DDTreeAuto { max: 64 };
    let cases: Vec<Case> = cases(&mut m, Mode::DDTree { budget: 8 })
        .into_iter()
        .map(|mut c| {
            c.req.mode = mode;
            c
        })
        .collect();
    let want: Vec<GenOutput> = cases
        .iter()
        .map(|c| {
            let mut s = m.session(mode).unwrap();
            s.set_cost_model(cost.clone()).unwrap();
            generate(&mut s, &c.req, &mut callback(c.callback_stop)).unwrap()
        })
        .collect();
    if feed.is_some() {
        let (drafted, rounds) = want
            .iter()
            .fold((0, 0), |(d, r), w| (d + w.spec.drafted, r + w.spec.verify_steps));
        assert!(
            rounds > 0 && drafted < 4 * rounds,
            "no feed round alone ({drafted} drafted in {rounds} rounds)"
        );
    }
    let mut batch = m.batch(mode, 4, None).unwrap();
    for i in 0..4 {
        batch.session(i).set_cost_model(cost.clone()).unwrap();
    }
    let mut it = cases.iter().cloned().enumerate();
    let mut got: BTreeMap<usize, GenOutput> = BTreeMap::new();
    generate_batch(
        &mut batch,
        &mut || {
            it.next().map(|(i, c)| {
                (
                    i,
                    Job {
                        req: c.req,
                        on_tokens: Box::new(callback(c.callback_stop)),
                    },
                )
            })
        },
        &mut |i, out| {
            got.insert(i, out?);
            Ok(())
        },
    )
    .unwrap();
    assert!(batch.batched_steps > 0);
    // The batch decides for all its sequences: no round mixes feeding and drafting ones; its time split
    // counts every batched round once, as a feed round or a drafted one.
    assert_eq!(
        batch.mixed_steps, 0,
        "a batched round mixed feeding and drafting sequences"
    );
    let t = batch.times;
    assert_eq!(
        (t.feed.n as usize, (t.feed.n + t.drafted.n) as usize, t.ar.n),
        (batch.feed_steps, batch.batched_steps, 0)
    );
    assert!(t.new_shape.n >= 1 && t.new_shape.n <= t.feed.n + t.drafted.n);
    if !tokens.is_empty() {
        // The prior's run (at least (180 − 52) / (52 / 32) = 79 feed rounds of 4 rows: a b4 round of 4 sequences is
        // 100 + 4 × 20 µs, a feed round of 4 rows 40 + 4 × 3) outlasts the file: no batched round drafts.
        assert_eq!(
            batch.feed_steps, batch.batched_steps,
            "a drafted round despite the calibrated prior"
        );
    }
    if feed.is_some() {
        assert!(batch.feed_steps > 0, "no batched feed round");
    } else {
        assert_eq!(batch.feed_steps, 0, "a feed round without a measured feed cost");
    }
    eprintln!(
        "batched auto (feed {feed:?}, calibrated tokens {}): {} batched steps, {} of them feed rounds",
        !tokens.is_empty(),
        batch.batched_steps,
        batch.feed_steps
    );
    for (i, w) in want.iter().enumerate() {
        assert_eq!(
            (&got[&i].tokens, got[&i].finish_reason),
            (&w.tokens, w.finish_reason),
            "request {i}: batched auto (feed {feed:?}) differs from alone"
        );
    }
}
