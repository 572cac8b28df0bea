//! The reference computations shared by `kdtree-golden` (which records them) and `kdtree-run --verify`
//! (which re-runs them and compares): how the model is loaded, the greedy AR recording and the one
//! DDTree round. Both tools call these very functions, so a CPU re-run repeats the recording operation
//! for operation and must reproduce every recorded value bit for bit.
//!
//! Loading: [`open_cpu`] is the engine's one CPU loader (`kdtree_engine::open_cpu`, which `engine::open`
//! boxes) plus the manifest hash; it returns the concrete CPU types, because the golden tool needs
//! `CpuTarget`'s trace hook, which `engine::open`'s boxed `dyn Target` hides.
//! Tests: tools/kdtree-golden/tests/determinism.rs, tools/kdtree-run/tests/verify_cli.rs.

use crate::bundle::{sha256_hex, topk_of, ArRecord, DdtreeRecord};
use anyhow::{ensure, Context, Result};
use kdtree_engine::api::{Drafter, Target};
use kdtree_engine::drafter::DFlashDrafter;
use kdtree_engine::generate::{ddtree_round, prefill, Sampling};
use kdtree_engine::model::{AttnMode, CpuTarget};
use kdtree_engine::sampling::argmax;
use kdtree_engine::OpenOptions;
use std::path::Path;

/// MLA form of the CPU target the bundles are recorded with: the naive (transformers') form, which
/// crosscheck/ compares against transformers. `engine::open` defaults to the absorbed form, which agrees
/// only to ~1e-6 relative, so an exact re-run must use this one. It is not stored in the bundle (the
/// format is fixed); changing it changes every recorded logit (`make golden`).
pub const GOLDEN_ATTN_MODE: AttnMode = AttnMode::Naive;

/// A converted model on the CPU reference backend.
pub struct CpuModel {
    pub target: CpuTarget,
    pub drafter: Option<DFlashDrafter>,
    /// sha256 of the directory's manifest.toml.
    pub manifest_sha256: String,
}

/// Open `dir` on the CPU backend with MLA form `mode`: the target (tapping the layers the drafter was
/// trained on) and, when the directory holds one, the DFlash drafter over the target's tables.
pub fn open_cpu(dir: &Path, mode: AttnMode) -> Result<CpuModel> {
    let manifest_path = dir.join("manifest.toml");
    let manifest = std::fs::read(&manifest_path).with_context(|| format!("reading {}", manifest_path.display()))?;
    let m = kdtree_engine::open_cpu(dir, OpenOptions { attn_mode: mode })?;
    let (target, drafter) = (m.target, m.drafter);
    Ok(CpuModel { target, drafter, manifest_sha256: sha256_hex(&manifest) })
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
}

/// Moments of [`greedy_ar`] a caller can hook (the golden tool traces one decode forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArEvent {
    /// Right before the single-token forward that feeds `token` for step `step` (>= 1).
    BeforeDecode { step: usize, token: u32 },
    /// Right after that forward, before its commit.
    AfterDecode { step: usize, token: u32 },
}

/// Greedy AR from a fresh session: prefill `prompt`, then `max_tokens` argmax steps (stop tokens do not
/// stop it), keeping every step's top-k and the first steps' full logits. Returns the record and every
/// step's full logit row (what a comparison needs beyond the record).
pub fn greedy_ar<T: Target + AsDynTarget + ?Sized>(
    t: &mut T,
    prompt: &[u32],
    o: &ArOptions,
    hook: &mut dyn FnMut(&mut T, ArEvent) -> Result<()>,
) -> Result<(ArRecord, Vec<Vec<f32>>)> {
    let v = t.info().vocab_size;
    t.reset();
    let mut row = prefill(t.as_dyn(), None, prompt)?;
    let mut rec = ArRecord { topk: o.topk.min(v), vocab: v, ..Default::default() };
    let mut rows = Vec::with_capacity(o.max_tokens);
    for step in 0..o.max_tokens {
        if step > 0 {
            let fed = rec.tokens[step - 1];
            hook(t, ArEvent::BeforeDecode { step, token: fed })?;
            let out = t.forward(&[fed], &[-1])?;
            hook(t, ArEvent::AfterDecode { step, token: fed })?;
            t.commit(&[0])?;
            ensure!(out.logits.len() == v, "decode step returned {} logits, vocab {v}", out.logits.len());
            row = out.logits;
        }
        ensure!(row.iter().all(|x| x.is_finite()), "step {step}: non-finite logits");
        let tok = argmax(&row);
        let (ids, vals) = topk_of(&row, rec.topk);
        rec.topk_ids.extend(ids);
        rec.topk_logits.extend(vals);
        if step < o.full_logits_steps {
            rec.full_logits.extend_from_slice(&row);
            rec.full_steps += 1;
        }
        rec.tokens.push(tok);
        rows.push(std::mem::take(&mut row));
    }
    Ok((rec, rows))
}

/// One greedy DDTree round right after `prompt` (fresh sessions; root = argmax of the prefill's last
/// row), drafted, built, verified and walked by the engine's `ddtree_round`; nothing is committed.
pub fn ddtree_round_record(t: &mut dyn Target, d: &mut dyn Drafter, prompt: &[u32], budget: usize) -> Result<DdtreeRecord> {
    let v = t.info().vocab_size;
    t.reset();
    d.reset();
    let row = prefill(t, Some(d), prompt)?;
    let root = argmax(&row);
    let sampling = Sampling::greedy();
    let mut rng = sampling.rng();
    let rec = ddtree_round(t, d, root, budget, &sampling, &mut rng)?;
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
    })
}

/// `&mut T` as `&mut dyn Target` for both sized targets and `dyn Target` itself.
pub trait AsDynTarget {
    fn as_dyn(&mut self) -> &mut dyn Target;
}

impl<T: Target> AsDynTarget for T {
    fn as_dyn(&mut self) -> &mut dyn Target {
        self
    }
}

impl AsDynTarget for dyn Target + '_ {
    fn as_dyn(&mut self) -> &mut dyn Target {
        self
    }
}
