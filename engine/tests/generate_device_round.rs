//! The DDTree round written against the backend seam (`Target::device_round`: draft, top-K, tree, mask,
//! verify, walk and commit where the target's ops run, one read back per round) gives the same steps as the
//! host round (session.rs `ddtree_round`) on the CPU backend: every round's tokens and counters, greedy and
//! sampled, budgets 1 to 64, on the trained pair (deep accepted paths) and on the synthetic tiny preset
//! converted for 2 ranks; and the AR step written against it (`Target::device_step`) gives the host step's
//! tokens, and the chain round on the same path the host chain round's. The same comparisons run on the GPU
//! in cuda_round.rs.

mod round_common;

use kdtree_engine::{open, Device};
use round_common::*;

#[test]
fn device_round_equals_the_host_round_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    let mut m = open(&tmp.path().join("pair1"), Device::Cpu).unwrap();
    let prompts = [
        vec![1u32, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11],
        vec![400, 401, 402, 9],
    ];
    let (rounds, tau) = compare(&mut m, "kdtree-tiny pair, cpu", &prompts, &[0, 1, 8, 64], 6);
    compare_ar(&mut m, "kdtree-tiny pair, cpu", &prompts, 8);
    // Past two full stashes (64 rows each).
    compare_stash(&mut m, "kdtree-tiny pair, cpu", &prompts[0], 140, true, 0.0);
    compare_chain(&mut m, "kdtree-tiny pair, cpu", &prompts, 6);
    assert!(
        tau > 1.5,
        "the trained pair should accept deep paths (greedy tau {tau:.2})"
    );
    eprintln!("{rounds} rounds compared, greedy tau {tau:.2}");

    kdtree_convert::synth::write("tiny", &tmp.path().join("hf"), 3, true, None).unwrap();
    convert(&tmp.path().join("hf"), &tmp.path().join("tiny2"), 2);
    let mut m = open(&tmp.path().join("tiny2"), Device::Cpu).unwrap();
    compare(
        &mut m,
        "tiny synth 2 ranks, cpu",
        &[vec![1u32, 2, 3, 4, 5]],
        &[4, 32],
        4,
    );
}
