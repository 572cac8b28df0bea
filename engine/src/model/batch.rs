//! Batched steps (issue 15): one AR step or one DDTree round for every sequence of a batch in one target
//! forward, and the batched prefill, written once against `backend::Backend` ([`BatchEngine`], the
//! `api::BatchOps` of a [`super::seq::ModelTarget`]).
//!
//! Each sequence is a [`super::Model`] forked from one loaded model (`Target::fork_pair`: the weights are
//! shared, the latent cache, the drafter context and the tree workspaces are the sequence's own), listed in
//! that model's family; the engine finds an item's model there by the id its sessions carry
//! (`Target::model_id`). A batched AR step or round is `round::steps` / `round::rounds` (round.rs), the same
//! code as a single sequence's with the verify forward shared:
//! * per sequence: the draft of its block and its tree (budgets may differ per sequence);
//! * one verify forward over all trees' nodes, concatenated in item order ([`super::attention::Seg`]): the
//!   embedding, every projection, the router, the MoE (experts shared between trees are read once) and
//!   lm_head see all rows at once; the MLA attention runs per sequence over its own cache with its own
//!   ancestor mask (block-diagonal by construction);
//! * per sequence: the decisions and the walk over its rows of the logits, the commit of its path (its cache,
//!   its drafter context);
//! * every tree's result is copied into one staging buffer, read back once.
//!
//! Shapes are exact (no padding): the graph of a step is captured per batch composition (each sequence's
//! cache, tree shape and sampling parameters: the key) and kept in a small cache, so a steady batch replays
//! one graph per round. On the CPU the same code runs without graphs.
//!
//! Equality with batch 1: on the CPU every op is row-independent (each row's reductions have a fixed order
//! whatever the other rows), so a sequence's tokens are the same alone and in any batch
//! (engine/tests/batch_generate.rs). On a GPU the GEMMs choose their reduction split by the row count, so a
//! near-tie may break differently (scripts/gpu-test.sh reports it against the top-2 margins).

use super::attention::Seg;
use super::round::{self, Part, Staging, StepPart};
use super::seq::{find, lock, lock_all, Family, Model, Shared};
use super::target::{decoder_layers, TargetModel};
use super::weights::Weights;
use crate::api::{BatchItem, BatchOps, BatchOut, PrefillItem, StepKind};
use crate::backend::{Backend, RopeTable};
use crate::ddtree::{tree_is_full, Visibility};
use crate::drafter::DFlashDrafter;
use anyhow::{bail, ensure, Context, Result};
use std::sync::Arc;

/// The batched steps of the models of one family (forked from one loaded model, seq.rs).
pub struct BatchEngine<B: Backend> {
    w: Arc<Weights<B>>,
    family: Family<B>,
    /// The batch's token, decision and staging buffers and its captured steps.
    staging: Staging<B>,
}

impl<B: Backend> BatchEngine<B> {
    pub(crate) fn new(w: Arc<Weights<B>>, family: Family<B>) -> BatchEngine<B> {
        BatchEngine {
            staging: Staging::new(&w.backend),
            family,
            w,
        }
    }

    /// The models of `targets` (their sessions' [`Target::model_id`]s) in this family.
    fn models(&self, targets: impl Iterator<Item = Option<usize>>) -> Result<Vec<Shared<B>>> {
        lock_all(&self.family, &targets.collect::<Vec<_>>())
    }

    fn ar(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>> {
        let models = self.models(items.iter().map(|it| it.target.model_id()))?;
        let mut guards: Vec<_> = models.iter().map(lock).collect();
        let mut parts = Vec::with_capacity(items.len());
        for (it, g) in items.iter().zip(guards.iter_mut()) {
            parts.push(StepPart {
                t: &mut g.target,
                root: it.root,
                s: it.sampling,
                feed: None,
            });
        }
        let toks = round::steps(&self.w, &mut parts, Some(&mut self.staging))?;
        Ok(toks.into_iter().map(BatchOut::Token).collect())
    }

    fn rounds(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>> {
        let v = self.w.cfg.vocab;
        // The shapes first: a view's calls lock its model.
        let shapes = items.iter_mut().map(|it| shape(it, v)).collect::<Result<Vec<_>>>()?;
        let models = self.models(items.iter().map(|it| it.target.model_id()))?;
        let mut guards: Vec<_> = models.iter().map(lock).collect();
        let mut parts = Vec::with_capacity(items.len());
        for ((it, g), &(budget, k)) in items.iter_mut().zip(guards.iter_mut()).zip(&shapes) {
            ensure!(
                it.drafter.as_ref().and_then(|d| d.model_id()) == it.target.model_id(),
                "a batched round needs each sequence's own drafter"
            );
            let Model { target, drafter } = &mut **g;
            parts.push(Part {
                t: target,
                d: drafter
                    .as_mut()
                    .context("a batched round over a model without a drafter")?,
                budget,
                k,
                root: it.root,
                s: it.sampling,
            });
        }
        let rounds = round::rounds(&self.w, &mut parts, Some(&mut self.staging))?;
        Ok(rounds.into_iter().map(BatchOut::Round).collect())
    }
}

/// The (budget, top-K) of an item's tree: a DDTree round's budget and min(budget, V) (a feed round, budget 0:
/// 1, unused), or the chain's rows and 1.
fn shape(it: &mut BatchItem<'_>, v: usize) -> Result<(usize, usize)> {
    let rows = it
        .drafter
        .as_ref()
        .map(|d| d.block_size())
        .unwrap_or(0)
        .saturating_sub(1);
    match it.kind {
        StepKind::Tree(budget) => Ok((budget, budget.min(v).max(1))),
        StepKind::Chain => Ok((rows, 1)),
        StepKind::Ar => bail!("an AR step in a batched round"),
    }
}

/// One prompt of a batched prefill: its target, its drafter (when it drafts), its length.
type PrefillPart<'p, B> = (&'p mut TargetModel<B>, Option<&'p mut DFlashDrafter<B>>, usize);

impl<B: Backend> BatchEngine<B> {
    fn prefill_all(&mut self, items: &mut [PrefillItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let mut tokens = Vec::new();
        let models = self.models(items.iter().map(|it| it.target.model_id()))?;
        let mut guards: Vec<_> = models.iter().map(lock).collect();
        let mut parts: Vec<PrefillPart<'_, B>> = Vec::with_capacity(items.len());
        for (it, g) in items.iter_mut().zip(guards.iter_mut()) {
            let Model { target: t, drafter } = &mut **g;
            let d = match &it.drafter {
                None => None,
                Some(d) if d.model_id() == it.target.model_id() => drafter.as_mut(),
                Some(_) => bail!("a batched prefill needs each sequence's own drafter"),
            };
            let n = it.prompt.len();
            ensure!(
                n > 0 && b.kv_committed(&t.cache) == 0,
                "a batched prefill needs a reset session and a prompt"
            );
            ensure!(
                n < c.max_positions,
                "prompt of {n} tokens: the cache holds {} positions",
                c.max_positions
            );
            for (i, &tok) in it.prompt.iter().enumerate() {
                ensure!(
                    (tok as usize) < c.vocab,
                    "prompt token {i} = {tok} >= vocab {}",
                    c.vocab
                );
            }
            (t.dev_root, t.step_root) = (None, None);
            t.last_parents.clear();
            tokens.extend_from_slice(it.prompt);
            parts.push((t, d, n));
        }
        let drafts = parts.iter().any(|p| p.1.is_some());
        let (mode, tap_layers) = (
            parts[0].0.mode,
            if drafts {
                parts[0].0.info.tap_layers.clone()
            } else {
                Vec::new()
            },
        );
        // Each prompt a chain at positions 0..len over its own (empty) cache.
        let masks: Vec<B::Mask> = parts
            .iter()
            .map(|p| {
                Visibility::from_parents(&(0..p.2 as i32).map(|i| i - 1).collect::<Vec<_>>()).map(|v| b.mask_upload(&v))
            })
            .collect::<Result<_>>()?;
        let ropes: Vec<B::Rope> = parts
            .iter()
            .map(|p| b.rope_upload(RopeTable::new(&c.inv_freq, 0..p.2, c.rope_attention_factor)))
            .collect();
        let mut segs: Vec<Seg<'_, B>> = parts
            .iter_mut()
            .zip(masks.iter().zip(&ropes))
            .map(|(p, (mask, rope))| Seg {
                kv: &mut p.0.cache,
                t: p.2,
                mask,
                rope,
            })
            .collect();
        let (x, taps) = decoder_layers(&w, &mut segs, w.embed(&tokens), &tap_layers, mode, None, None);
        drop(segs);
        // Each prompt's last row through the final norm and lm_head (rows are independent: the values of a
        // prefill alone, which computes only that row).
        let (n, h) = (parts.len(), c.hidden);
        let mut last = b.zeros(n * h);
        let mut end = 0;
        for (i, p) in parts.iter().enumerate() {
            end += p.2;
            b.set_rows(&mut last, h, i, &b.rows(&x, h, end - 1, end), 1);
        }
        let logits = b.to_host(&w.lm_head(&w.final_norm(&last), n));
        let tw = tap_layers.len() * h;
        for (t, _, len) in parts.iter_mut() {
            b.kv_set_scratch(&mut t.cache, *len);
            b.kv_commit_rows(&mut t.cache, *len)?;
            b.kv_commit_rows_host(&mut t.cache, *len);
        }
        // Every prompt's context rows into its drafter in one forward (the prompts' taps are consecutive rows; only
        // the drafting sequences' rows when some do not draft).
        if let Some(all) = taps.as_ref() {
            let seqs = parts.len();
            let (mut ds, mut ns, mut spans, mut at) = (Vec::new(), Vec::new(), Vec::new(), 0);
            for (_, d, len) in parts.iter_mut() {
                if let Some(d) = d.as_deref_mut() {
                    ds.push(d);
                    ns.push(*len);
                    spans.push((at, *len));
                }
                at += *len;
            }
            let picked;
            let taps = if spans.len() == seqs {
                all
            } else {
                let mut x = b.zeros(ns.iter().sum::<usize>() * tw);
                let mut to = 0;
                for &(from, k) in &spans {
                    b.set_rows(&mut x, tw, to, &b.rows(all, tw, from, from + k), k);
                    to += k;
                }
                picked = x;
                &picked
            };
            DFlashDrafter::extend_context_batch(&mut ds, taps, &ns)?;
        }
        b.check()?;
        ensure!(
            logits.len() == n * c.vocab,
            "batched prefill: {} logits for {n} prompts x vocab {}",
            logits.len(),
            c.vocab
        );
        Ok(logits.chunks(c.vocab).map(<[f32]>::to_vec).collect())
    }
}

impl<B: Backend> BatchOps for BatchEngine<B> {
    fn prefill(&mut self, items: &mut [PrefillItem<'_>]) -> Result<Vec<Vec<f32>>> {
        self.prefill_all(items)
    }
    fn last_run(&self) -> crate::api::StepRun {
        self.staging.last
    }

    fn can_batch(&mut self, it: &mut BatchItem<'_>) -> bool {
        let v = self.w.cfg.vocab;
        let rows = it
            .drafter
            .as_ref()
            .map(|d| d.block_size())
            .unwrap_or(0)
            .saturating_sub(1);
        let shape = shape(it, v).ok();
        let id = it.target.model_id();
        let own_drafter = it.drafter.as_ref().is_some_and(|d| d.model_id() == id);
        let Some(m) = id.and_then(|id| find(&self.family, id)) else {
            return false;
        };
        let m = lock(&m);
        let (t, has_drafter) = (&m.target, own_drafter && m.drafter.is_some());
        let (start, max) = (self.w.backend.kv_committed(&t.cache), t.info.max_positions);
        if t.trace.is_some() || it.root as usize >= v {
            return false;
        }
        match it.kind {
            StepKind::Ar => start + 1 < max,
            StepKind::Tree(_) | StepKind::Chain => {
                let Some((budget, _)) = shape else { return false };
                let full = matches!(it.kind, StepKind::Chain) || tree_is_full(budget, rows, v);
                full && rows > 0 && start + rows < max && !t.info.tap_layers.is_empty() && has_drafter
            }
        }
    }

    fn step(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>> {
        let Some(first) = items.first() else {
            return Ok(Vec::new());
        };
        let ar = first.kind == StepKind::Ar;
        ensure!(
            items.iter().all(|it| (it.kind == StepKind::Ar) == ar),
            "a batched step mixes AR steps and rounds"
        );
        if ar {
            self.ar(items)
        } else {
            self.rounds(items)
        }
    }
}
