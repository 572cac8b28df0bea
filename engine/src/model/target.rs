//! The K2.6 target session, written once against `backend::Backend`: [`TargetModel`] implements
//! `api::Target` (tree forward with parents, commit of an accepted path) over [`Weights`] and the
//! backend's latent cache; [`CpuTarget`] is it on the CPU reference backend.
//!
//! Forward (k26-format §4.1): `h = embed(ids)`; per layer `h += MLA(norm_in(h))`, `h += FFN(norm_post(h))`;
//! taps = h after each tap layer (before the final norm); `logits = lm_head(norm(h))`.
//!
//! Activation precision (decided here, see docs/design/cpu-reference.md): the residual stream and every
//! activation are f32; weights are bf16 (or INT4 × bf16 scale) widened exactly to f32; every reduction
//! accumulates in f32 in a fixed order. No bf16 rounding is emulated at module boundaries, so this equals
//! transformers run in f32 on the same (bf16-valued) weights up to f32 summation-order noise.
//! Tests: engine/tests/target_*.rs.

use super::attention::{mla, AttnMode};
use crate::ddtree::Visibility;
use super::ffn::ffn;
use super::trace::Trace;
use super::weights::Weights;
use crate::api::{DeviceRound, Drafter, LogitRows, StepOut, Target, TargetInfo};
use crate::ddtree::tree_is_full;
use crate::drafter::DFlashDrafter;
use crate::sampling::Sampling;
use crate::backend::{Backend, RopeTable};
use crate::cpu::CpuBackend;
use anyhow::{ensure, Result};
use std::sync::Arc;

/// A target session on backend `B`.
pub struct TargetModel<B: Backend> {
    w: Arc<Weights<B>>,
    info: TargetInfo,
    cache: B::Kv,
    mode: AttnMode,
    trace: Option<Trace>,
    /// Parents of the last forward's nodes (commit checks the path against them).
    last_parents: Vec<i32>,
    /// The device round's tree workspace and the budget it was made for.
    tree: Option<(usize, B::Tree)>,
}

/// The target on the CPU reference backend.
pub type CpuTarget = TargetModel<CpuBackend>;

impl<B: Backend> TargetModel<B> {
    pub fn new(w: Arc<Weights<B>>, tap_layers: Vec<usize>, mode: AttnMode) -> Result<TargetModel<B>> {
        let c = &w.cfg;
        for &l in &tap_layers {
            ensure!(l < c.layers, "tap layer {l} >= num_hidden_layers {}", c.layers);
        }
        let info =
            TargetInfo { vocab_size: c.vocab, hidden_size: c.hidden, num_layers: c.layers, max_positions: c.max_positions, tap_layers };
        let cache = w.backend.kv_new(c.layers, c.latent_width());
        Ok(TargetModel { w, info, cache, mode, trace: None, last_parents: Vec::new(), tree: None })
    }
    pub fn weights(&self) -> &Arc<Weights<B>> {
        &self.w
    }
    pub fn mode(&self) -> AttnMode {
        self.mode
    }

    /// The decoder layers over embedded rows `x` `[T, H]` (their latent rows go to the cache as scratch):
    /// the residual stream after the last layer and the taps `[T, n_taps·H]` (None without tap layers).
    fn layers(&mut self, mut x: B::Act, t: usize, mask: &B::Mask, rope: &B::Rope) -> (B::Act, Option<B::Act>) {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let (h, taps_n) = (c.hidden, self.info.tap_layers.len());
        let mut taps = (taps_n > 0).then(|| b.zeros(t * taps_n * h));
        b.kv_drop_scratch(&mut self.cache);
        for (l, layer) in w.ranks[0].layers.iter().enumerate() {
            let a = mla(&w, l, &b.rms_norm(&x, &layer.input_norm, c.eps), t, mask, rope, &mut self.cache, self.mode);
            b.add(&mut x, &a);
            let m = ffn(&w, l, &b.rms_norm(&x, &layer.post_norm, c.eps), t, self.trace.as_mut());
            b.add(&mut x, &m);
            if let Some(tr) = self.trace.as_mut() {
                tr.f32(format!("layers.{l}.attn_out"), &[t, h], &b.to_host(&a));
                tr.f32(format!("layers.{l}.mlp_out"), &[t, h], &b.to_host(&m));
                tr.f32(format!("layers.{l}.residual"), &[t, h], &b.to_host(&x));
            }
            if let Some(acc) = taps.as_mut() {
                for (k, _) in self.info.tap_layers.iter().enumerate().filter(|(_, &tl)| tl == l) {
                    b.set_cols(acc, taps_n * h, k * h, &x, h, t);
                }
            }
        }
        b.kv_set_scratch(&mut self.cache, t);
        (x, taps)
    }

    /// The verify forward of the device round: the `t` nodes of `tree` (tokens, depths and mask where the
    /// ops run; nothing read back), at positions `committed + depth`. Returns the logits `[t, V]` and the
    /// taps `[t, n_taps·H]` (empty without tap layers), both where the ops run; `commit` then takes the
    /// walked path (its parents are the tree's, checked by the caller's walk).
    pub fn forward_tree(&mut self, tree: &B::Tree, t: usize, depth_limit: usize) -> Result<(B::Act, B::Act)> {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let committed = b.kv_committed(&self.cache);
        ensure!(committed + depth_limit < c.max_positions, "forward: position {} >= max_positions {}", committed + depth_limit, c.max_positions);
        // Node i sits at committed + depth[i]: the table of the depth_limit + 1 positions, gathered by depth.
        let table = RopeTable::new(&c.inv_freq, committed..=committed + depth_limit, c.rope_attention_factor);
        let rope = b.rope_gather(&table, b.tree_depths(tree), t);
        let (x, taps) = self.layers(w.embed_ids(b.tree_tokens(tree), t), t, b.tree_mask(tree), &rope);
        self.last_parents.clear();
        let logits = w.lm_head(&w.final_norm(&x), t);
        b.check()?;
        Ok((logits, taps.unwrap_or_else(|| b.zeros(0))))
    }

    /// Commit a walked root-to-node `path` of the last [`TargetModel::forward_tree`] (the device round's
    /// commit; the caller checked the path against the tree).
    pub fn commit_tree(&mut self, path: &[usize]) -> Result<()> {
        self.w.backend.kv_compact(&mut self.cache, path)
    }

    /// The device round (see [`Target::device_round`]) with the tree workspace `tree` (budget `budget`).
    fn run_round(&mut self, tree: &mut B::Tree, d: &mut DFlashDrafter<B>, root: u32, budget: usize, s: &Sampling) -> Result<DeviceRound> {
        let w = self.w.clone();
        let b = &w.backend;
        let start = b.kv_committed(&self.cache);
        ensure!(d.context_len() == start, "drafter context {} != target committed {start}", d.context_len());
        let rows = d.block_size() - 1;
        let draft = d.draft_act(root, start)?; // [rows, V], stays where the ops run
        b.tree_build(tree, &draft, root)?;
        let t = budget + 1;
        let (logits, taps) = self.forward_tree(tree, t, rows)?;
        b.tree_walk(tree, &logits, s, start)?;
        let walk = b.tree_result(tree)?; // the round's one read back
        let p = &walk.path;
        ensure!(
            !p.is_empty() && p[0] == 0 && p.len() <= rows + 1 && p.windows(2).all(|x| x[0] < x[1]) && p[p.len() - 1] < t && walk.decisions.len() == p.len(),
            "device walk: path {p:?} with {} decisions is not a root-to-node path of a {t}-node tree",
            walk.decisions.len()
        );
        self.commit_tree(p)?;
        // The drafter's context grows by the accepted nodes' taps (rows of the path, where the ops run).
        let tw = self.info.tap_layers.len() * self.info.hidden_size;
        let mut acc = b.rows(&taps, tw, p[0], p[0] + 1);
        for &n in &p[1..] {
            b.append_rows(&mut acc, &b.rows(&taps, tw, n, n + 1));
        }
        d.extend_context_act(&acc, p.len())?;
        b.check()?;
        Ok(DeviceRound { walk, drafted: budget, draft_rows: rows })
    }
}

impl<B: Backend> Target for TargetModel<B> {
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn committed(&self) -> usize {
        self.w.backend.kv_committed(&self.cache)
    }

    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let t = tokens.len();
        ensure!(t > 0, "forward: no tokens");
        ensure!(parents.len() == t, "forward: {t} tokens but {} parents", parents.len());
        for (i, &tok) in tokens.iter().enumerate() {
            ensure!((tok as usize) < c.vocab, "forward: tokens[{i}] = {tok} >= vocab {}", c.vocab);
        }
        let vis = Visibility::from_parents(parents)?;
        let committed = b.kv_committed(&self.cache);
        let positions: Vec<usize> = vis.depths().iter().map(|&d| committed + d).collect();
        let maxpos = positions.iter().copied().max().unwrap_or(0);
        ensure!(maxpos < c.max_positions, "forward: position {maxpos} >= max_positions {}", c.max_positions);
        let rope = b.rope_upload(RopeTable::new(&c.inv_freq, positions, c.rope_attention_factor));
        let mask = b.mask_upload(&vis);
        let (x, taps) = self.layers(w.embed(tokens), t, &mask, &rope);
        self.last_parents = parents.to_vec();
        // Only the rows asked for go through the final norm and lm_head (a row's result does not depend
        // on the other rows, so the values equal those of an all-rows forward bit for bit).
        let first = match rows {
            LogitRows::All => 0,
            LogitRows::Last => t - 1,
            LogitRows::None => t,
        };
        let n = t - first;
        let h = c.hidden;
        let xn = w.final_norm(&b.rows(&x, h, first, t));
        let logits = if n > 0 { b.to_host(&w.lm_head(&xn, n)) } else { Vec::new() }; // [n, V]
        let taps = taps.map(|a| b.to_host(&a)).unwrap_or_default();
        b.check()?;
        if let Some(tr) = self.trace.as_mut() {
            tr.f32("final_norm".into(), &[n, h], &b.to_host(&xn));
            tr.f32("logits".into(), &[n, c.vocab], &logits);
        }
        Ok(StepOut { logits, taps })
    }

    fn commit(&mut self, path: &[usize]) -> Result<()> {
        let n = self.last_parents.len();
        for (k, &node) in path.iter().enumerate() {
            ensure!(node < n, "commit: path[{k}] = {node} but the last forward had {n} nodes");
            let want = if k == 0 { -1 } else { path[k - 1] as i32 };
            ensure!(
                self.last_parents[node] == want,
                "commit: path[{k}] = {node} has parent {}, expected {want} (not a root-to-node path)",
                self.last_parents[node]
            );
        }
        self.w.backend.kv_compact(&mut self.cache, path)?;
        self.last_parents.clear();
        Ok(())
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.w.backend.kv_truncate(&mut self.cache, len)?;
        self.last_parents.clear();
        Ok(())
    }

    fn reset(&mut self) {
        self.w.backend.kv_reset(&mut self.cache);
        self.last_parents.clear();
    }

    fn start_trace(&mut self) {
        self.trace = Some(Trace::default());
    }

    fn take_trace(&mut self) -> Option<Trace> {
        self.trace.take()
    }

    fn device_round(&mut self, drafter: &mut dyn Drafter, root: u32, budget: usize, s: &Sampling) -> Option<Result<DeviceRound>> {
        let d = drafter.as_any_mut()?.downcast_mut::<DFlashDrafter<B>>()?;
        let (v, max) = (self.info.vocab_size, self.info.max_positions);
        let rows = d.block_size().checked_sub(1)?;
        let start = self.w.backend.kv_committed(&self.cache);
        if self.trace.is_some() || rows == 0 || budget == 0 || start + rows >= max || self.info.tap_layers.is_empty() || !tree_is_full(budget, rows, v) {
            return None;
        }
        let mut tree = match self.tree.take() {
            Some((b, tree)) if b == budget => tree,
            // A backend whose tree kernels cannot hold this shape (e.g. a budget over the device builder's
            // 2048) leaves the round to the host.
            _ => self.w.backend.tree_new(budget, rows, v).ok()?,
        };
        let r = self.run_round(&mut tree, d, root, budget, s);
        self.tree = Some((budget, tree));
        Some(r)
    }
}
