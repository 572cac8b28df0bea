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

use super::attention::{mla, AttnMode, Seg};
use super::ffn::ffn;
use super::round;
use super::trace::Trace;
use super::weights::Weights;
use crate::api::{Drafter, LogitRows, StepOut, Target, TargetInfo};
use crate::backend::{Backend, PosOf, RopeTable};
use crate::cpu::CpuBackend;
use crate::ddtree::Visibility;
use crate::drafter::DFlashDrafter;
use crate::sampling::Sampling;
use anyhow::{ensure, Context, Result};
use std::sync::Arc;

/// A target session on backend `B`.
pub struct TargetModel<B: Backend> {
    pub(crate) w: Arc<Weights<B>>,
    pub(crate) info: TargetInfo,
    pub(crate) cache: B::Kv,
    pub(crate) mode: AttnMode,
    pub(crate) trace: Option<Trace>,
    /// Parents of the last forward's nodes (commit checks the path against them).
    pub(crate) last_parents: Vec<i32>,
    /// The device rounds' tree workspaces, one per tree shape (budget, top-K) used, with their captured
    /// rounds (`--budget auto` moves between a few bucket shapes; each keeps its graph).
    pub(crate) rounds: Vec<RoundSlot<B>>,
    /// The (budget, top-K) of the slot whose root token, where the ops read it, is known to be the last
    /// round's bonus (no other target op since), and that token: its next round needs no upload.
    pub(crate) dev_root: Option<(usize, usize, u32)>,
    /// The device AR step's state (its token buffer, the one-node mask, its captured graph) and whether the
    /// token buffer holds the last step's token (no other target op since).
    pub(crate) step: Option<StepSlot<B>>,
    pub(crate) step_root: Option<u32>,
}

/// The device AR step's buffers: the token `[1]` (the root going in, the decision coming out), the mask of
/// a one-node forward, and the step captured over them.
pub(crate) struct StepSlot<B: Backend> {
    pub(crate) token: B::Ids,
    pub(crate) mask: B::Mask,
    pub(crate) graph: Option<B::Graph>,
}

/// One tree shape's device-round state: the tree workspace and the round captured over it (with its key).
pub(crate) struct RoundSlot<B: Backend> {
    pub(crate) budget: usize,
    pub(crate) k: usize,
    pub(crate) tree: B::Tree,
    pub(crate) graph: Option<B::Graph>,
    /// The target's greedy decision per node, where the ops run, when they come from the vocab-parallel argmax
    /// (a GPU holding only some vocab shards: `Weights::vocab_split`); allocated with the slot.
    pub(crate) decisions: B::Ids,
}

/// A captured round replays only for the same tree shape (budget, top-K), sampling parameters and storage of every
/// buffer it reads (the latent cache, the drafter and its caches): their hash.
pub(crate) fn round_key(budget: usize, k: usize, s: &Sampling, kv: u64, drafter: (u64, u64)) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        budget,
        k,
        s.temperature.to_bits(),
        s.top_p.to_bits(),
        s.top_k,
        s.seed,
        kv,
        drafter,
    )
        .hash(&mut h);
    h.finish()
}

/// The target on the CPU reference backend.
pub type CpuTarget = TargetModel<CpuBackend>;

impl<B: Backend> TargetModel<B> {
    pub fn new(w: Arc<Weights<B>>, tap_layers: Vec<usize>, mode: AttnMode) -> Result<TargetModel<B>> {
        let c = &w.cfg;
        for &l in &tap_layers {
            ensure!(l < c.layers, "tap layer {l} >= num_hidden_layers {}", c.layers);
        }
        let info = TargetInfo {
            vocab_size: c.vocab,
            hidden_size: c.hidden,
            num_layers: c.layers,
            max_positions: c.max_positions,
            tap_layers,
        };
        let cache = w.backend.kv_new(c.layers, c.latent_width());
        Ok(TargetModel {
            w,
            info,
            cache,
            mode,
            trace: None,
            last_parents: Vec::new(),
            rounds: Vec::new(),
            dev_root: None,
            step: None,
            step_root: None,
        })
    }
    pub fn weights(&self) -> &Arc<Weights<B>> {
        &self.w
    }
    pub fn mode(&self) -> AttnMode {
        self.mode
    }

    /// The decoder layers over embedded rows `x` `[T, H]` (their latent rows go to the cache as scratch):
    /// the residual stream after the last layer and the taps `[T, n_taps·H]` (None without tap layers).
    fn layers(&mut self, x: B::Act, t: usize, mask: &B::Mask, rope: &B::Rope) -> (B::Act, Option<B::Act>) {
        let taps = self.info.tap_layers.clone();
        self.layers_tapping(x, t, mask, rope, &taps)
    }

    /// [`TargetModel::layers`] tapping `tap_layers` (none: no taps computed).
    fn layers_tapping(
        &mut self,
        x: B::Act,
        t: usize,
        mask: &B::Mask,
        rope: &B::Rope,
        tap_layers: &[usize],
    ) -> (B::Act, Option<B::Act>) {
        let w = self.w.clone();
        let mut segs = [Seg {
            kv: &mut self.cache,
            t,
            mask,
            rope,
        }];
        decoder_layers(&w, &mut segs, x, tap_layers, self.mode, self.trace.as_mut(), None)
    }

    /// One chunk of a prefill where the ops run: `tokens` as a chain after the committed prefix, committed; when
    /// `d` is given, its context extended by the chunk's taps without their leaving the device (no taps are
    /// computed without it: an AR session's prefill needs none). Returns the last row's logits `[V]` when `last`,
    /// else nothing. The state it leaves is that of `forward_rows`, `commit` and the drafter's `extend_context`
    /// with the taps read back (the same values), which is what a recording trace still runs: None then.
    pub fn prefill_chunk(
        &mut self,
        tokens: &[u32],
        last: bool,
        d: Option<&mut crate::drafter::DFlashDrafter<B>>,
    ) -> Option<Result<Vec<f32>>> {
        if self.trace.is_some() {
            return None;
        }
        let run = || -> Result<Vec<f32>> {
            let t = tokens.len();
            let parents: Vec<i32> = (0..t as i32).map(|i| i - 1).collect();
            let rows = if last { LogitRows::Last } else { LogitRows::None };
            let tap_layers = if d.is_some() {
                self.info.tap_layers.clone()
            } else {
                Vec::new()
            };
            let (logits, taps) = self.forward_tapping(tokens, &parents, rows, &tap_layers)?;
            self.commit(&(0..t).collect::<Vec<_>>())?;
            if let Some(d) = d {
                let taps = taps.context("prefill: a drafter's context needs the target's tap layers")?;
                d.extend_context_act(&taps, t)?;
            }
            Ok(logits)
        };
        Some(run())
    }

    /// A forward of `tokens` (a tree by `parents`) after the committed prefix: the logits of `rows`, read back,
    /// and the taps of `tap_layers` `[T, n_taps·H]` where the ops run (None without tap layers).
    fn forward_tapping(
        &mut self,
        tokens: &[u32],
        parents: &[i32],
        rows: LogitRows,
        tap_layers: &[usize],
    ) -> Result<(Vec<f32>, Option<B::Act>)> {
        (self.dev_root, self.step_root) = (None, None);
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let t = tokens.len();
        ensure!(t > 0, "forward: no tokens");
        ensure!(parents.len() == t, "forward: {t} tokens but {} parents", parents.len());
        for (i, &tok) in tokens.iter().enumerate() {
            ensure!(
                (tok as usize) < c.vocab,
                "forward: tokens[{i}] = {tok} >= vocab {}",
                c.vocab
            );
        }
        let vis = Visibility::from_parents(parents)?;
        let committed = b.kv_committed(&self.cache);
        let positions: Vec<usize> = vis.depths().iter().map(|&d| committed + d).collect();
        let maxpos = positions.iter().copied().max().unwrap_or(0);
        ensure!(
            maxpos < c.max_positions,
            "forward: position {maxpos} >= max_positions {}",
            c.max_positions
        );
        let rope = b.rope_upload(RopeTable::new(&c.inv_freq, positions, c.rope_attention_factor));
        let mask = b.mask_upload(&vis);
        let (x, taps) = self.layers_tapping(w.embed(tokens), t, &mask, &rope, tap_layers);
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
        let logits = if n > 0 {
            b.to_host(&w.lm_head(&xn, n))
        } else {
            Vec::new()
        }; // [n, V]
        b.check()?;
        if let Some(tr) = self.trace.as_mut() {
            tr.f32("final_norm".into(), &[n, h], &b.to_host(&xn));
            tr.f32("logits".into(), &[n, c.vocab], &logits);
        }
        Ok((logits, taps))
    }

    /// The verify forward of the device round: the `t` nodes of `tree` (tokens, depths and mask where the
    /// ops run; nothing read back), at positions `committed + depth` (committed read where the ops run).
    /// Returns the final-normed rows `[t, H]` (lm_head's input) and the taps `[t, n_taps·H]` (empty without tap
    /// layers), both where the ops run.
    pub fn forward_tree(&mut self, tree: &B::Tree, t: usize, depth_limit: usize) -> Result<(B::Act, B::Act)> {
        let w = self.w.clone();
        let (b, c) = (&w.backend, &w.cfg);
        let committed = b.kv_committed(&self.cache);
        ensure!(
            committed + depth_limit < c.max_positions,
            "forward: position {} >= max_positions {}",
            committed + depth_limit,
            c.max_positions
        );
        let rope = b.rope_at(
            &w.rope_inv,
            c.rope_attention_factor,
            PosOf::Kv(&self.cache),
            Some(b.tree_depths(tree)),
            t,
        );
        let (x, taps) = self.layers(w.embed_ids(b.tree_tokens(tree), t), t, b.tree_mask(tree), &rope);
        self.last_parents.clear();
        let xn = w.final_norm(&x);
        b.check()?;
        Ok((xn, taps.unwrap_or_else(|| b.zeros(0))))
    }

    /// The device round's decisions and walk over the verify `logits` (sampling positions from the committed
    /// length where the ops run).
    pub fn walk_tree(&mut self, tree: &mut B::Tree, logits: &B::Act, s: &Sampling) -> Result<()> {
        self.w.backend.tree_walk(tree, logits, 0, s, &self.cache)
    }

    /// The device round's commit, where the ops run: the drafter's context gets the accepted nodes' taps (the
    /// path's rows of `taps`, padded to a block), the latent cache keeps the path, both lengths advance by the
    /// walk's length and the tree's root becomes the bonus. The host copies follow in
    /// [`TargetModel::read_walk`].
    pub fn commit_walk(&mut self, tree: &mut B::Tree, d: &mut DFlashDrafter<B>, taps: &B::Act) -> Result<()> {
        let b = &self.w.backend;
        let (m, tw) = (d.block_size(), self.info.tap_layers.len() * self.info.hidden_size);
        let acc = b.tree_path_rows(tree, taps, 0, tw, m);
        d.write_context(&acc, m);
        b.tree_commit(tree, &mut self.cache, d.context_pos_mut())?;
        b.check()
    }

    /// The AR step's slot (its token buffer, one-node mask, captured graph), made on first use.
    pub(crate) fn step_slot(&mut self) {
        if self.step.is_none() {
            let b = &self.w.backend;
            let mask = b.mask_upload(&Visibility::from_parents(&[-1]).expect("a one-node tree"));
            self.step = Some(StepSlot {
                token: b.ids_from_host(&[0]),
                mask,
                graph: None,
            });
        }
    }

    /// The round's one read back (the walk of a `t`-node tree and its popped nodes' scores), checked, then
    /// the host copies of the lengths advance.
    pub fn read_walk(
        &mut self,
        tree: &mut B::Tree,
        d: &mut DFlashDrafter<B>,
        t: usize,
    ) -> Result<crate::ddtree::TreeResult> {
        let r = self.w.backend.tree_result(tree)?;
        accept_walk(&self.w.backend, &mut self.cache, tree, d, t, r)
    }
}

/// A device round's result `r` (read back) for a `t`-node tree, checked, then the host copies of the lengths
/// advance (the cache's and the drafter context's).
pub(crate) fn accept_walk<B: Backend>(
    b: &B,
    cache: &mut B::Kv,
    tree: &mut B::Tree,
    d: &mut DFlashDrafter<B>,
    t: usize,
    r: crate::ddtree::TreeResult,
) -> Result<crate::ddtree::TreeResult> {
    let walk = &r.walk;
    ensure!(
        r.log_q.len() == t - 1,
        "device round: {} node scores for a tree of {} drafted nodes",
        r.log_q.len(),
        t - 1
    );
    let (p, rows) = (&walk.path, d.block_size() - 1);
    ensure!(
        !p.is_empty()
            && p[0] == 0
            && p.len() <= rows + 1
            && p.windows(2).all(|x| x[0] < x[1])
            && p[p.len() - 1] < t
            && walk.decisions.len() == p.len(),
        "device walk: path {p:?} with {} decisions is not a root-to-node path of a {t}-node tree",
        walk.decisions.len()
    );
    b.tree_commit_host(tree, cache, d.context_pos_mut(), p.len());
    Ok(r)
}

/// The decoder layers over embedded rows `x` `[T, H]` of one or several sequences (`segs`, consecutive
/// rows, T = their nodes; each segment's latent rows go to its own cache as scratch): the residual stream
/// after the last layer and the taps `[T, n_taps·H]` (None without tap layers). Probes (`trace`) record a
/// single-sequence forward. `stacked`: several segments' RoPE tables stacked in segment order
/// ([`crate::backend::Compute::rope_at_segs`]); None: the segments' own tables, stacked here.
pub(crate) fn decoder_layers<B: Backend>(
    w: &Weights<B>,
    segs: &mut [Seg<'_, B>],
    mut x: B::Act,
    tap_layers: &[usize],
    mode: AttnMode,
    mut trace: Option<&mut Trace>,
    stacked: Option<&B::Rope>,
) -> (B::Act, Option<B::Act>) {
    let (b, c) = (&w.backend, &w.cfg);
    let t: usize = segs.iter().map(|s| s.t).sum();
    let (h, taps_n) = (c.hidden, tap_layers.len());
    let mut taps = (taps_n > 0).then(|| b.zeros(t * taps_n * h));
    segs.iter_mut().for_each(|s| b.kv_drop_scratch(s.kv));
    let cat = match stacked {
        None if segs.len() > 1 => Some(b.rope_cat(&segs.iter().map(|s| s.rope).collect::<Vec<_>>())),
        _ => None,
    };
    let rope_all = stacked.or(cat.as_ref()).filter(|_| segs.len() > 1);
    let layers = &w.ranks[0].layers;
    // Each residual add and the norm after it are one op (`add_rms_norm_in`), its output the linears' input: the
    // same values as add, rms_norm and the conversion apart.
    let mut xn = layers.first().map(|l0| b.rms_norm_in(&x, &l0.input_norm, c.eps));
    for (l, layer) in layers.iter().enumerate() {
        let a = mla(
            w,
            l,
            &xn.take().expect("the layer's normed input"),
            t,
            segs,
            rope_all,
            mode,
        );
        let hn = b.add_rms_norm_in(&mut x, &a, &layer.post_norm, c.eps);
        let m = ffn(w, l, &hn, t, trace.as_deref_mut());
        match layers.get(l + 1) {
            Some(next) => xn = Some(b.add_rms_norm_in(&mut x, &m, &next.input_norm, c.eps)),
            None => b.add(&mut x, &m),
        }
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32(format!("layers.{l}.attn_out"), &[t, h], &b.to_host(&a));
            tr.f32(format!("layers.{l}.mlp_out"), &[t, h], &b.to_host(&m));
            tr.f32(format!("layers.{l}.residual"), &[t, h], &b.to_host(&x));
        }
        if let Some(acc) = taps.as_mut() {
            for (k, _) in tap_layers.iter().enumerate().filter(|(_, &tl)| tl == l) {
                b.set_cols(acc, taps_n * h, k * h, &x, h, t);
            }
        }
    }
    segs.iter_mut().for_each(|s| b.kv_set_scratch(s.kv, s.t));
    (x, taps)
}

impl<B: Backend> Target for TargetModel<B> {
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn committed(&self) -> usize {
        self.w.backend.kv_committed(&self.cache)
    }

    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        let tap_layers = self.info.tap_layers.clone();
        let (logits, taps) = self.forward_tapping(tokens, parents, rows, &tap_layers)?;
        let taps = taps.map(|a| self.w.backend.to_host(&a)).unwrap_or_default();
        self.w.backend.check()?;
        Ok(StepOut { logits, taps })
    }

    fn commit(&mut self, path: &[usize]) -> Result<()> {
        (self.dev_root, self.step_root) = (None, None);
        let n = self.last_parents.len();
        for (k, &node) in path.iter().enumerate() {
            ensure!(
                node < n,
                "commit: path[{k}] = {node} but the last forward had {n} nodes"
            );
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
        (self.dev_root, self.step_root) = (None, None);
        self.w.backend.kv_truncate(&mut self.cache, len)?;
        self.last_parents.clear();
        Ok(())
    }

    fn reset(&mut self) {
        (self.dev_root, self.step_root) = (None, None);
        self.w.backend.kv_reset(&mut self.cache);
        self.last_parents.clear();
    }

    fn reserve(&mut self, rows: usize) -> Result<()> {
        self.w.backend.kv_reserve(&mut self.cache, rows)
    }

    fn start_trace(&mut self) {
        self.trace = Some(Trace::default());
    }

    fn take_trace(&mut self) -> Option<Trace> {
        self.trace.take()
    }

    fn device_prefill(
        &mut self,
        drafter: Option<&mut dyn Drafter>,
        tokens: &[u32],
        last: bool,
    ) -> Option<Result<Vec<f32>>> {
        // A target alone reaches no drafter's concrete type (a `Model` pairs them): with one, the host prefill.
        if drafter.is_some() {
            return None;
        }
        self.prefill_chunk(tokens, last, None)
    }
    fn device_step(&mut self, root: u32, s: &Sampling) -> Option<Result<u32>> {
        let start = self.w.backend.kv_committed(&self.cache);
        if self.trace.is_some() || start + 1 >= self.info.max_positions || root as usize >= self.info.vocab_size {
            return None;
        }
        self.step_slot();
        let w = self.w.clone();
        let mut part = [round::StepPart {
            t: self,
            root,
            s,
            feed: None,
        }];
        Some(round::steps(&w, &mut part, None).map(|t| t[0]))
    }

    fn fork(&self) -> Option<Box<dyn Target>> {
        Some(Box::new(
            TargetModel::new(self.w.clone(), self.info.tap_layers.clone(), self.mode).ok()?,
        ))
    }

    fn kv_row_bytes(&self) -> usize {
        self.w.backend.kv_row_bytes(&self.cache)
    }

    fn release(&mut self) {
        (self.dev_root, self.step_root) = (None, None);
        self.w.backend.kv_release(&mut self.cache);
        self.last_parents.clear();
    }

    fn mem_free(&self) -> Option<usize> {
        self.w.backend.mem_free()
    }
    fn graph_stats(&self) -> Option<crate::api::GraphStats> {
        self.w.backend.graph_stats()
    }
}
