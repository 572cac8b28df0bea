//! Tensor parallelism with a thread per rank group (engine/src/tp, issue 11) on the CPU backend: the trained
//! pair converted for R = 2, 4 and 8 ranks (tp and ep experts) and run as R groups of one rank, each group on
//! its own thread with its own weights (its shards only) and the host communicator, gives one controller's
//! R-rank run bit for bit: every logit of the prefill, then whole generations (AR, DDTree, the chain; greedy
//! and sampled; alone and batched; the groups' prefill where the ops run against the controller's host
//! prefill). Groups of several ranks run too (their sums group differently, so the check there is closeness).
//! Clear refusals: a rank count that does not divide, a group count of 0.

mod round_common;

use kdtree_convert::repack::{repack, RepackOptions, DEFAULT_MAX_FILE_SIZE};
use kdtree_engine::generate::{generate, GenOutput, GenRequest, Sampling};
use kdtree_engine::tp::{open_tp, Placement};
use kdtree_engine::{open, Device, Loaded, Mode};
use kdtree_formats::plan::ExpertsMode;
use round_common::pair_dir;
use std::path::Path;

fn convert(out: &Path, ranks: usize, experts: ExpertsMode) {
    let src = pair_dir();
    repack(&RepackOptions {
        src: src.clone(),
        out: out.to_path_buf(),
        drafter: Some(src.join("drafter")),
        ranks,
        experts,
        max_file_size: DEFAULT_MAX_FILE_SIZE,
        quiet: true,
    })
    .unwrap();
}

fn requests(vocab: u32) -> Vec<GenRequest> {
    let prompts: [&[u32]; 5] = [
        &[1, 17, 305, 42, 7, 900, 12, 3],
        &[400, 401, 402, 9],
        &[5, 6],
        &[88, 99, 1000, 3, 3, 3, 77],
        &[31, 4, 159, 26],
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
        Sampling::greedy(),
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 11,
        },
    ];
    let modes = [
        Mode::Ar,
        Mode::DDTree { budget: 16 },
        Mode::Chain,
        Mode::DDTree { budget: 6 },
        // Feed rounds (budget 0): no draft, the root's taps into every group's drafter context.
        Mode::DDTree { budget: 0 },
    ];
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        out.push(GenRequest {
            prompt: p.iter().map(|&t| t % vocab).collect(),
            max_tokens: 20,
            stop_token_ids: vec![],
            sampling: settings[i].clone(),
            mode: modes[i],
        });
    }
    out
}

fn alone(m: &mut Loaded, reqs: &[GenRequest]) -> Vec<GenOutput> {
    reqs.iter()
        .map(|r| {
            let mut s = m.session(r.mode).unwrap();
            generate(&mut s, r, &mut |_: &[u32]| false).unwrap()
        })
        .collect()
}

/// `reqs` (all of one mode) through a batch of `slots`.
fn batched(m: &Loaded, reqs: &[GenRequest], slots: usize) -> Vec<Vec<u32>> {
    let mut batch = m.batch(reqs[0].mode, slots, None).unwrap();
    let tokens = round_common::batch_tokens(&mut batch, reqs);
    assert!(batch.batched_steps > 0, "the batch ran batched steps");
    tokens
}

fn prefill_logits(m: &mut Loaded, prompt: &[u32]) -> Vec<f32> {
    m.target.reset();
    let parents: Vec<i32> = (0..prompt.len() as i32).map(|i| i - 1).collect();
    let out = m.target.forward(prompt, &parents).unwrap();
    m.target.reset();
    out.logits
}

#[test]
fn rank_groups_on_threads_equal_one_controller_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    for (ranks, experts) in [(2, ExpertsMode::Tp), (4, ExpertsMode::Ep), (8, ExpertsMode::Tp)] {
        let dir = tmp.path().join(format!("pair-{ranks}-{experts:?}"));
        convert(&dir, ranks, experts);
        let mut one = open(&dir, Device::Cpu).unwrap();
        let mut tp = open_tp(&dir, ranks, Placement::Cpu, Default::default()).unwrap();
        let v = one.info().vocab_size;
        assert_eq!(tp.info().vocab_size, v, "the groups keep the global vocabulary");
        let prompt: Vec<u32> = [3u32, 1000, 77, 4000, 5, 12].iter().map(|t| t % v as u32).collect();
        let (a, b) = (prefill_logits(&mut one, &prompt), prefill_logits(&mut tp, &prompt));
        assert_eq!(a.len(), prompt.len() * v);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "R = {ranks} {experts:?}: prefill logits differ"
        );
        let reqs = requests(v as u32);
        let (want, got) = (alone(&mut one, &reqs), alone(&mut tp, &reqs));
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                (&w.tokens, &w.spec),
                (&g.tokens, &g.spec),
                "R = {ranks} {experts:?}: request {i} ({:?}) differs",
                reqs[i].mode
            );
        }
        // The prefill where the ops run, through the groups (each group's drafter context from its own taps),
        // == the controller's host prefill (its taps read back and sent again), in chunks of 4 rows.
        for mode in [Mode::Ar, Mode::DDTree { budget: 16 }] {
            let steps = |m: &mut Loaded, device: bool| {
                let mut s = m.session(mode).unwrap();
                s.set_prefill_chunk(4);
                s.set_device_prefill(device);
                let mut out = vec![vec![s.prefill(&prompt, &Sampling::greedy()).unwrap()]];
                for _ in 0..4 {
                    out.push(s.step().unwrap().tokens);
                }
                (out, s.device_prefills())
            };
            let (g, h) = (steps(&mut tp, true), steps(&mut one, false));
            assert_eq!(
                (g.1, h.1),
                (2, 0),
                "R = {ranks} {experts:?} {mode:?}: the groups' device prefill ran"
            );
            assert_eq!(
                g.0, h.0,
                "R = {ranks} {experts:?} {mode:?}: device prefill through the groups differs"
            );
        }
        // Batched: every request of one mode in one batch.
        for mode in [Mode::Ar, Mode::DDTree { budget: 16 }, Mode::DDTree { budget: 0 }] {
            let rs: Vec<GenRequest> = reqs
                .iter()
                .cloned()
                .map(|mut r| {
                    r.mode = mode;
                    r
                })
                .collect();
            assert_eq!(
                batched(&one, &rs, 3),
                batched(&tp, &rs, 3),
                "R = {ranks} {experts:?}: batched {mode:?} differs"
            );
        }
        eprintln!(
            "R = {ranks} {experts:?}: {ranks} rank threads == one controller ({} requests, batched AR, b16 and feed \
             rounds)",
            reqs.len()
        );
    }
}

#[test]
fn groups_of_several_ranks_run_and_stay_close() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pair4");
    convert(&dir, 4, ExpertsMode::Tp);
    let mut one = open(&dir, Device::Cpu).unwrap();
    let mut tp = open_tp(&dir, 2, Placement::Cpu, Default::default()).unwrap();
    let v = one.info().vocab_size;
    let prompt: Vec<u32> = [9u32, 8, 7, 600, 5].iter().map(|t| t % v as u32).collect();
    let (a, b) = (prefill_logits(&mut one, &prompt), prefill_logits(&mut tp, &prompt));
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(
        worst < 1e-3,
        "2 groups of 2 ranks: logits within 1e-3 of one controller (worst {worst})"
    );
    let r = &requests(v as u32)[1];
    let g = alone(&mut tp, std::slice::from_ref(r));
    assert_eq!(g[0].tokens.len(), r.max_tokens, "2 groups of 2 ranks generate");
}

#[test]
fn rank_counts_that_do_not_divide_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pair4");
    convert(&dir, 4, ExpertsMode::Tp);
    let e = open_tp(&dir, 3, Placement::Cpu, Default::default())
        .err()
        .expect("4 ranks over 3 groups");
    let msg = format!("{e:#}");
    assert!(msg.contains("4 ranks") && msg.contains("3 GPUs"), "{msg}");
    let e = open_tp(&dir, 0, Placement::Cpu, Default::default())
        .err()
        .expect("0 groups");
    assert!(format!("{e:#}").contains("at least 1"), "{e:#}");
    let e = open_tp(&dir, 8, Placement::Cpu, Default::default())
        .err()
        .expect("more groups than ranks");
    assert!(format!("{e:#}").contains("do not divide"), "{e:#}");
}

#[test]
fn a_trace_through_the_group_driver_is_the_controllers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pair2");
    convert(&dir, 2, ExpertsMode::Tp);
    let mut one = open(&dir, Device::Cpu).unwrap();
    let mut tp = open_tp(&dir, 2, Placement::Cpu, Default::default()).unwrap();
    let mut traces = Vec::new();
    for m in [&mut one, &mut tp] {
        m.target.reset();
        m.target.start_trace();
        m.target.forward(&[5, 6, 7], &[-1, 0, 1]).unwrap();
        traces.push(m.target.take_trace().expect("a recording"));
    }
    assert!(!traces[0].tensors.is_empty());
    assert_eq!(traces[0], traces[1], "the probes recorded through 2 rank groups");
}
