//! The cuda rules end to end on the CPU backend: a bundle of the tiny synthetic preset (+ drafter) is
//! recorded, perturbed within / beyond CUDA_TOLERANCES, and [`check_prompt`] with those tolerances must
//! pass / fail it against a CPU re-run (the rules are picked by the tolerances, not by the backend, so the
//! CPU can exercise them; the CLI always takes its backend's own).

use super::*;
use kdtree_golden::bundle::Bundle;
use std::sync::OnceLock;

/// (tempdir, model, its bundle's records).
type Fixture = (tempfile::TempDir, std::path::PathBuf, Vec<(String, PromptRecord)>);

/// The fixture, built once.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let hf = d.path().join("hf");
        kdtree_convert::synth::write("tiny", &hf, 0, true, None).unwrap();
        let model = d.path().join("model");
        kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
            src: hf.clone(),
            out: model.clone(),
            drafter: Some(hf.join("drafter")),
            ranks: 1,
            experts: kdtree_formats::plan::ExpertsMode::Tp,
            max_file_size: 1 << 30,
            quiet: true,
        })
        .unwrap();
        let prompts = d.path().join("p.jsonl");
        std::fs::write(&prompts, "{\"id\": \"p1\", \"prompt_token_ids\": [1, 17, 305, 42]}\n").unwrap();
        let golden = d.path().join("golden");
        let opts = kdtree_golden::make::Options {
            max_tokens: 6,
            budget: 6,
            full_logits_steps: 6,
            topk: 4,
            trace_step: 1,
            no_ddtree: false,
            quiet: true,
        };
        kdtree_golden::make::make_bundle(&model, &prompts, &golden, &opts).unwrap();
        let recs = Bundle::open(&golden).unwrap().load_all().unwrap();
        (d, model, recs)
    })
}

/// check_prompt of the perturbed record with the CUDA tolerances on a CPU re-run.
fn check(edit: impl FnOnce(&mut PromptRecord)) -> PromptCheck {
    let (_, model, recs) = fixture();
    let mut rec = recs[0].1.clone();
    edit(&mut rec);
    let mut m = kdtree_engine::open(model, kdtree_engine::Device::Cpu).unwrap();
    check_prompt(
        "p1",
        &mut m,
        Ok(rec.prompt_ids.clone()),
        RunTokens::NotCompared,
        &rec,
        &CUDA_TOLERANCES,
    )
    .unwrap()
}

fn nudge(v: &mut [f32], by: f32) {
    v.iter_mut().for_each(|x| *x += by);
}

#[test]
fn values_within_the_cuda_tolerances_pass_without_notes() {
    let c = check(|r| {
        nudge(&mut r.ar.full_logits, 0.14);
        nudge(&mut r.ar.topk_logits, 0.14);
        let d = r.ddtree.as_mut().unwrap();
        nudge(&mut d.draft_logits, -0.14);
        nudge(&mut d.verify_logits, 0.14);
        for l in &mut r.trace.as_mut().unwrap().layers {
            nudge(&mut l.residual, 0.16);
            nudge(&mut l.router_weights, 0.02);
            l.router_ids.reverse(); // order only: the same experts
            l.router_weights.reverse();
        }
    });
    assert!(c.ok() && c.notes.is_empty(), "{c:?}");
    assert_eq!(c.ddtree, Some(true));
    assert!(c.max_delta > 0.159 && c.max_delta < 0.161, "{}", c.max_delta); // the residual nudge
}

#[test]
fn values_beyond_the_cuda_tolerances_fail() {
    let c = check(|r| nudge(&mut r.ddtree.as_mut().unwrap().draft_logits[..3], 0.16));
    assert!(
        !c.ok() && c.problems[0].starts_with("ddtree.draft_logits[0, 0]"),
        "{c:?}"
    );
    let c = check(|r| r.trace.as_mut().unwrap().layers[2].attn_out[5] += 0.17);
    assert!(
        !c.ok() && c.problems[0].starts_with("trace.layers.2.attn_out[5]"),
        "{c:?}"
    );
    // a logit row far beyond the route-flip tolerance
    let c = check(|r| r.ar.full_logits[r.ar.vocab + 3] -= 4.5);
    assert!(
        c.problems.iter().any(|p| p.starts_with("ar.full_logits step 1")),
        "{c:?}"
    );
}

#[test]
fn a_route_flip_sized_row_is_accepted_only_with_the_bundles_router_evidence() {
    let flip = |margin: f32| {
        move |r: &mut PromptRecord| {
            let v = r.ar.vocab;
            let i = (0..v)
                .find(|&i| i as u32 != r.ar.tokens[2] && !r.ar.topk_row(2).0.contains(&(i as u32)))
                .unwrap();
            r.ar.full_logits[2 * v + i] += 1.0;
            // the bundle's CPU router margin on the rows of step 2: a route may flip below 3e-3
            assert!(r.ar.router_margins.len() > 2, "the CPU bundle records router margins");
            r.ar.router_margins[2] = margin;
        }
    };
    let c = check(flip(5e-5));
    assert!(c.ok(), "{c:?}");
    assert_eq!(c.notes.len(), 1, "{c:?}");
    assert!(
        c.notes[0].starts_with("ar.full_logits step 2: max |Δ| 1.000e0") && c.notes[0].contains("route flip"),
        "{c:?}"
    );
    // the same row where the CPU's router decided with a margin of 5e-3: no route flip, a mismatch
    let c = check(flip(5e-3));
    assert!(
        c.problems
            .iter()
            .any(|p| p.starts_with("ar.full_logits step 2") && p.contains("not a route flip")),
        "{c:?}"
    );
    // and a bundle without margins (recorded before they existed, or on a GPU): strict
    let c = check(|r| {
        let v = r.ar.vocab;
        r.ar.full_logits[2 * v + 1] += 1.0;
        r.ar.router_margins.clear();
    });
    assert!(
        c.problems.iter().any(|p| p.contains("records no router margins")),
        "{c:?}"
    );
}

#[test]
fn a_greedy_divergence_passes_only_at_a_near_tie_and_stops_the_comparison() {
    // the bundle says step 3 chose its second-ranked token, at a margin of 0.01: a near-tie
    let tie = |margin: f32| {
        move |r: &mut PromptRecord| {
            let k = r.ar.topk;
            let second = r.ar.topk_ids[3 * k + 1];
            r.ar.tokens[3] = second;
            r.ar.topk_logits[3 * k + 1] = r.ar.topk_logits[3 * k] - margin;
            // the edit moves that logit ~0.5 from the run's: as if a route flipped there (the CPU router's
            // margin on the row below 3e-3), so that only the token rule is under test
            r.ar.router_margins[3] = 1e-5;
            // later steps followed another prefix: anything there must not be compared
            r.ar.tokens[5] = (r.ar.tokens[5] + 1) % r.ar.vocab as u32;
            nudge(&mut r.ar.full_logits[4 * r.ar.vocab..], 3.0);
        }
    };
    let c = check(tie(0.01));
    assert!(c.ok(), "{c:?}");
    assert!(
        c.notes
            .iter()
            .any(|n| n.starts_with("ar.tokens[3]: ") && n.contains("near-tie") && n.contains("steps after 3")),
        "{c:?}"
    );
    assert_eq!(c.tokens_equal, 3);
    // the same divergence at a margin of 0.5 is a real one
    let c = check(tie(0.5));
    assert!(
        c.problems
            .iter()
            .any(|p| p.starts_with("ar.tokens[3]: ") && p.contains("not a near-tie")),
        "{c:?}"
    );
}

#[test]
fn router_sets_one_swap_with_a_clean_input_passes_two_fail() {
    let moe = |r: &PromptRecord| {
        r.trace
            .as_ref()
            .unwrap()
            .layers
            .iter()
            .position(|l| !l.router_ids.is_empty())
            .unwrap()
    };
    let swap = |n: usize| {
        move |r: &mut PromptRecord| {
            let l = moe(r);
            let layer = &mut r.trace.as_mut().unwrap().layers[l];
            for j in 0..n {
                // an expert the token did not pick
                let free = (0..64).find(|e| !layer.router_ids.contains(e)).unwrap();
                layer.router_ids[j] = free;
            }
            nudge(&mut layer.mlp_out, 1.0); // the other experts' output: not compared after a forgiven swap
        }
    };
    let c = check(swap(1));
    assert!(
        c.ok() && c.notes.iter().any(|n| n.contains("one expert swapped")),
        "{c:?}"
    );
    let c = check(swap(2));
    assert!(c.problems.iter().any(|p| p.contains("2 experts swapped")), "{c:?}");
}

#[test]
fn a_changed_walk_decision_fails_without_a_near_tie() {
    let c = check(|r| {
        let d = r.ddtree.as_mut().unwrap();
        d.decisions[0] = (d.decisions[0] + 1) % d.vocab as u32;
    });
    assert!(c.problems.iter().any(|p| p.starts_with("ddtree.decisions[0]")), "{c:?}");
    assert_eq!(c.ddtree, Some(false));
}
