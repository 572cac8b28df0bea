//! The reference computations shared by `kdtree-golden` (which records them) and `kdtree-run --verify`
//! (which re-runs them and compares): how the model is loaded, the greedy AR recording and the one
//! DDTree round. Both tools call these very functions through the engine's Session API (probes capture
//! the logits, per-layer tensors and the round), so a CPU re-run repeats the recording operation for
//! operation and must reproduce every recorded value bit for bit.
//!
//! Loading: [`open`] is `kdtree_engine::open_with` — the loader and the configuration that ship (absorbed
//! MLA, the load check on), so what is verified is what runs. Tests: tools/kdtree-golden/tests/determinism.rs,
//! tools/kdtree-run/tests/verify_cli.rs.

use crate::bundle::{topk_of, ArRecord, DdtreeRecord};
use anyhow::{ensure, Context, Result};
use kdtree_engine::generate::Sampling;
use kdtree_engine::model::Trace;
use kdtree_engine::{Device, Loaded, Mode, ProbeSet, Session};
use std::path::Path;

/// A converted model opened by the engine's loader, with its manifest hash.
pub struct RefModel {
    pub loaded: Loaded,
    /// sha256 of the directory's manifest.toml.
    pub manifest_sha256: String,
}

/// Open `dir` on `device` with the engine's own loader (the target tapping the layers the drafter was
/// trained on and, when the directory holds one, the DFlash drafter), with the load check on: every tensor's
/// bytes against the manifest's xxh3-64 (a reference is never recorded, nor a score taken, on damaged weights).
pub fn open(dir: &Path, device: Device) -> Result<RefModel> {
    let manifest_sha256 = kdtree_formats::manifest::manifest_sha256(dir)?;
    // `kdtree_engine::open`'s options, with the GPU switches of the environment (`KDTREE_*`, docs/design/options.md).
    let opts = kdtree_engine::OpenOptions {
        attn_mode: kdtree_engine::AttnMode::Absorbed,
        gpu: kdtree_engine::GpuOptions::from_env(),
        // The shard bytes on the CPU (hashed in parallel), the device bytes on a GPU.
        check_weights: match device {
            Device::Cpu => kdtree_engine::WeightCheck::Host,
            _ => kdtree_engine::WeightCheck::Device,
        },
        ..Default::default()
    };
    let loaded =
        kdtree_engine::open_with(dir, device, opts).with_context(|| format!("opening model {}", dir.display()))?;
    Ok(RefModel {
        loaded,
        manifest_sha256,
    })
}

/// What the AR recording keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArOptions {
    /// Greedy steps; stop tokens do not end the run (the record always has this many tokens).
    pub max_tokens: usize,
    /// k of the per-step top-k (capped at the vocabulary).
    pub topk: usize,
    /// Steps whose full logits are kept (capped at `max_tokens`).
    pub full_logits_steps: usize,
    /// AR step (>= 1) whose single-token forward is traced per layer; 0 = none.
    pub trace_step: usize,
}

/// The per-layer probe of the traced decode forward: (step, position, fed token, trace).
pub type StepTrace = (usize, usize, u32, Trace);

/// Greedy AR on a fresh AR session: prefill `prompt`, then `max_tokens` argmax steps (stop tokens do not
/// stop it), keeping every step's top-k and the first steps' full logits. Returns the record, every
/// step's full logit row (what a comparison needs beyond the record) and the traced step's probes.
pub fn greedy_ar(
    s: &mut Session<'_>,
    prompt: &[u32],
    o: &ArOptions,
) -> Result<(ArRecord, Vec<Vec<f32>>, Option<StepTrace>)> {
    ensure!(s.mode() == Mode::Ar, "greedy_ar needs an AR session");
    let v = s.info().vocab_size;
    let mut rec = ArRecord {
        topk: o.topk.min(v),
        vocab: v,
        ..Default::default()
    };
    let mut rows = Vec::with_capacity(o.max_tokens);
    let mut trace = None;
    s.set_probes(ProbeSet {
        logits: true,
        ..Default::default()
    });
    let _ = s.take_probes();
    for step in 0..o.max_tokens {
        let tok = if step == 0 {
            s.prefill(prompt, &Sampling::greedy())?
        } else {
            s.set_probes(ProbeSet {
                logits: true,
                layers: step == o.trace_step,
                rounds: false,
            });
            let e = s.step()?;
            ensure!(e.tokens.len() == 1, "an AR step emitted {} tokens", e.tokens.len());
            e.tokens[0]
        };
        let mut p = s.take_probes();
        if step > 0 && step == o.trace_step {
            let tr = p.layers.pop().context("the layer probe recorded nothing")?;
            trace = Some((step, position_of_step(prompt, step), rec.tokens[step - 1], tr));
        }
        ensure!(
            p.logits.len() == 1,
            "step {step}: the logits probe recorded {} rows, expected 1",
            p.logits.len()
        );
        let row = p.logits.pop().unwrap_or_default();
        ensure!(
            row.len() == v,
            "step {step}: logit row of {} values, vocab {v}",
            row.len()
        );
        ensure!(row.iter().all(|x| x.is_finite()), "step {step}: non-finite logits");
        ensure!(
            kdtree_engine::sampling::argmax(&row) == tok,
            "step {step}: the session's greedy token is not the argmax of its row"
        );
        let (ids, vals) = topk_of(&row, rec.topk);
        rec.topk_ids.extend(ids);
        rec.topk_logits.extend(vals);
        if step < o.full_logits_steps {
            rec.full_logits.extend_from_slice(&row);
            rec.full_steps += 1;
        }
        rec.tokens.push(tok);
        rows.push(row);
    }
    s.set_probes(ProbeSet::default());
    Ok((rec, rows, trace))
}

/// Position of the token fed by AR step `step` (>= 1): the prompt, then `step − 1` generated tokens.
fn position_of_step(prompt: &[u32], step: usize) -> usize {
    prompt.len() + step - 1
}

/// One greedy DDTree round right after `prompt` on a DDTree session of `budget` (fresh state; root =
/// argmax of the prefill's last row), as one `Session::step`, captured by the round probe.
pub fn ddtree_round_record(s: &mut Session<'_>, prompt: &[u32], budget: usize) -> Result<DdtreeRecord> {
    ensure!(
        s.mode() == Mode::DDTree { budget },
        "ddtree_round_record needs a DDTree session of budget {budget}"
    );
    let v = s.info().vocab_size;
    s.set_probes(ProbeSet {
        rounds: true,
        ..Default::default()
    });
    let _ = s.take_probes();
    let root = s.prefill(prompt, &Sampling::greedy())?;
    let e = s.step()?;
    let rec = s
        .take_probes()
        .rounds
        .pop()
        .context("the round probe recorded nothing")?;
    s.set_probes(ProbeSet::default());
    ensure!(
        e.tokens == rec.new_tokens(),
        "the step's tokens differ from its recorded round"
    );
    let tree = &rec.tree;
    Ok(DdtreeRecord {
        start: rec.start,
        root,
        budget,
        vocab: v,
        draft_rows: rec.draft_rows,
        draft_logits: rec.draft_logits.clone(),
        tree_tokens: tree.tokens.clone(),
        tree_parents: tree.parents.clone(),
        tree_depths: tree.depths.clone(),
        visibility_words: tree.visibility.words,
        visibility: tree.visibility.bits.clone(),
        verify_logits: rec.verify.logits.clone(),
        accepted: rec.walk.path.clone(),
        decisions: rec.walk.decisions.clone(),
        bonus: rec.walk.bonus(),
        router_margins: Vec::new(),
    })
}
