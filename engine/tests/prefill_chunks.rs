//! A prompt prefilled in chunks (`Session::set_prefill_chunk`: consecutive forwards, each over the committed rows
//! before it) gives what one forward over the whole prompt gives, bit for bit on the CPU: the prefill's last-row
//! logits, the first token, and every step after it, in AR and DDTree (whose drafter context is extended per
//! chunk). On the trained pair converted for one rank; chunks of 1, 7 and 16 rows against the whole prompt, and a
//! chunk as long as the prompt.

mod round_common;

use kdtree_engine::generate::{Mode, Sampling};
use kdtree_engine::session::ProbeSet;
use kdtree_engine::{open, Device};
use round_common::*;

#[test]
fn chunked_prefill_equals_one_forward_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 53 + 11) % 1000).collect();
    for mode in [Mode::Ar, Mode::DDTree { budget: 8 }] {
        let mut runs = Vec::new();
        for chunk in [0usize, 1, 7, 16, 37] {
            let mut s = m.session(mode).unwrap();
            s.set_prefill_chunk(chunk);
            assert_eq!(s.prefill_chunk(), chunk);
            s.set_probes(ProbeSet {
                logits: true,
                ..ProbeSet::default()
            });
            let first = s.prefill(&prompt, &Sampling::greedy()).unwrap();
            assert_eq!(
                s.committed(),
                prompt.len(),
                "chunk {chunk}: the whole prompt is committed"
            );
            let logits = s.take_probes().logits.remove(0);
            let mut toks = vec![first];
            for _ in 0..6 {
                toks.extend(s.step().unwrap().tokens);
            }
            runs.push((chunk, logits, toks));
        }
        let (_, l0, t0) = &runs[0];
        for (chunk, l, t) in &runs[1..] {
            let same = l.iter().zip(l0).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && l.len() == l0.len(),
                "{mode:?} chunk {chunk}: the last row's logits differ"
            );
            assert_eq!(t, t0, "{mode:?} chunk {chunk}: the tokens differ");
        }
        println!(
            "{mode:?}: chunks of 1, 7, 16, 37 rows == one forward ({} tokens)",
            t0.len()
        );
    }
}

/// One run's bits: the prefill's last-row logits, every step's tokens (a round's grouping shows what its drafter
/// proposed was accepted), every round's draft logits (the drafter's context at work), and how many prefill chunks
/// ran where the target's ops run.
type Run = (Vec<u32>, Vec<Vec<u32>>, Vec<Vec<u32>>, usize);

fn run(m: &mut kdtree_engine::Loaded, mode: Mode, chunk: usize, device: bool, prompt: &[u32]) -> Run {
    let mut s = m.session(mode).unwrap();
    s.set_prefill_chunk(chunk);
    s.set_device_prefill(device);
    s.set_probes(ProbeSet {
        logits: true,
        rounds: true,
        ..ProbeSet::default()
    });
    let first = s.prefill(prompt, &Sampling::greedy()).unwrap();
    assert_eq!(s.committed(), prompt.len());
    let mut steps = vec![vec![first]];
    for _ in 0..6 {
        steps.push(s.step().unwrap().tokens);
    }
    let p = s.take_probes();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let drafts = p.rounds.iter().map(|r| bits(&r.draft_logits)).collect();
    (bits(&p.logits[0]), steps, drafts, s.device_prefills())
}

/// The prefill where the target's ops run (`Session::set_device_prefill`, the default: each chunk's forward and
/// commit, the drafter's context from taps that stay where they were computed, none computed in AR) leaves what
/// the host prefill leaves (the forward, its taps read back, the context built from them): the same last-row
/// logits, tokens and round groupings, and the same draft logits in every round after it, bit for bit.
#[test]
fn device_prefill_equals_the_host_prefill_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 53 + 11) % 1000).collect();
    for mode in [Mode::Ar, Mode::DDTree { budget: 8 }] {
        for (chunk, chunks) in [(0usize, 1usize), (7, 6)] {
            let dev = run(&mut m, mode, chunk, true, &prompt);
            let host = run(&mut m, mode, chunk, false, &prompt);
            assert_eq!(dev.3, chunks, "{mode:?} chunk {chunk}: every chunk where the ops run");
            assert_eq!(host.3, 0, "{mode:?} chunk {chunk}: the host prefill when it is off");
            assert!(dev.0 == host.0, "{mode:?} chunk {chunk}: the last row's logits differ");
            assert_eq!(
                dev.1, host.1,
                "{mode:?} chunk {chunk}: the tokens or their rounds differ"
            );
            assert!(dev.2 == host.2, "{mode:?} chunk {chunk}: a round's draft logits differ");
            if mode != Mode::Ar {
                assert_eq!(dev.2.len(), 6, "{mode:?}: six rounds recorded");
            }
            println!(
                "{mode:?} chunk {chunk}: the device prefill ({chunks} chunks) == the host prefill, {} rounds' drafts",
                dev.2.len()
            );
        }
    }
}
