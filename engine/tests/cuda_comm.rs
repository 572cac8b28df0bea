//! The communicator seam (engine/src/cuda/comm.rs) with NCCL on one GPU (issue 11): a one-rank NCCL
//! all-reduce leaves its buffer's bits as they were, and the trained pair's greedy AR and DDTree (b16) runs —
//! every all-reduce of every step and round through NCCL, inside the captured graphs — give the tokens of the
//! default one-GPU communicator. Needs a GPU and libnccl (skips, saying so, without the library unless
//! KDTREE_REQUIRE_NCCL=1; scripts/gpu-test.sh links pip's libnccl.so.2 as libnccl.so).
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use kdtree_engine::cuda::comm::{Communicator, Nccl, OneGpu};
use kdtree_engine::generate::{generate, GenRequest, Sampling};
use kdtree_engine::model::open::open_cuda_on;
use kdtree_engine::Mode;
use std::sync::Arc;

#[test]
fn nccl_one_rank_all_reduce_and_rounds() {
    let Some(g) = cuda_common::gpu() else { return };
    if !Nccl::available() {
        assert!(
            std::env::var("KDTREE_REQUIRE_NCCL").as_deref() != Ok("1"),
            "KDTREE_REQUIRE_NCCL=1 but libnccl cannot be loaded"
        );
        println!("SKIP nccl: libnccl is not on the library path");
        return;
    }
    let g = Arc::new(g);
    let nccl: Arc<dyn Communicator> = Arc::new(Nccl::one_rank(&g).unwrap());
    assert_eq!((nccl.name(), nccl.world()), ("nccl", 1));
    let x: Vec<f32> = (0..100_003).map(|i| ((i as f32) * 0.731).sin() * 3.0).collect();
    let mut d = g.upload(&x).unwrap();
    nccl.all_reduce_sum(&g, &mut d).unwrap();
    let y = g.download(&d).unwrap();
    let same = x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits());
    println!(
        "PARITY nccl one-rank all_reduce (100003 f32): {}",
        if same { "bit-identical" } else { "DIFFERS" }
    );
    assert!(same);

    let tmp = tempfile::tempdir().unwrap();
    round_common::convert(&round_common::pair_dir(), &tmp.path().join("pair1"), 1);
    let prompts = [
        vec![1u32, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11],
        vec![400, 401, 402, 9],
        vec![5, 6, 7],
    ];
    let mut runs = Vec::new();
    for comm in [Arc::new(OneGpu) as Arc<dyn Communicator>, nccl.clone()] {
        g.set_comm(comm.clone());
        let mut m = open_cuda_on(&tmp.path().join("pair1"), g.clone()).unwrap();
        let mut toks = Vec::new();
        for mode in [Mode::Ar, Mode::DDTree { budget: 16 }] {
            for p in &prompts {
                let req = GenRequest {
                    prompt: p.clone(),
                    max_tokens: 24,
                    stop_token_ids: vec![],
                    sampling: Sampling::greedy(),
                    mode,
                };
                let mut s = m.session(mode).unwrap();
                toks.push(generate(&mut s, &req, &mut |_| false).unwrap().tokens);
            }
        }
        runs.push((comm.name(), toks));
    }
    g.set_comm(Arc::new(OneGpu));
    // The rounds and steps ran as captured graphs (a failed capture would have run them eagerly).
    let failures = g.stats.capture_failures.load(std::sync::atomic::Ordering::Relaxed);
    println!("PARITY nccl inside the captured rounds and steps: {failures} capture failures");
    assert_eq!(failures, 0, "a capture failed: {:?}", g.last_graph());
    let same = runs[0].1 == runs[1].1;
    println!(
        "PARITY trained pair greedy AR + DDTree b16, 3 prompts x 24 tokens: nccl (one rank, in the graphs) == \
         one-gpu: {same}"
    );
    assert!(same, "{:?}", runs);
}
