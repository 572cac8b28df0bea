//! Batched steps (issue 15): one AR step or one DDTree round for every sequence of a batch in one target
//! forward, written once against `backend::Backend` ([`BatchEngine`], the `api::BatchOps` of
//! [`super::TargetModel`]).
//!
//! Each sequence is a session forked from one model (`Target::fork`, `Drafter::fork`: the weights are
//! shared, the latent cache, the drafter context and the tree workspaces are the sequence's own). A batched
//! round is the single-sequence device round (target.rs `run_round`) with the verify forward shared:
//! * per sequence: the draft of its block and its tree (budgets may differ per sequence);
//! * one verify forward over all trees' nodes, concatenated in item order ([`super::attention::Seg`]): the
//!   embedding, every projection, the router, the MoE (experts shared between trees are read once) and
//!   lm_head see all rows at once; the MLA attention runs per sequence over its own cache with its own
//!   ancestor mask (block-diagonal by construction);
//! * per sequence: the decisions and the walk over its rows of the logits, the commit of its path (its cache,
//!   its drafter context);
//! * every tree's result is copied into one staging buffer, read back once.
//!
//! A batched AR step is the device AR step the same way: one forward of one row per sequence, a decision per
//! sequence at its own position, one read. Shapes are exact (no padding): the graph of a step is captured per
//! batch composition (each sequence's cache, tree shape and sampling parameters: the key) and kept in a small
//! cache, so a steady batch replays one graph per round. On the CPU the same code runs without graphs.
//!
//! Equality with batch 1: on the CPU every op is row-independent (each row's reductions have a fixed order
//! whatever the other rows), so a sequence's tokens are the same alone and in any batch
//! (engine/tests/batch_generate.rs). On a GPU the GEMMs choose their reduction split by the row count, so a
//! near-tie may break differently (scripts/gpu-test.sh reports it against the top-2 margins).

use super::attention::Seg;
use super::target::{accept_walk, decoder_layers, round_key, RoundSlot, TargetModel};
use super::weights::Weights;
use crate::api::{BatchItem, BatchOps, BatchOut, DeviceRound, Drafter, PrefillItem, StepKind, Target};
use crate::backend::{Backend, PosOf, RopeTable};
use crate::ddtree::{tree_is_full, Visibility};
use crate::drafter::DFlashDrafter;
use crate::sampling::Sampling;
use anyhow::{bail, ensure, Context, Result};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Captured steps kept per engine (distinct batch compositions: the batch's tail shrinks one sequence at a
/// time, `--budget auto` moves between bucket shapes).
const GRAPHS: usize = 16;

/// The batched steps of sessions forked from one target.
pub struct BatchEngine<B: Backend> {
    w: Arc<Weights<B>>,
    /// The forward's token ids (AR: one per sequence; a round: every tree's nodes).
    tokens: B::Ids,
    /// AR decisions, one per sequence (read back in one copy).
    out: B::Ids,
    /// Every tree's result words (a round's one read).
    stage: B::Ids,
    /// The three buffers' lengths.
    caps: [usize; 3],
    /// Bumped whenever one of the buffers above is reallocated (part of every graph key).
    gen: u64,
    /// The mask of a one-node forward (the AR step's).
    mask1: B::Mask,
    graphs: Vec<(u64, Option<B::Graph>)>,
}

impl<B: Backend> BatchEngine<B> {
    pub fn new(w: Arc<Weights<B>>) -> BatchEngine<B> {
        let b = w.backend.clone();
        let mask1 = b.mask_upload(&Visibility::from_parents(&[-1]).expect("a one-node tree"));
        BatchEngine {
            tokens: b.ids_from_host(&[]),
            out: b.ids_from_host(&[]),
            stage: b.ids_from_host(&[]),
            caps: [0; 3],
            gen: 0,
            mask1,
            graphs: Vec::new(),
            w,
        }
    }

    /// Room for `n` ids in buffer `which` (0 tokens, 1 out, 2 stage): a new, larger buffer when it is too
    /// small, which starts a new generation (every captured step read the old one).
    fn room(&mut self, which: usize, n: usize) {
        if self.caps[which] >= n {
            return;
        }
        let cap = n.next_power_of_two();
        let buf = self.w.backend.ids_from_host(&vec![0; cap]);
        *[&mut self.tokens, &mut self.out, &mut self.stage][which] = buf;
        self.caps[which] = cap;
        self.gen += 1;
        self.graphs.clear();
    }

    /// The graph slot of `key` (a new one when absent; the oldest goes when the cache is full).
    fn graph(&mut self, key: u64) -> usize {
        if let Some(i) = self.graphs.iter().position(|(k, _)| *k == key) {
            return i;
        }
        if self.graphs.len() >= GRAPHS {
            self.graphs.remove(0);
        }
        self.graphs.push((key, None));
        self.graphs.len() - 1
    }

    fn ar(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>> {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let n = items.len();
        let mut key = std::collections::hash_map::DefaultHasher::new();
        let mut roots = Vec::with_capacity(n);
        let mut parts: Vec<(&mut TargetModel<B>, &Sampling)> = Vec::with_capacity(n);
        for it in items.iter_mut() {
            let t = concrete_target::<B>(&mut *it.target)?;
            let start = b.kv_committed(&t.cache);
            b.kv_reserve(&mut t.cache, start + 1)?;
            (t.dev_root, t.step_root) = (None, None);
            t.last_parents.clear();
            let s = it.sampling;
            (
                "ar",
                s.temperature.to_bits(),
                s.top_p.to_bits(),
                s.top_k,
                s.seed,
                b.kv_id(&t.cache),
            )
                .hash(&mut key);
            roots.push(it.root);
            parts.push((t, s));
        }
        self.room(0, n);
        self.room(1, n);
        (n, self.gen).hash(&mut key);
        b.ids_write(&mut self.tokens, 0, &roots)?;
        let mode = parts[0].0.mode;
        let gkey = key.finish();
        let gi = self.graph(gkey);
        let (tokens, out, mask1) = (&self.tokens, &mut self.out, &self.mask1);
        let graph = &mut self.graphs[gi].1;
        let r = b.graph_run(graph, gkey, &mut || {
            let ropes: Vec<B::Rope> = parts
                .iter()
                .map(|(t, _)| b.rope_at(&w.rope_inv, c.rope_attention_factor, PosOf::Kv(&t.cache), None, 1))
                .collect();
            let mut segs: Vec<Seg<'_, B>> = parts
                .iter_mut()
                .zip(&ropes)
                .map(|((t, _), rope)| Seg {
                    kv: &mut t.cache,
                    t: 1,
                    mask: mask1,
                    rope,
                })
                .collect();
            let (x, _taps) = decoder_layers(&w, &mut segs, w.embed_ids(tokens, n), &[], mode, None);
            drop(segs);
            let logits = w.lm_head(&w.final_norm(&x), n);
            // Greedy decisions do not depend on the position: one argmax over every row when all are greedy.
            let all_greedy = parts.iter().all(|(_, s)| s.is_greedy());
            if all_greedy {
                b.decide_rows(
                    &logits,
                    0,
                    n,
                    c.vocab,
                    &Sampling::greedy(),
                    PosOf::Kv(&parts[0].0.cache),
                    1,
                    out,
                )?;
            }
            for (i, (t, s)) in parts.iter_mut().enumerate() {
                // The token goes to position committed + 1 (sampling.rs: draws keyed by position).
                if !all_greedy {
                    b.decide_rows(&logits, i, 1, c.vocab, s, PosOf::Kv(&t.cache), 1, out)?;
                }
                b.kv_commit_rows(&mut t.cache, 1)?;
            }
            b.check()
        });
        if r.is_err() {
            self.graphs.remove(gi);
        }
        r?;
        let toks = b.ids_to_host(&self.out)?; // the batch's one read back
        let mut outs = Vec::with_capacity(n);
        for (i, (t, _)) in parts.iter_mut().enumerate() {
            let tok = toks[i];
            ensure!(
                (tok as usize) < c.vocab,
                "batched step: token {tok} >= vocab {}",
                c.vocab
            );
            b.kv_commit_rows_host(&mut t.cache, 1);
            outs.push(BatchOut::Token(tok));
        }
        Ok(outs)
    }

    fn rounds(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>> {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let v = c.vocab;
        let mut key = std::collections::hash_map::DefaultHasher::new();
        // Per sequence: its target, drafter, tree slot index, node count, sampling and chosen shape.
        struct Part<'p, B: Backend> {
            t: &'p mut TargetModel<B>,
            d: &'p mut DFlashDrafter<B>,
            slot: usize,
            nodes: usize,
            s: &'p Sampling,
        }
        let mut parts: Vec<Part<'_, B>> = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            let (budget, k) = shape(it, v)?;
            let t = concrete_target::<B>(&mut *it.target)?;
            let d = concrete_drafter::<B>(it.drafter.as_deref_mut())?;
            let rows = d.block_size() - 1;
            let start = b.kv_committed(&t.cache);
            ensure!(
                d.context_len() == start,
                "drafter context {} != target committed {start}",
                d.context_len()
            );
            let slot = match t.rounds.iter().position(|r| (r.budget, r.k) == (budget, k)) {
                Some(i) => i,
                None => {
                    t.rounds.push(RoundSlot {
                        budget,
                        k,
                        tree: b.tree_new(budget, rows, v, k)?,
                        graph: None,
                        decisions: b.ids_from_host(&vec![0; budget + 1]),
                    });
                    t.rounds.len() - 1
                }
            };
            let nodes = budget + 1;
            b.kv_reserve(&mut t.cache, start + nodes)?;
            d.reserve_context(rows + 1);
            if t.dev_root != Some((budget, k, it.root)) {
                b.tree_set_root(&mut t.rounds[slot].tree, it.root)?;
            }
            (t.dev_root, t.step_root) = (None, None);
            t.last_parents.clear();
            round_key(budget, k, it.sampling, b.kv_id(&t.cache), d.capture_key()).hash(&mut key);
            parts.push(Part {
                t,
                d,
                slot,
                nodes,
                s: it.sampling,
            });
        }
        let total: usize = parts.iter().map(|p| p.nodes).sum();
        let block = parts[0].d.block_size();
        ensure!(
            parts.iter().all(|p| p.d.block_size() == block),
            "a batched round over drafters of different block sizes"
        );
        let words: Vec<usize> = parts
            .iter()
            .map(|p| b.tree_result_words(&p.t.rounds[p.slot].tree))
            .collect();
        let stage_len: usize = words.iter().sum();
        // The token buffer holds the drafts' blocks first, then every tree's nodes.
        self.room(0, total.max(parts.len() * block));
        self.room(2, stage_len);
        (total, self.gen).hash(&mut key);
        let (tw, m) = (parts[0].t.info.tap_layers.len() * c.hidden, parts[0].d.block_size());
        ensure!(tw > 0, "a batched round needs a target with tap layers");
        let (mode, tap_layers) = (parts[0].t.mode, parts[0].t.info.tap_layers.clone());
        let gkey = key.finish();
        let gi = self.graph(gkey);
        let (tokens, stage) = (&mut self.tokens, &mut self.stage);
        let graph = &mut self.graphs[gi].1;
        let r = b.graph_run(graph, gkey, &mut || {
            // Every block drafted in one forward, every tree built from its rows, then their nodes gathered.
            let draft = {
                let (mut roots, mut ds): (Vec<&B::Ids>, Vec<&mut DFlashDrafter<B>>) = (Vec::new(), Vec::new());
                for p in parts.iter_mut() {
                    roots.push(b.tree_root(&p.t.rounds[p.slot].tree));
                    ds.push(&mut *p.d);
                }
                DFlashDrafter::draft_batch(&mut ds, &roots, tokens)? // [N·(B−1), V]
            };
            let mut at = 0;
            for (s, p) in parts.iter_mut().enumerate() {
                let tree = &mut p.t.rounds[p.slot].tree;
                b.tree_build(tree, &draft, s * (block - 1))?;
                b.ids_copy(tokens, at, b.tree_tokens(tree), p.nodes);
                at += p.nodes;
            }
            let ropes: Vec<B::Rope> = parts
                .iter()
                .map(|p| {
                    b.rope_at(
                        &w.rope_inv,
                        c.rope_attention_factor,
                        PosOf::Kv(&p.t.cache),
                        Some(b.tree_depths(&p.t.rounds[p.slot].tree)),
                        p.nodes,
                    )
                })
                .collect();
            let mut segs: Vec<Seg<'_, B>> = parts
                .iter_mut()
                .zip(&ropes)
                .map(|(p, rope)| {
                    let TargetModel { cache, rounds, .. } = &mut *p.t;
                    Seg {
                        kv: cache,
                        t: p.nodes,
                        mask: b.tree_mask(&rounds[p.slot].tree),
                        rope,
                    }
                })
                .collect();
            let (x, taps) = decoder_layers(&w, &mut segs, w.embed_ids(tokens, total), &tap_layers, mode, None);
            drop(segs);
            let taps = taps.context("a batched round needs the target's taps")?;
            let logits = w.lm_head(&w.final_norm(&x), total);
            // Walks, then every accepted path's taps into the drafters' contexts in one forward, then commits.
            let (mut row, n) = (0, parts.len());
            let mut acc = b.zeros(n * m * tw);
            // Greedy decisions do not depend on positions: every tree's rows in one argmax when all are greedy
            // (into the token buffer: the verify has read it).
            let all_greedy = parts.iter().all(|p| p.s.is_greedy());
            if all_greedy {
                b.decide_rows(
                    &logits,
                    0,
                    total,
                    c.vocab,
                    &Sampling::greedy(),
                    PosOf::Kv(&parts[0].t.cache),
                    1,
                    tokens,
                )?;
            }
            for (s, p) in parts.iter_mut().enumerate() {
                let TargetModel { cache, rounds, .. } = &mut *p.t;
                let tree = &mut rounds[p.slot].tree;
                if all_greedy {
                    b.tree_walk_decided(tree, tokens, row)?;
                } else {
                    b.tree_walk(tree, &logits, row, p.s, cache)?;
                }
                b.set_rows(&mut acc, tw, s * m, &b.tree_path_rows(tree, &taps, row, tw, m), m);
                row += p.nodes;
            }
            {
                let mut ds: Vec<&mut DFlashDrafter<B>> = parts.iter_mut().map(|p| &mut *p.d).collect();
                DFlashDrafter::write_context_batch(&mut ds, &acc, m)?;
            }
            let mut word = 0;
            for (p, &nw) in parts.iter_mut().zip(&words) {
                let TargetModel { cache, rounds, .. } = &mut *p.t;
                let tree = &mut rounds[p.slot].tree;
                b.tree_commit(tree, cache, p.d.context_pos_mut())?;
                b.tree_result_into(tree, stage, word);
                word += nw;
            }
            b.check()
        });
        if r.is_err() {
            self.graphs.remove(gi);
        }
        r?;
        let all = b.ids_to_host(&self.stage)?; // the batch's one read back
        let mut outs = Vec::with_capacity(parts.len());
        let mut word = 0;
        for (p, &nw) in parts.iter_mut().zip(&words) {
            let TargetModel { cache, rounds, .. } = &mut *p.t;
            let slot = &mut rounds[p.slot];
            let res = b.tree_result_from(&slot.tree, &all[word..word + nw])?;
            word += nw;
            let r = accept_walk(b, cache, &mut slot.tree, p.d, p.nodes, res)?;
            p.t.dev_root = r.walk.decisions.last().map(|&tok| (slot.budget, slot.k, tok));
            let rows = p.d.block_size() - 1;
            outs.push(BatchOut::Round(DeviceRound {
                walk: r.walk,
                log_q: r.log_q,
                drafted: p.nodes - 1,
                draft_rows: rows,
            }));
        }
        Ok(outs)
    }
}

fn concrete_target<'t, 'o, B: Backend>(t: &'t mut (dyn Target + 'o)) -> Result<&'t mut TargetModel<B>> {
    t.as_any_mut()
        .and_then(|a| a.downcast_mut::<TargetModel<B>>())
        .context("a batched step over a target of another backend")
}

fn concrete_drafter<'d, 'o, B: Backend>(d: Option<&'d mut (dyn Drafter + 'o)>) -> Result<&'d mut DFlashDrafter<B>> {
    d.and_then(|d| d.as_any_mut())
        .and_then(|a| a.downcast_mut::<DFlashDrafter<B>>())
        .context("a batched round needs each sequence's DFlash drafter on the target's backend")
}

/// The (budget, top-K) of an item's tree: a DDTree round's budget and min(budget, V), or the chain's rows and 1.
fn shape(it: &mut BatchItem<'_>, v: usize) -> Result<(usize, usize)> {
    let rows = it
        .drafter
        .as_ref()
        .map(|d| d.block_size())
        .unwrap_or(0)
        .saturating_sub(1);
    match it.kind {
        StepKind::Tree(budget) => Ok((budget, budget.min(v))),
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
        let mut parts: Vec<PrefillPart<'_, B>> = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            let t = concrete_target::<B>(&mut *it.target)?;
            let d = match it.drafter.as_deref_mut() {
                Some(d) => Some(concrete_drafter::<B>(Some(d))?),
                None => None,
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
        let (x, taps) = decoder_layers(&w, &mut segs, w.embed(&tokens), &tap_layers, mode, None);
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
        let mut at = 0;
        for (t, d, len) in parts.iter_mut() {
            b.kv_set_scratch(&mut t.cache, *len);
            b.kv_commit_rows(&mut t.cache, *len)?;
            b.kv_commit_rows_host(&mut t.cache, *len);
            if let (Some(d), Some(taps)) = (d.as_deref_mut(), taps.as_ref()) {
                d.extend_context_act(&b.rows(taps, tw, at, at + *len), *len)?;
            }
            at += *len;
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

    fn can_batch(&mut self, it: &mut BatchItem<'_>) -> bool {
        let v = self.w.cfg.vocab;
        let rows = it
            .drafter
            .as_ref()
            .map(|d| d.block_size())
            .unwrap_or(0)
            .saturating_sub(1);
        let shape = shape(it, v).ok();
        let has_drafter = it
            .drafter
            .as_mut()
            .and_then(|d| d.as_any_mut())
            .is_some_and(|a| a.is::<DFlashDrafter<B>>());
        let Ok(t) = concrete_target::<B>(&mut *it.target) else {
            return false;
        };
        let (start, max) = (self.w.backend.kv_committed(&t.cache), t.info.max_positions);
        if t.trace.is_some() || it.root as usize >= v {
            return false;
        }
        match it.kind {
            StepKind::Ar => start + 1 < max,
            StepKind::Tree(_) | StepKind::Chain => {
                let Some((budget, _)) = shape else { return false };
                let full = matches!(it.kind, StepKind::Chain) || tree_is_full(budget, rows, v);
                full && rows > 0 && budget > 0 && start + rows < max && !t.info.tap_layers.is_empty() && has_drafter
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
