//! Generation loops against a mock target and drafter (generate_common): DDTree must reproduce AR
//! token for token (greedy and seeded sampling), and stops / max_tokens / callback / position limits must
//! cut identically in both modes while leaving the target and drafter state consistent.

mod generate_common;

use generate_common::{MockDrafter, MockTarget};
use kdtree_engine::api::{Drafter, Target};
use kdtree_engine::generate::{generate_on as generate, FinishReason, GenOutput, GenRequest, Mode, Sampling};

const BLOCK: usize = 8;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1],
        vec![3, 9, 27],
        vec![5, 5, 5, 5, 5, 5],
        (0..40).map(|i| (i * 13 % 48) as u32).collect(),
    ]
}

fn req(prompt: &[u32], max_tokens: usize, mode: Mode, sampling: Sampling) -> GenRequest {
    GenRequest {
        prompt: prompt.to_vec(),
        max_tokens,
        stop_token_ids: vec![],
        sampling,
        mode,
    }
}

/// Run and check the state invariants of generate.rs: committed = prompt + tokens[..len-1], drafter
/// context in step with the target.
fn run(t: &mut MockTarget, d: &mut MockDrafter, r: &GenRequest, cb: &mut dyn FnMut(&[u32]) -> bool) -> GenOutput {
    let out = match r.mode {
        Mode::Ar => generate(t, None, r, cb),
        Mode::DDTree { .. } | Mode::DDTreeAuto { .. } | Mode::Chain => generate(t, Some(d as &mut dyn Drafter), r, cb),
    }
    .unwrap();
    if !out.tokens.is_empty() {
        let mut want = r.prompt.clone();
        want.extend(&out.tokens[..out.tokens.len() - 1]);
        assert_eq!(t.committed_tokens(), &want[..], "committed state after {:?}", r.mode);
        if r.mode.drafts() {
            assert_eq!(d.context_len(), t.committed(), "drafter context vs target");
        }
    }
    out
}

fn run_simple(r: &GenRequest) -> GenOutput {
    run(&mut MockTarget::new(4096), &mut MockDrafter::new(BLOCK), r, &mut |_| {
        false
    })
}

#[test]
fn the_chain_is_lossless_and_drafts_one_path_a_round() {
    for p in prompts() {
        let ar = run_simple(&req(&p, 64, Mode::Ar, Sampling::greedy()));
        let chain = run_simple(&req(&p, 64, Mode::Chain, Sampling::greedy()));
        assert_eq!(chain.tokens, ar.tokens, "prompt {p:?}: greedy chain == greedy AR");
        let s = &chain.spec;
        // Every round drafts one node per depth (the full block, B-1 = 7, far from max_positions here).
        assert_eq!(
            s.drafted,
            s.verify_steps * (BLOCK as u64 - 1),
            "one path of B-1 nodes a round"
        );
        assert!(
            s.acceptance_length() > 1.0,
            "the mock drafter's chain is accepted at times"
        );
        let sampled = |m| {
            run_simple(&req(
                &p,
                48,
                m,
                Sampling {
                    temperature: 0.9,
                    top_p: 0.95,
                    top_k: 0,
                    seed: 5,
                },
            ))
            .tokens
        };
        assert_eq!(
            sampled(Mode::Chain),
            sampled(Mode::Ar),
            "sampled chain == sampled AR for a seed"
        );
    }
}

#[test]
fn greedy_ddtree_equals_greedy_ar() {
    for p in prompts() {
        let ar = run_simple(&req(&p, 64, Mode::Ar, Sampling::greedy()));
        assert_eq!(ar.tokens.len(), 64);
        assert_eq!(ar.finish_reason, FinishReason::Length);
        assert_eq!(ar.spec.verify_steps, 0);
        for budget in [0, 1, 2, 4, 8, 32, 100] {
            let dd = run_simple(&req(&p, 64, Mode::DDTree { budget }, Sampling::greedy()));
            assert_eq!(dd.tokens, ar.tokens, "prompt {p:?} budget {budget}");
            assert_eq!(dd.finish_reason, FinishReason::Length);
            let s = &dd.spec;
            assert_eq!(s.acceptance_histogram.iter().sum::<u64>(), s.verify_steps);
            assert_eq!(s.accepted_per_depth.len(), BLOCK - 1);
            assert_eq!(s.accepted_per_depth[0], s.verify_steps - s.acceptance_histogram[0]);
            assert!(s.drafted <= s.verify_steps * budget as u64);
            if budget >= 4 {
                // The mock drafter is usually right: rounds must commit several tokens on average.
                assert!(
                    s.acceptance_length() > 2.0,
                    "budget {budget}: tau {}",
                    s.acceptance_length()
                );
            }
            if budget == 0 {
                assert_eq!((s.drafted, s.accepted), (0, 0));
            }
        }
    }
}

#[test]
fn wider_trees_accept_at_least_as_much_on_average() {
    // Not a theorem per round; on this mock (the drafter's runner-up is often the right token) the
    // wider tree must need clearly fewer verify rounds for the same 96 tokens.
    let p = &prompts()[3];
    let b1 = run_simple(&req(p, 96, Mode::DDTree { budget: 1 }, Sampling::greedy()));
    let b32 = run_simple(&req(p, 96, Mode::DDTree { budget: 32 }, Sampling::greedy()));
    assert!(
        b32.spec.verify_steps < b1.spec.verify_steps,
        "{} vs {}",
        b32.spec.verify_steps,
        b1.spec.verify_steps
    );
}

#[test]
fn sampled_generation_is_reproducible_and_matches_ar() {
    // Top-k + top-p, and plain temperature (no cut at all), over several seeds.
    let configs = [(0.9f32, 0.95f32, 12usize), (1.3, 1.0, 0)];
    for (temperature, top_p, top_k) in configs {
        let s = |seed| Sampling {
            temperature,
            top_p,
            top_k,
            seed,
        };
        for p in prompts() {
            for seed in [11u64, 0, 7, 0xDEAD_BEEF_0000_0001] {
                let ar = run_simple(&req(&p, 48, Mode::Ar, s(seed)));
                assert_eq!(ar.tokens, run_simple(&req(&p, 48, Mode::Ar, s(seed))).tokens);
                assert_ne!(
                    ar.tokens,
                    run_simple(&req(&p, 48, Mode::Ar, s(seed + 1))).tokens,
                    "seed must matter"
                );
                for budget in [1, 8, 70] {
                    let dd = run_simple(&req(&p, 48, Mode::DDTree { budget }, s(seed)));
                    // The token at position p uses the uniform of (seed, p) in both loops.
                    assert_eq!(
                        dd.tokens, ar.tokens,
                        "prompt {p:?} seed {seed} budget {budget} T {temperature}"
                    );
                    if budget >= 8 && top_k > 0 {
                        assert!(
                            dd.spec.acceptance_length() > 1.2,
                            "sampled rounds still accept: {}",
                            dd.spec.acceptance_length()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn stop_tokens_cut_like_ar() {
    for p in prompts() {
        let full = run_simple(&req(&p, 40, Mode::Ar, Sampling::greedy())).tokens;
        let mut stops: Vec<u32> = full[1..].to_vec();
        stops.sort();
        stops.dedup();
        for stop in stops {
            let mut r = req(&p, 40, Mode::Ar, Sampling::greedy());
            r.stop_token_ids = vec![1000, stop];
            let ar = run_simple(&r);
            let first = full.iter().position(|&t| t == stop).unwrap();
            assert_eq!(ar.tokens, full[..=first].to_vec());
            assert_eq!(ar.finish_reason, FinishReason::Stop);
            for budget in [2, 16, 90] {
                r.mode = Mode::DDTree { budget };
                let dd = run_simple(&r);
                assert_eq!(dd.tokens, ar.tokens, "stop {stop} budget {budget}");
                assert_eq!(dd.finish_reason, FinishReason::Stop);
            }
        }
    }
}

#[test]
fn max_tokens_cut_like_ar() {
    let p = &prompts()[1];
    let full = run_simple(&req(p, 30, Mode::Ar, Sampling::greedy())).tokens;
    for m in 0..=30 {
        for mode in [Mode::Ar, Mode::DDTree { budget: 8 }, Mode::DDTree { budget: 65 }] {
            let out = run_simple(&req(p, m, mode, Sampling::greedy()));
            assert_eq!(out.tokens, full[..m].to_vec(), "max_tokens {m} {mode:?}");
            assert_eq!(out.finish_reason, FinishReason::Length);
        }
    }
}

#[test]
fn callback_sees_every_prefix_and_can_stop() {
    let p = &prompts()[2];
    for mode in [Mode::Ar, Mode::DDTree { budget: 8 }] {
        let mut seen = Vec::new();
        let mut cb = |t: &[u32]| {
            seen.push(t.len());
            t.len() == 9
        };
        let out = run(
            &mut MockTarget::new(4096),
            &mut MockDrafter::new(BLOCK),
            &req(p, 50, mode, Sampling::greedy()),
            &mut cb,
        );
        assert_eq!(out.finish_reason, FinishReason::Callback);
        assert_eq!(out.tokens.len(), 9);
        assert_eq!(seen, (1..=9).collect::<Vec<_>>(), "{mode:?}");
    }
}

#[test]
fn position_limit_ends_both_modes_identically() {
    let p = &prompts()[1];
    let max_pos = p.len() + 12;
    let ar = run(
        &mut MockTarget::new(max_pos),
        &mut MockDrafter::new(BLOCK),
        &req(p, 100, Mode::Ar, Sampling::greedy()),
        &mut |_| false,
    );
    // The last generated token's input sits at max_pos - 1: 13 tokens in all.
    assert_eq!(ar.tokens.len(), 13);
    assert_eq!(ar.finish_reason, FinishReason::Length);
    for budget in [4, 40] {
        let mut t = MockTarget::new(max_pos);
        let dd = run(
            &mut t,
            &mut MockDrafter::new(BLOCK),
            &req(p, 100, Mode::DDTree { budget }, Sampling::greedy()),
            &mut |_| false,
        );
        assert_eq!(dd.tokens, ar.tokens);
        assert_eq!(dd.finish_reason, FinishReason::Length);
        assert_eq!(t.committed(), max_pos);
    }
}

#[test]
fn unbounded_max_tokens_ends_at_the_position_limit() {
    // max_tokens = usize::MAX (no limit but the context): sizing the caches for prompt + max_tokens must not
    // overflow; the generation ends at the position limit like a bounded one.
    let p = &prompts()[1];
    let max_pos = p.len() + 12;
    for mode in [Mode::Ar, Mode::DDTree { budget: 4 }, Mode::Chain] {
        let out = run(
            &mut MockTarget::new(max_pos),
            &mut MockDrafter::new(BLOCK),
            &req(p, usize::MAX, mode, Sampling::greedy()),
            &mut |_| false,
        );
        assert_eq!(
            (out.tokens.len(), out.finish_reason),
            (13, FinishReason::Length),
            "{mode:?}"
        );
    }
}

#[test]
fn ddtree_without_drafter_or_prompt_is_an_error() {
    let r = req(&[1, 2], 5, Mode::DDTree { budget: 4 }, Sampling::greedy());
    assert!(generate(&mut MockTarget::new(64), None, &r, &mut |_| false).is_err());
    let r = req(&[], 5, Mode::Ar, Sampling::greedy());
    assert!(generate(&mut MockTarget::new(64), None, &r, &mut |_| false).is_err());
}

#[test]
fn a_session_is_reset_between_generations() {
    let (mut t, mut d) = (MockTarget::new(4096), MockDrafter::new(BLOCK));
    let a = req(&prompts()[0], 20, Mode::DDTree { budget: 8 }, Sampling::greedy());
    let b = req(&prompts()[3], 20, Mode::DDTree { budget: 8 }, Sampling::greedy());
    let first_b = run(&mut t, &mut d, &b, &mut |_| false).tokens;
    run(&mut t, &mut d, &a, &mut |_| false);
    assert_eq!(run(&mut t, &mut d, &b, &mut |_| false).tokens, first_b);
}

#[test]
fn a_round_is_one_step_and_keep_cuts_inside_its_path() {
    use kdtree_engine::{ProbeSet, Session};
    let (mut t, mut d) = (MockTarget::new(4096), MockDrafter::new(BLOCK));
    let p = &prompts()[3];
    let mut s = Session::new(Box::new(&mut t), Some(Box::new(&mut d)), Mode::DDTree { budget: 24 }).unwrap();
    s.set_probes(ProbeSet {
        rounds: true,
        logits: true,
        layers: false,
    });
    let root = s.prefill(p, &Sampling::greedy()).unwrap();
    let step = s.step().unwrap();
    let probes = s.take_probes();
    let rec = &probes.rounds[0];
    assert_eq!(
        kdtree_engine::sampling::argmax(&probes.logits[0]),
        root,
        "the prefill's last row decided the root"
    );
    let n = rec.tree.len();
    assert_eq!(
        (rec.start, rec.draft_rows, rec.tree.tokens[0], rec.tree.drafted()),
        (p.len(), BLOCK - 1, root, 24)
    );
    assert_eq!(rec.draft_logits.len(), (BLOCK - 1) * generate_common::VOCAB);
    assert_eq!(rec.verify.logits.len(), n * generate_common::VOCAB);
    assert_eq!(rec.tree.visibility.rows, n);
    assert_eq!(rec.walk.path[0], 0);
    assert_eq!(step.tokens, rec.new_tokens());
    assert_eq!((step.drafted, step.accepted), (24, rec.walk.accepted()));
    assert_eq!(
        s.committed(),
        p.len() + rec.walk.path.len(),
        "a step commits root + accepted nodes"
    );
    assert!(
        rec.walk.accepted() >= 1,
        "the mock drafter is accepted here, so keep(1) really cuts"
    );
    // Keep only the first token (the root is committed, the first emitted token is pending).
    s.keep(1).unwrap();
    assert_eq!(s.committed(), p.len() + 1);
    assert!(
        s.keep(0).is_err() && s.keep(2).is_err(),
        "keep is bounded by the (already cut) step"
    );
    drop(s);
    assert_eq!(d.context_len(), t.committed());
    let want: Vec<u32> = p.iter().copied().chain([root]).collect();
    assert_eq!(t.committed_tokens(), &want[..]);
}
