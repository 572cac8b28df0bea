//! Tensor parallelism on one GPU (issue 11): R rank groups side by side on the H200, each with its own
//! thread, stream, weights and captured graphs, meeting through the one-GPU communicator
//! (engine/src/cuda/comm.rs `SharedGpu`, kernels/cuda/group_all_reduce.cu).
//! * the communicator alone: R streams' partials summed in rank order (acc = p0; acc += p1; …), bit for bit
//!   with the host, for a buffer of several chunks and for a short one, many times over;
//! * the trained pair converted for R = 2, 4, 8 (tp) and 4, 8 (ep) and run as R groups gives one controller's
//!   R-rank tokens (same sums in the same order: bit for bit): greedy AR, greedy and sampled DDTree b16,
//!   alone and batched, every group's rounds and steps captured as graphs with the sums inside
//!   (KDTREE_CUDA_GRAPHS=0: eagerly, the launches paced at `comm::LaunchGate`s; gpu-test.sh runs both);
//! * NCCL through the same driver: one group on NCCL gives the one-GPU tokens (skips without libnccl unless
//!   KDTREE_REQUIRE_NCCL=1).
//!
//! `tp_step_timings` (ignored; bench/tp.sh): what the collectives cost per step.
#![cfg(feature = "cuda")]

mod cuda_common;
mod round_common;

use kdtree_engine::cuda::comm::{Communicator, Nccl, SharedGpu};
use kdtree_engine::cuda::Gpu;
use kdtree_engine::generate::{generate, GenRequest, Sampling};
use kdtree_engine::model::open::open_cuda_on;
use kdtree_engine::tp::{open_tp_gpus, Placement};
use kdtree_engine::{Loaded, Mode};
use kdtree_formats::plan::ExpertsMode;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// More hardware queues than rank streams (a kernel of one rank waiting in the queue of another's spinning
/// sum would never start) and eager module loading (a lazy load synchronises the device); both must be set
/// before CUDA starts (engine/src/tp `cuda_groups` refuses lazy loading).
fn connections() {
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
}

fn convert(out: &Path, ranks: usize, experts: ExpertsMode) {
    let src = round_common::pair_dir();
    let o = kdtree_convert::repack::RepackOptions {
        src: src.clone(),
        out: out.to_path_buf(),
        drafter: Some(src.join("drafter")),
        ranks,
        experts,
        max_file_size: kdtree_convert::repack::DEFAULT_MAX_FILE_SIZE,
        quiet: true,
    };
    kdtree_convert::repack::repack(&o).unwrap();
}

#[test]
fn shared_gpu_sum_is_the_rank_order_sum() {
    connections();
    let Some(_g) = cuda_common::gpu() else { return };
    for world in [2usize, 4, 8] {
        let gpus: Vec<Gpu> = (0..world)
            .map(|_| Gpu::new(0, cuda_common::gpu_options()).unwrap())
            .collect();
        gpus[0].pool_for_groups().unwrap();
        gpus.iter().for_each(|g| g.set_drain_copies(true));
        gpus.iter().for_each(|g| {
            g.set_blas_sms(g.sms - world * kdtree_engine::cuda::comm::GROUP_BLOCKS)
                .unwrap()
        });
        let comms = SharedGpu::ranks(&gpus[0], world).unwrap();
        for n in [1_100_003usize, 7] {
            // Partials where the order matters: large terms that cancel and small ones.
            let parts: Vec<Vec<Vec<f32>>> = (0..world)
                .map(|r| {
                    (0..6)
                        .map(|rep| {
                            (0..n)
                                .map(|i| {
                                    (((i * 31 + r * 7 + rep * 13) as f32) * 0.37).sin() * 10f32.powi((r % 3) as i32 * 3)
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                let hs: Vec<_> = gpus
                    .iter()
                    .zip(&comms)
                    .zip(&parts)
                    .map(|((g, c), p)| {
                        s.spawn(move || {
                            p.iter()
                                .map(|x| {
                                    let mut d = g.upload(x).unwrap();
                                    c.all_reduce_sum(g, &mut d).unwrap();
                                    g.download(&d).unwrap()
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for rep in 0..6 {
                let mut want = parts[0][rep].clone();
                for p in &parts[1..] {
                    for (a, b) in want.iter_mut().zip(&p[rep]) {
                        *a += *b;
                    }
                }
                for (r, o) in outs.iter().enumerate() {
                    assert!(
                        o[rep].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "world {world}, n {n}, rep {rep}: rank {r}'s sum differs from the rank-order sum"
                    );
                }
            }
            println!(
                "PARITY shared-gpu all-reduce: {world} streams, {n} f32, 6 sums: every rank == rank-order host sum \
                 (bit-identical)"
            );
        }
    }
}

fn gen(m: &mut Loaded, mode: Mode, s: &Sampling, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| {
            let req = GenRequest {
                prompt: p.clone(),
                max_tokens: 24,
                stop_token_ids: vec![],
                sampling: s.clone(),
                mode,
            };
            let mut sess = m.session(mode).unwrap();
            generate(&mut sess, &req, &mut |_| false).unwrap().tokens
        })
        .collect()
}

fn gen_batch(m: &Loaded, mode: Mode, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut batch = m.batch(mode, prompts.len(), None).unwrap();
    let reqs: Vec<GenRequest> = prompts
        .iter()
        .map(|p| GenRequest {
            prompt: p.clone(),
            max_tokens: 24,
            stop_token_ids: vec![],
            sampling: Sampling::greedy(),
            mode,
        })
        .collect();
    let tokens = round_common::batch_tokens(&mut batch, &reqs);
    assert!(batch.batched_steps > 0);
    tokens
}

/// Every run of the comparison: greedy AR, greedy b16, sampled b16, batched AR, greedy feed rounds (budget 0)
/// alone and batched.
fn runs(m: &mut Loaded, prompts: &[Vec<u32>]) -> Vec<Vec<Vec<u32>>> {
    let t1 = Sampling {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        seed: 7,
    };
    vec![
        gen(m, Mode::Ar, &Sampling::greedy(), prompts),
        gen(m, Mode::DDTree { budget: 16 }, &Sampling::greedy(), prompts),
        gen(m, Mode::DDTree { budget: 16 }, &t1, prompts),
        gen_batch(m, Mode::Ar, prompts),
        gen(m, Mode::DDTree { budget: 0 }, &Sampling::greedy(), prompts),
        gen_batch(m, Mode::DDTree { budget: 0 }, prompts),
    ]
}

#[test]
fn rank_groups_on_one_gpu_equal_one_controller() {
    connections();
    let Some(g) = cuda_common::gpu() else { return };
    let g = Arc::new(g);
    let tmp = tempfile::tempdir().unwrap();
    let prompts = [
        vec![1u32, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11],
        vec![400, 401, 402, 9],
        vec![5, 6, 7],
    ];
    for (ranks, experts) in [
        (2, ExpertsMode::Tp),
        (4, ExpertsMode::Tp),
        (8, ExpertsMode::Tp),
        (4, ExpertsMode::Ep),
        (8, ExpertsMode::Ep),
    ] {
        let dir = tmp.path().join(format!("pair-{ranks}-{experts:?}"));
        convert(&dir, ranks, experts);
        let want = {
            let mut one = open_cuda_on(&dir, g.clone()).unwrap();
            runs(&mut one, &prompts)
        };
        let (mut tp, gpus) = open_tp_gpus(&dir, ranks, Placement::SharedGpu(0), tp_options()).unwrap();
        let got = runs(&mut tp, &prompts);
        drop(tp);
        let failures: u64 = gpus.iter().map(|g| g.stats.capture_failures.load(Relaxed)).sum();
        let graphs: Vec<u64> = gpus.iter().map(|g| g.stats.graph_launches.load(Relaxed)).collect();
        println!(
            "PARITY {ranks} rank groups ({experts:?}) on one GPU vs one controller: AR {} b16 {} b16 T=1 {} batched \
             AR {} feed rounds {} batched feed rounds {}; graph launches per group {graphs:?}, {failures} capture \
             failures",
            want[0] == got[0],
            want[1] == got[1],
            want[2] == got[2],
            want[3] == got[3],
            want[4] == got[4],
            want[5] == got[5]
        );
        assert_eq!(failures, 0, "a group's capture failed");
        // Every group captures its rounds and steps, the sums inside (unless KDTREE_CUDA_GRAPHS=0 runs them eagerly).
        let graphs_on = cuda_common::gpu_options().graphs;
        assert!(
            graphs.iter().all(|&n| (n > 0) == graphs_on),
            "graphs {graphs_on}: graph launches per group {graphs:?}"
        );
        assert!(
            graphs.iter().all(|&n| n == graphs[0]),
            "the groups launched different numbers of graphs: {graphs:?}"
        );
        assert_eq!(want, got, "R = {ranks}: rank groups differ from one controller");
    }
}

#[test]
fn nccl_through_the_group_driver() {
    connections();
    let Some(_g) = cuda_common::gpu() else { return };
    if !Nccl::available() {
        assert!(
            std::env::var("KDTREE_REQUIRE_NCCL").as_deref() != Ok("1"),
            "KDTREE_REQUIRE_NCCL=1 but libnccl cannot be loaded"
        );
        println!("SKIP nccl: libnccl is not on the library path");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pair1");
    convert(&dir, 1, ExpertsMode::Tp);
    let prompts = [vec![1u32, 17, 305, 42, 7], vec![400, 401, 402, 9]];
    let want = {
        let mut one = open_cuda_on(&dir, Arc::new(Gpu::new(0, cuda_common::gpu_options()).unwrap())).unwrap();
        runs(&mut one, &prompts)
    };
    let (mut m, gpus) = open_tp_gpus(&dir, 1, Placement::Gpus(vec![0]), tp_options()).unwrap();
    assert_eq!(gpus[0].comm().name(), "nccl");
    let got = runs(&mut m, &prompts);
    drop(m);
    let failures = gpus[0].stats.capture_failures.load(Relaxed);
    println!(
        "PARITY nccl group driver (1 GPU): == one-gpu {}; {failures} capture failures",
        want == got
    );
    assert_eq!(failures, 0);
    assert_eq!(want, got);
}

/// Per-step cost of the collectives on one GPU: the pair's greedy AR step and DDTree b16 round, one controller
/// running R ranks (the sums are adds on one stream) against R groups (each its own stream and graph, the
/// sums a device rendezvous), and one shared-GPU all-reduce of one row on its own.
#[test]
#[ignore]
fn tp_step_timings() {
    connections();
    let Some(g) = cuda_common::gpu() else { return };
    let g = Arc::new(g);
    let tmp = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| (i * 37 + 11) % 4000).collect();
    let steps = 96;
    let time = |m: &mut Loaded, mode: Mode| -> (f64, usize) {
        let mut s = m.session(mode).unwrap();
        let _ = s.prefill(&prompt, &Sampling::greedy()).unwrap();
        for _ in 0..8 {
            s.step().unwrap();
        }
        let t0 = std::time::Instant::now();
        let mut toks = 0;
        for _ in 0..steps {
            toks += s.step().unwrap().tokens.len();
        }
        (t0.elapsed().as_secs_f64() * 1e3 / steps as f64, toks)
    };
    for (ranks, experts) in [
        (1, ExpertsMode::Tp),
        (2, ExpertsMode::Tp),
        (4, ExpertsMode::Ep),
        (8, ExpertsMode::Ep),
    ] {
        let dir = tmp.path().join(format!("pair-{ranks}"));
        convert(&dir, ranks, experts);
        let mut one = open_cuda_on(&dir, g.clone()).unwrap();
        let (ar1, _) = time(&mut one, Mode::Ar);
        let (dd1, t1) = time(&mut one, Mode::DDTree { budget: 16 });
        drop(one);
        let (mut tp, _gpus) = open_tp_gpus(&dir, ranks, Placement::SharedGpu(0), tp_options()).unwrap();
        let (arg, _) = time(&mut tp, Mode::Ar);
        let (ddg, tg) = time(&mut tp, Mode::DDTree { budget: 16 });
        drop(tp);
        println!(
            "TIMING tp R={ranks} {experts:?}: AR step one controller {ar1:.3} ms, {ranks} groups {arg:.3} ms; DDTree \
             b16 round one controller {dd1:.3} ms ({t1} tok), {ranks} groups {ddg:.3} ms ({tg} tok)"
        );
    }
    // One all-reduce of one K2.6 row (7168 f32) over 8 streams, eager, back to back.
    for world in [2usize, 8] {
        let gpus: Vec<Gpu> = (0..world)
            .map(|_| Gpu::new(0, cuda_common::gpu_options()).unwrap())
            .collect();
        gpus[0].pool_for_groups().unwrap();
        gpus.iter().for_each(|g| g.set_drain_copies(true));
        gpus.iter().for_each(|g| {
            g.set_blas_sms(g.sms - world * kdtree_engine::cuda::comm::GROUP_BLOCKS)
                .unwrap()
        });
        let comms = SharedGpu::ranks(&gpus[0], world).unwrap();
        let reps = 2000;
        let us = std::thread::scope(|s| {
            let hs: Vec<_> = gpus
                .iter()
                .zip(&comms)
                .map(|(g, c)| {
                    s.spawn(move || {
                        let mut d = g.upload(&vec![1f32; 7168]).unwrap();
                        for _ in 0..50 {
                            c.all_reduce_sum(g, &mut d).unwrap();
                        }
                        g.sync().unwrap();
                        let t0 = std::time::Instant::now();
                        for _ in 0..reps {
                            c.all_reduce_sum(g, &mut d).unwrap();
                        }
                        g.sync().unwrap();
                        t0.elapsed().as_secs_f64() * 1e6 / reps as f64
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold(0f64, f64::max)
        });
        println!(
            "TIMING shared-gpu all-reduce of 7168 f32 over {world} streams: {us:.2} us each (eager launches, back to \
             back)"
        );
    }
}

/// Open options of the GPU runs here: the environment's GPU switches (as kdtree-run passes them).
fn tp_options() -> kdtree_engine::OpenOptions {
    kdtree_engine::OpenOptions {
        gpu: cuda_common::gpu_options(),
        ..Default::default()
    }
}
