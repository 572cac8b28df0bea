//! `--verify GOLDEN_DIR`: re-run what a kdtree-golden bundle recorded and compare.
//!
//! Per prompt of the bundle (the `--prompts` file must be the one the bundle was made from: same ids):
//! 1. prompt ids: kdtree-run's own encoding of the line must equal the bundle's `prompt_ids`;
//! 2. greedy AR, re-recorded by the very function kdtree-golden records with
//!    (`kdtree_golden::reference::greedy_ar`, an AR Session with probes) with the bundle's T =
//!    `ar.tokens.len()` steps and **no stop tokens** (the bundle's `ar.tokens` never stops at EOS): all T
//!    tokens must be equal (strict; a prefix comparison would let a run that stops early pass on one token);
//! 3. logits: every step's top-k (ids exactly; values within the tolerance) and the full rows of the first
//!    S steps within the tolerance; the per-layer probes of the traced decode step (attention output,
//!    router ids exactly and weights, MoE/MLP output, residual) within their tolerances;
//! 4. the DDTree round (`kdtree_golden::reference::ddtree_round_record`: a DDTree Session's prefill and
//!    one step, captured by the round probe): start, root, draft rows, tree tokens / parents / depths, visibility
//!    words, accepted path, decisions and bonus exactly; draft and verify logits within the tolerance;
//! 5. the line's own JSONL record, when it ran greedy in this invocation: its `token_ids` must equal
//!    `ar.tokens` over their common length (greedy DDTree == greedy AR; a stop ends the record early).
//!
//! Tolerances are per backend and per tensor ([`tolerances`]). On the CPU all of the above is strict (tolerance
//! 0, bit for bit). On CUDA the tolerances are measured (see [`CUDA_TOLERANCES`]) and the tie- and
//! route-aware rules of verify/rules.rs apply: a greedy divergence only at a near-tie of the bundle's top-2
//! (later steps then not compared), logit rows beyond the tolerance only as route flips (within
//! `route_flip`, the bundle's argmax), router ids as sets with one swap forgiven at a clean router input,
//! a reordered tree only at a draft near-tie, walk decisions only at a verify near-tie; each acceptance is
//! a note printed under the table. The model is the run's own (`engine::open`,
//! absorbed MLA: the configuration that ships), the loader kdtree-golden records with.
//!
//! Before any line is generated, the model is matched to the bundle's ([`check_model`]): the architecture
//! must be the bundle's (else exit 2), and a model whose manifest.toml is not the bundle's must reproduce
//! the bundle's first AR step of its first prompt ([`first_step`], one prefill) or the run stops at once with
//! exit 1 ([`CheckFailed`]): another model of the same architecture is caught before the generation.
//!
//! Modules: compare.rs (the comparisons), rules.rs (the CUDA rules), table.rs (the report).
//! Tests: bottom of each module, e2e_tests.rs, tests/verify_cli.rs (end to end, pass and forced failures).

use anyhow::{bail, ensure, Result};
use kdtree_engine::{Loaded, Mode};
use kdtree_golden::bundle::{ArRecord, Bundle, PromptRecord};
use kdtree_golden::make::trace_record;
use kdtree_golden::reference::{ddtree_round_record, greedy_ar, ArOptions};
use kdtree_text::prompts::PromptLine;
use std::path::Path;

mod compare;
#[cfg(test)]
mod e2e_tests;
mod rules;
mod table;

use compare::{
    compare_ar, compare_ar_tolerant, compare_round, compare_round_tolerant, compare_trace, compare_trace_tolerant,
    first_diff, Cmp,
};
pub use table::table;

/// A check that failed before the run's work (exit 1, not 2: the inputs are fine, they do not match).
#[derive(Debug)]
pub struct CheckFailed(pub String);

impl std::fmt::Display for CheckFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CheckFailed {}

/// Largest |Δ| allowed per compared tensor class, and whether near-ties and route flips are forgiven.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// Logits (AR rows and top-k values, DDTree draft and verify logits); also the near-tie margin.
    pub logits: f32,
    /// Per-layer probes: attention output, MoE/MLP output, residual.
    pub layers: f32,
    /// Router weights (ids always compare exactly, as sets with `near_ties`).
    pub router_weights: f32,
    /// A target logit row beyond `logits` but within this, with the bundle's argmax, is a route flip
    /// (rules.rs) when the bundle's CPU router margin on its rows is below `route_flip_margin`; 0 = none.
    pub route_flip: f32,
    /// The router decision margin below which a route may flip under this backend's error (rules.rs).
    pub route_flip_margin: f32,
    /// The tie- and route-aware rules of rules.rs; false = every check strict.
    pub near_ties: bool,
}

/// The CPU backend: 0 everywhere, i.e. bit-identical values, and every check strict. The CPU re-run is
/// the very code that recorded the bundle (same loader, same absorbed MLA, same Session calls), and the
/// CPU reference reduces in a fixed order that does not depend on the thread count (golden `regen.sh
/// --check` proves byte equality at 1 and 2 threads), so any difference is a real change.
pub const CPU_TOLERANCES: Tolerances = Tolerances {
    logits: 0.0,
    layers: 0.0,
    router_weights: 0.0,
    route_flip: 0.0,
    route_flip_margin: 0.0,
    near_ties: false,
};

/// The CUDA backend (bf16 activations at every GEMM input, bf16 latent cache, another reduction order).
/// Measured on the H200 (2026-12-01, `examples/bundle_delta.rs` on bundles `kdtree-golden --device cuda`
/// recorded, against the committed CPU ones: golden/ synthetic tiny, golden/kdtree-tiny trained pair), over
/// rows and tokens whose routes agree: logits 5.7e-2 (synthetic) / 7.6e-2 (pair: AR rows and top-k values,
/// draft rows <= 3.4e-2, verify rows), per-layer probes 1.9e-2 / 8.2e-2 (pair k-chat layer 3 residual,
/// max |value| 7.5), router weights 1.8e-3 / 1.2e-2; 2x margin each, as the CUDA parity tests
/// (engine/tests/cuda_target.rs). Route flips: the largest row measured after one is 1.90 (synthetic g-mid
/// AR step 2; pair k-code verify node 1: 0.57, its child 0.18); 2x: 4.0. The near-tie margin is the logits
/// tolerance: the measured flips had margins 3.8e-3 (g-mid AR step 7), 3.8e-3 (draft row 0 of g-short).
/// A route flip needs evidence: the bundle's CPU router decision margin on the row's own rows (the row and the
/// rows it attends through: earlier AR steps, tree ancestors) below 3e-3. The flips measured on the GPU had
/// margins of 1.5e-3 (synthetic g-mid verify node 6, run 52), 6.4e-4 (g-mid AR step 2), 5.0e-4 (trained pair
/// k-code verify node 1), 2.1e-4, 9.7e-5 and 4.0e-5 (the pair's held-out prompts, run 51), 4.9e-5 and 3.8e-5
/// (the real-width gate, runs 50 and 52): 2x the largest.
pub const CUDA_TOLERANCES: Tolerances = Tolerances {
    logits: 0.15,
    layers: 0.165,
    router_weights: 0.025,
    route_flip: 4.0,
    route_flip_margin: 3e-3,
    near_ties: true,
};

/// The tolerances of `backend` (as `engine::open` names it).
pub fn tolerances(backend: &str) -> Result<Tolerances> {
    match backend {
        "cpu" => Ok(CPU_TOLERANCES),
        "cuda" => Ok(CUDA_TOLERANCES),
        other => bail!("--verify: no tolerances are defined for backend {other:?}"),
    }
}

/// The prompt file's ids must be the bundle's (same set; order free). Err names what differs.
pub fn check_ids(lines: &[PromptLine], bundle: &Bundle, prompts: &Path) -> Result<()> {
    let ours: Vec<&str> = lines.iter().map(|l| l.id.as_str()).collect();
    let theirs: Vec<&str> = bundle.index.prompts.iter().map(|p| p.id.as_str()).collect();
    let only_ours: Vec<&str> = ours.iter().copied().filter(|id| !theirs.contains(id)).collect();
    let only_theirs: Vec<&str> = theirs.iter().copied().filter(|id| !ours.contains(id)).collect();
    ensure!(
        only_ours.is_empty() && only_theirs.is_empty() && ours.len() == theirs.len(),
        "--prompts {} is not the prompt file of the bundle {}: ids only in the prompt file {only_ours:?}, \
         only in the bundle's index.json {only_theirs:?} ({} lines vs {} bundle prompts)",
        prompts.display(),
        bundle.dir.display(),
        ours.len(),
        theirs.len()
    );
    Ok(())
}

/// The loaded model's shape facts must be the bundle's (a different architecture is an error, not a
/// mismatch). Returns a warning when only the manifest hash differs (another conversion of the model, or
/// another model: [`first_step`] decides before the run, the numbers after it).
pub fn check_model(bundle: &Bundle, model: &Loaded, manifest_sha256: &str) -> Result<Option<String>> {
    let m = &bundle.index.model;
    let i = model.info();
    let block = model.block_size();
    let ours = (i.vocab_size, i.hidden_size, i.num_layers, &i.tap_layers, block);
    let theirs = (m.vocab_size, m.hidden_size, m.num_layers, &m.tap_layers, m.block_size);
    ensure!(
        ours == theirs,
        "the model is not the bundle's architecture: (vocab, hidden, layers, tap layers, drafter block) = \
         ({}, {}, {}, [{}], {}), bundle {} has ({}, {}, {}, [{}], {})",
        ours.0,
        ours.1,
        ours.2,
        join(ours.3),
        ours.4,
        bundle.dir.display(),
        theirs.0,
        theirs.1,
        theirs.2,
        join(theirs.3),
        theirs.4
    );
    Ok((manifest_sha256 != m.manifest_sha256).then(|| {
        format!(
            "the model's manifest.toml sha256 {manifest_sha256} differs from the bundle's {} (another conversion? \
             on the CPU a different rank count alone changes the summation order, ~1e-6); its first step matches \
             the bundle's, comparing everything",
            m.manifest_sha256
        )
    }))
}

fn join(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// A model whose manifest is not the bundle's ([`check_model`] warned): re-run the first AR step of the
/// bundle's first prompt (its own `prompt_ids`: the model is judged, not the tokenizer) and compare it as
/// [`check_prompt`] would. Err([`CheckFailed`]) when it differs, naming the prompt and the first difference;
/// the cost is one prefill, against a whole run's generation.
pub fn first_step(
    bundle: &Bundle,
    (id, rec): (&str, &PromptRecord),
    model: &mut Loaded,
    tol: &Tolerances,
    manifest_sha256: &str,
) -> Result<()> {
    let (want, info) = (&rec.ar, model.info().clone());
    let n = want.tokens.len().min(1);
    if n == 0 || want.vocab != info.vocab_size || rec.prompt_ids.len() + n > info.max_positions {
        return Ok(()); // check_prompt reports what does not fit
    }
    let (k, full) = (want.topk, want.full_steps.min(n));
    let want = ArRecord {
        tokens: want.tokens[..n].to_vec(),
        topk: k,
        topk_ids: want.topk_ids[..n * k].to_vec(),
        topk_logits: want.topk_logits[..n * k].to_vec(),
        vocab: want.vocab,
        full_steps: full,
        full_logits: want.full_logits[..full * want.vocab].to_vec(),
        router_margins: want.router_margins.iter().take(n).copied().collect(),
    };
    let opts = ArOptions {
        max_tokens: n,
        topk: k,
        full_logits_steps: full,
        trace_step: 0,
    };
    let (got, rows, _) = greedy_ar(&mut model.session(Mode::Ar)?, &rec.prompt_ids, &opts)?;
    let mut c = PromptCheck::default();
    let mut cmp = Cmp {
        tol: tol.logits,
        max_delta: 0.0,
    };
    if tol.near_ties {
        compare_ar_tolerant(&mut c, &mut cmp, tol, &got, &rows, &want);
    } else {
        compare_ar(&mut c, &mut cmp, &got, &rows, &want);
    }
    match c.problems.first() {
        None => Ok(()),
        Some(p) => Err(CheckFailed(format!(
            "the model is not the bundle's: its manifest.toml sha256 {manifest_sha256} is not the bundle's {} and \
             the first step of prompt {} differs ({p}); stopped before generating (another model of the same \
             architecture, or another conversion whose numbers differ)",
            bundle.index.model.manifest_sha256, id
        ))
        .into()),
    }
}

/// The outcome of one prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PromptCheck {
    pub id: String,
    /// Leading AR tokens equal to the bundle's, of `tokens_total`.
    pub tokens_equal: usize,
    pub tokens_total: usize,
    /// Largest |Δ| over every compared logit (AR full rows and top-k values, DDTree draft and verify).
    pub max_delta: f32,
    /// None: the bundle has no DDTree round; Some(true): it matched.
    pub ddtree: Option<bool>,
    /// What differs, one line each (empty = match).
    pub problems: Vec<String>,
    /// What the tie- and route-aware rules accepted, one line each (printed for every prompt).
    pub notes: Vec<String>,
}

impl PromptCheck {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// What the line's run gave, for the record check (5).
pub enum RunTokens<'a> {
    /// Greedy record written in this invocation.
    Greedy(&'a [u32]),
    /// Sampled, failed, or written by an earlier run (--resume): not compared.
    NotCompared,
}

/// Check one prompt: `prompt` is kdtree-run's own encoding of the line (Err: why it has none).
pub fn check_prompt(
    id: &str,
    model: &mut Loaded,
    prompt: Result<Vec<u32>, String>,
    run: RunTokens,
    rec: &PromptRecord,
    tol: &Tolerances,
) -> Result<PromptCheck> {
    let mut c = PromptCheck {
        id: id.to_string(),
        tokens_total: rec.ar.tokens.len(),
        ..Default::default()
    };
    c.ddtree = rec.ddtree.as_ref().map(|_| false);
    let mut cmp = Cmp {
        tol: tol.logits,
        max_delta: 0.0,
    };
    let same_prompt = match prompt {
        Err(e) => {
            c.problems.push(format!("prompt: {e}"));
            false
        }
        Ok(p) => {
            c.problems.extend(first_diff("prompt ids", &p, &rec.prompt_ids));
            p == rec.prompt_ids
        }
    };
    let info = model.info().clone();
    let t = rec.ar.tokens.len();
    if rec.ar.vocab != info.vocab_size || rec.prompt_ids.len() + t > info.max_positions {
        c.problems.push(format!(
            "the bundle's {} prompt + {t} tokens (vocab {}) do not fit the model (max_positions {}, vocab {})",
            rec.prompt_ids.len(),
            rec.ar.vocab,
            info.max_positions,
            info.vocab_size
        ));
        return Ok(c);
    }
    // The run answered the line's own prompt; its tokens say something about the bundle only when that
    // prompt is the bundle's (else the prompt-ids problem above already fails the prompt).
    let run_tokens = match (run, same_prompt) {
        (RunTokens::Greedy(toks), true) => Some(&toks[..toks.len().min(t)]),
        _ => None,
    };
    let trace_step = rec.trace.as_ref().map_or(0, |t| t.step);
    let opts = ArOptions {
        max_tokens: t,
        topk: rec.ar.topk,
        full_logits_steps: rec.ar.full_steps,
        trace_step,
    };
    let (ar, rows, traced) = greedy_ar(&mut model.session(Mode::Ar)?, &rec.prompt_ids, &opts)?;
    // Steps whose tokens are compared (all on the strict path; up to a forgiven near-tie otherwise).
    let compared = if tol.near_ties {
        compare_ar_tolerant(&mut c, &mut cmp, tol, &ar, &rows, &rec.ar)
    } else {
        compare_ar(&mut c, &mut cmp, &ar, &rows, &rec.ar);
        t
    };
    if let Some(toks) = run_tokens {
        let what = "the run's token_ids (greedy) vs ar.tokens";
        let (toks, want) = (
            &toks[..toks.len().min(compared)],
            &rec.ar.tokens[..toks.len().min(compared)],
        );
        if tol.near_ties {
            match rules::greedy(
                what,
                toks,
                want,
                false,
                |s| rules::margin_sorted(rec.ar.topk_row(s).1),
                tol.logits,
            ) {
                Ok(None) => {}
                Ok(Some((k, m))) => c.notes.push(format!(
                    "{what}[{k}]: {} vs bundle {}: a near-tie (margin {m:.3e}); later tokens not compared",
                    toks[k], want[k]
                )),
                Err(p) => c.problems.push(p),
            }
        } else {
            c.problems.extend(first_diff(what, toks, want));
        }
    }
    if let Some(want) = &rec.trace {
        match traced {
            _ if compared < want.step => c.notes.push(format!(
                "trace: step {} follows the near-tie divergence: not compared",
                want.step
            )),
            None => c
                .problems
                .push(format!("trace: the re-run recorded no probes at step {}", want.step)),
            Some((step, position, token, tr)) => {
                let got = trace_record(&tr, step, position, token, info.num_layers)?;
                if tol.near_ties {
                    compare_trace_tolerant(&mut c, &mut cmp, tol, &got, want);
                } else {
                    compare_trace(&mut c, &mut cmp, tol, &got, want);
                }
            }
        }
    }
    if let Some(want) = &rec.ddtree {
        if !model.has_drafter() {
            c.problems
                .push("the bundle has a DDTree round but the model has no drafter".into());
        } else if tol.near_ties && ar.tokens.first() != rec.ar.tokens.first() {
            c.notes
                .push("ddtree: its root (AR token 0) differs from the bundle's: the round is not compared".into());
            c.ddtree = None;
        } else {
            let got = ddtree_round_record(
                &mut model.session(Mode::DDTree { budget: want.budget })?,
                &rec.prompt_ids,
                want.budget,
            )?;
            c.ddtree = Some(if tol.near_ties {
                compare_round_tolerant(&mut c, &mut cmp, tol, &got, want)
            } else {
                compare_round(&mut c, &mut cmp, &got, want)
            });
        }
    }
    c.max_delta = cmp.max_delta;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerances_per_backend() {
        assert_eq!(tolerances("cpu").unwrap(), CPU_TOLERANCES);
        assert_eq!(tolerances("cuda").unwrap(), CUDA_TOLERANCES);
        // the CPU stays strict: no tolerance, no forgiven near-tie or route flip
        assert_eq!((CPU_TOLERANCES.near_ties, CPU_TOLERANCES.route_flip), (false, 0.0));
        assert!(tolerances("tpu").is_err());
    }
}
