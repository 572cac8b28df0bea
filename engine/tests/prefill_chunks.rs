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
