//! Shared by the device-round tests (generate_device_round.rs on the CPU, cuda_round.rs on the GPU): convert
//! a model for one rank, then run the same prompts through sessions with the device round on and off and
//! compare every step's emitted tokens and counters.
#![allow(dead_code)]

use kdtree_convert::repack::{repack, RepackOptions, DEFAULT_MAX_FILE_SIZE};
use kdtree_engine::generate::Sampling;
use kdtree_engine::{Emitted, Loaded, Mode};
use kdtree_formats::plan::ExpertsMode;
use std::path::{Path, PathBuf};

/// models/kdtree-tiny: at the path this test was built from, else from the working directory (the GPU suite
/// runs staged binaries from a copy of the repository root).
pub fn pair_dir() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/kdtree-tiny");
    [
        built,
        PathBuf::from("models/kdtree-tiny"),
        PathBuf::from("../models/kdtree-tiny"),
    ]
    .into_iter()
    .find(|p| p.join("config.json").is_file() && p.join("drafter/config.json").is_file())
    .expect("models/kdtree-tiny (with drafter/) not found at the build path, ./models or ../models")
}

/// The synthetic `tiny` preset (seed 0, with its drafter: `kdtree-convert synth tiny --seed 0 --drafter`, as the
/// GPU suite's end-to-end runs have it) written under `tmp` and converted for one rank: the converted folder.
pub fn synth_tiny_one_rank(tmp: &Path) -> PathBuf {
    let hf = tmp.join("hf");
    kdtree_convert::synth::write("tiny", &hf, 0, true, None).unwrap();
    convert(&hf, &tmp.join("tiny1"), 1);
    tmp.join("tiny1")
}

/// Converts `src` (an HF checkpoint with a drafter/ folder) for `ranks` ranks into `out`.
pub fn convert(src: &Path, out: &Path, ranks: usize) {
    repack(&RepackOptions {
        src: src.to_path_buf(),
        out: out.to_path_buf(),
        drafter: Some(src.join("drafter")),
        ranks,
        experts: ExpertsMode::Tp,
        max_file_size: DEFAULT_MAX_FILE_SIZE,
        quiet: true,
    })
    .unwrap();
}

/// Prefill `prompt` and run `steps` DDTree rounds at `budget`; the emitted steps and how many rounds ran
/// on the device path.
pub fn run(
    m: &mut Loaded,
    prompt: &[u32],
    budget: usize,
    s: &Sampling,
    device: bool,
    steps: usize,
) -> (Vec<Emitted>, usize) {
    run_mode(m, prompt, Mode::DDTree { budget }, s, device, steps)
}

/// [`run`] in any drafting mode (DDTree or the chain).
pub fn run_mode(
    m: &mut Loaded,
    prompt: &[u32],
    mode: Mode,
    s: &Sampling,
    device: bool,
    steps: usize,
) -> (Vec<Emitted>, usize) {
    let mut sess = m.session(mode).unwrap();
    sess.set_device_round(device);
    let first = sess.prefill(prompt, s).unwrap();
    let mut out = vec![Emitted {
        tokens: vec![first],
        drafted: 0,
        accepted: 0,
        depth_limit: 0,
        budget: 0,
    }];
    for _ in 0..steps {
        out.push(sess.step().unwrap());
    }
    (out, sess.device_rounds())
}

/// Mean accepted nodes per round (+1 = tokens per round).
pub fn tau(steps: &[Emitted]) -> f64 {
    let r = &steps[1..];
    r.iter().map(|e| e.accepted as f64 + 1.0).sum::<f64>() / r.len().max(1) as f64
}

/// The device round and the host round give the same steps on `m` for greedy and two sampled settings;
/// returns (rounds compared, mean tau greedy) and prints one line per case (`prefix` names the model).
pub fn compare(m: &mut Loaded, prefix: &str, prompts: &[Vec<u32>], budgets: &[usize], steps: usize) -> (usize, f64) {
    let settings = [
        ("greedy", Sampling::greedy()),
        (
            "T=1 seed 5",
            Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed: 5,
            },
        ),
        (
            "T=0.7 top_p 0.9 top_k 40 seed 9",
            Sampling {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 40,
                seed: 9,
            },
        ),
    ];
    let (mut rounds, mut taus) = (0, Vec::new());
    for (name, s) in &settings {
        for &budget in budgets {
            for (i, p) in prompts.iter().enumerate() {
                let (dev, n_dev) = run(m, p, budget, s, true, steps);
                let (host, n_host) = run(m, p, budget, s, false, steps);
                assert_eq!(n_host, 0, "{prefix}: the host-round session ran device rounds");
                assert_eq!(
                    n_dev, steps,
                    "{prefix}: {name} budget {budget}: only {n_dev} of {steps} rounds ran on the device path"
                );
                for (k, (a, b)) in dev.iter().zip(&host).enumerate() {
                    assert_eq!(
                        a, b,
                        "{prefix}: {name} budget {budget} prompt {i}: step {k} differs (device round vs host round)"
                    );
                }
                rounds += steps;
                if *name == "greedy" {
                    taus.push(tau(&dev));
                }
                println!(
                    "PARITY device_round({prefix},{name},budget={budget},prompt={i}) exact ({steps} rounds, tau {:.2})",
                    tau(&dev)
                );
            }
        }
    }
    (rounds, taus.iter().sum::<f64>() / taus.len().max(1) as f64)
}

/// `steps` AR steps of `prompt` with the device step on or off: (tokens, steps that ran on the device path).
pub fn run_ar(m: &mut Loaded, prompt: &[u32], s: &Sampling, device: bool, steps: usize) -> (Vec<u32>, usize) {
    let mut sess = m.session(Mode::Ar).unwrap();
    sess.set_device_round(device);
    let mut out = vec![sess.prefill(prompt, s).unwrap()];
    for _ in 0..steps {
        out.extend(sess.step().unwrap().tokens);
    }
    (out, sess.device_steps())
}

/// The device AR step (`Target::device_step`) and the host step give the same tokens on `m`, greedy and
/// sampled; returns the steps compared.
pub fn compare_ar(m: &mut Loaded, prefix: &str, prompts: &[Vec<u32>], steps: usize) -> usize {
    let settings = [
        ("greedy", Sampling::greedy()),
        (
            "T=1 top_p 0.9 seed 3",
            Sampling {
                temperature: 1.0,
                top_p: 0.9,
                top_k: 0,
                seed: 3,
            },
        ),
    ];
    let mut n = 0;
    for (name, s) in &settings {
        for (i, p) in prompts.iter().enumerate() {
            let (dev, n_dev) = run_ar(m, p, s, true, steps);
            let (host, n_host) = run_ar(m, p, s, false, steps);
            assert_eq!(
                (n_dev, n_host),
                (steps, 0),
                "{prefix}: {name}: {n_dev} device steps of {steps} (host run: {n_host})"
            );
            assert_eq!(
                dev, host,
                "{prefix}: {name} prompt {i}: the device AR step differs from the host step"
            );
            n += steps;
            println!("PARITY device_step({prefix},{name},prompt={i}) exact ({steps} steps)");
        }
    }
    n
}

/// The chain round where the target's ops run (`Target::device_chain`: the top-1 tree) and the host chain
/// round give the same steps on `m`, greedy and sampled; returns the rounds compared.
pub fn compare_chain(m: &mut Loaded, prefix: &str, prompts: &[Vec<u32>], steps: usize) -> usize {
    let settings = [
        ("greedy", Sampling::greedy()),
        (
            "T=1 seed 5",
            Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed: 5,
            },
        ),
    ];
    let mut n = 0;
    for (name, s) in &settings {
        for (i, p) in prompts.iter().enumerate() {
            let (dev, n_dev) = run_mode(m, p, Mode::Chain, s, true, steps);
            let (host, n_host) = run_mode(m, p, Mode::Chain, s, false, steps);
            assert_eq!(
                (n_dev, n_host),
                (steps, 0),
                "{prefix}: chain {name}: {n_dev} device rounds of {steps} (host run: {n_host})"
            );
            for (k, (a, b)) in dev.iter().zip(&host).enumerate() {
                assert_eq!(
                    a, b,
                    "{prefix}: chain {name} prompt {i}: step {k} differs (device round vs host round)"
                );
            }
            n += steps;
            println!(
                "PARITY device_chain({prefix},{name},prompt={i}) exact ({steps} rounds, tau {:.2})",
                tau(&dev)
            );
        }
    }
    n
}

/// Prefill `prompt` into `m`'s reset target and drafter where the ops run; returns the greedy next token.
fn prefill_pair(m: &mut Loaded, prompt: &[u32]) -> u32 {
    let d = m.drafter.as_deref_mut().expect("a drafter");
    m.target.reset();
    d.reset();
    let logits = m
        .target
        .device_prefill(Some(d), prompt, true)
        .expect("a device prefill")
        .unwrap();
    argmax(&logits)
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

/// Feed rounds (budget 0 where the target's ops run: AR steps whose drafter stashes the taps, written into
/// its context in one forward before the next draft) over `steps` tokens, past a full stash: the tokens
/// are greedy AR's, the drafter's context length follows the target's after every step, and a draft after
/// cutting back inside the stash, and below the written context, equals the draft of a drafter that prefilled
/// the same tokens (bit for bit where `exact`, else within `tol` of the largest logit; the largest difference
/// is returned).
pub fn compare_stash(m: &mut Loaded, prefix: &str, prompt: &[u32], steps: usize, exact: bool, tol: f32) -> f32 {
    let greedy = Sampling::greedy();
    // AR's tokens.
    let mut root = prefill_pair(m, prompt);
    let mut ar = vec![root];
    for _ in 0..steps {
        root = m.target.device_step(root, &greedy).expect("a device step").unwrap();
        ar.push(root);
    }
    // Feed rounds.
    let mut root = prefill_pair(m, prompt);
    let mut fed = vec![root];
    for i in 0..steps {
        let d = m.drafter.as_deref_mut().unwrap();
        let r = m
            .target
            .device_round(d, root, 0, &greedy)
            .expect("a device feed round")
            .unwrap();
        assert_eq!(
            (r.drafted, r.walk.path.len(), r.log_q.len()),
            (0, 1, 0),
            "{prefix}: feed round {i}"
        );
        root = r.walk.bonus();
        fed.push(root);
        assert_eq!(
            d.context_len(),
            m.target.committed(),
            "{prefix}: after feed round {i} the drafter's context is not the target's"
        );
    }
    assert_eq!(fed, ar, "{prefix}: feed rounds emit other tokens than AR steps");
    let seq: Vec<u32> = prompt.iter().chain(&ar).copied().collect();
    let mut worst = 0f32;
    // Cut back inside the last stash, then below the written context: the draft from there against a prefill.
    for len in [seq.len() - 3, prompt.len() + 5] {
        m.target.truncate(len).unwrap();
        let d = m.drafter.as_deref_mut().unwrap();
        d.truncate_context(len).unwrap();
        let kept = d.draft(seq[len], len).unwrap();
        prefill_pair(m, &seq[..len]);
        let fresh = m.drafter.as_deref_mut().unwrap().draft(seq[len], len).unwrap();
        assert_eq!(kept.len(), fresh.len());
        let top = fresh.iter().fold(0f32, |a, x| a.max(x.abs()));
        let diff = kept.iter().zip(&fresh).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / top.max(1e-30);
        if exact {
            assert!(
                kept.iter().zip(&fresh).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{prefix}: the draft at {len} after feed rounds differs from a prefilled drafter's ({diff:.3e})"
            );
        } else {
            assert!(
                diff <= tol,
                "{prefix}: the draft at {len} after feed rounds is {diff:.3e} of the largest logit from a prefilled \
                 drafter's (bound {tol:.1e})"
            );
        }
        worst = worst.max(diff);
        // Back to the whole sequence for the next cut.
        prefill_pair(m, &seq[..seq.len() - 1]);
    }
    println!(
        "PARITY feed_stash({prefix}) {} ({steps} feed rounds == AR; drafts after cuts {worst:.3e} of the top logit)",
        if exact { "exact" } else { "close" }
    );
    worst
}

/// Every request of `reqs` generated through `batch` (`generate_batch`, no request stopped by its callback):
/// each one's tokens, in request order.
pub fn batch_tokens(batch: &mut kdtree_engine::Batch, reqs: &[kdtree_engine::generate::GenRequest]) -> Vec<Vec<u32>> {
    use kdtree_engine::generate::{generate_batch, GenOutput, Job};
    let mut it = reqs.iter().cloned().enumerate();
    let mut next = || {
        it.next().map(|(i, req)| {
            (
                i,
                Job {
                    req,
                    on_tokens: Box::new(|_: &[u32]| false),
                },
            )
        })
    };
    let mut outs = std::collections::BTreeMap::new();
    let mut done = |i: usize, o: anyhow::Result<GenOutput>| {
        outs.insert(i, o.unwrap().tokens);
        Ok(())
    };
    generate_batch(batch, &mut next, &mut done).unwrap();
    outs.into_values().collect()
}
