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
use crate::api::{LogitRows, StepOut, Target, TargetInfo};
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
        Ok(TargetModel { w, info, cache, mode, trace: None, last_parents: Vec::new() })
    }
    pub fn weights(&self) -> &Arc<Weights<B>> {
        &self.w
    }
    pub fn mode(&self) -> AttnMode {
        self.mode
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
        let mask = Visibility::from_parents(parents)?;
        let committed = b.kv_committed(&self.cache);
        let positions: Vec<usize> = mask.depths().iter().map(|&d| committed + d).collect();
        let maxpos = positions.iter().copied().max().unwrap_or(0);
        ensure!(maxpos < c.max_positions, "forward: position {maxpos} >= max_positions {}", c.max_positions);
        b.kv_drop_scratch(&mut self.cache);
        let rope = RopeTable::new(&c.inv_freq, positions, c.rope_attention_factor);

        let h = c.hidden;
        let taps_n = self.info.tap_layers.len();
        let mut taps = vec![0f32; if taps_n > 0 { t * taps_n * h } else { 0 }]; // [T, n_taps * H]
        let mut x = w.embed(tokens); // [T, H] residual stream
        for (l, layer) in w.ranks[0].layers.iter().enumerate() {
            let a = mla(&w, l, &b.rms_norm(&x, &layer.input_norm, c.eps), &mask, &rope, &mut self.cache, self.mode);
            b.add(&mut x, &a);
            let m = ffn(&w, l, &b.rms_norm(&x, &layer.post_norm, c.eps), t, self.trace.as_mut());
            b.add(&mut x, &m);
            if let Some(tr) = self.trace.as_mut() {
                tr.f32(format!("layers.{l}.attn_out"), &[t, h], &b.to_host(&a));
                tr.f32(format!("layers.{l}.mlp_out"), &[t, h], &b.to_host(&m));
                tr.f32(format!("layers.{l}.residual"), &[t, h], &b.to_host(&x));
            }
            if self.info.tap_layers.contains(&l) {
                let xh = b.to_host(&x);
                for (k, _) in self.info.tap_layers.iter().enumerate().filter(|(_, &tl)| tl == l) {
                    for i in 0..t {
                        taps[(i * taps_n + k) * h..(i * taps_n + k + 1) * h].copy_from_slice(&xh[i * h..(i + 1) * h]);
                    }
                }
            }
        }
        b.kv_set_scratch(&mut self.cache, t);
        self.last_parents = parents.to_vec();
        // Only the rows asked for go through the final norm and lm_head (a row's result does not depend
        // on the other rows, so the values equal those of an all-rows forward bit for bit).
        let first = match rows {
            LogitRows::All => 0,
            LogitRows::Last => t - 1,
            LogitRows::None => t,
        };
        let n = t - first;
        let xn = w.final_norm(&b.rows(&x, h, first, t));
        let logits = if n > 0 { b.to_host(&w.lm_head(&xn, n)) } else { Vec::new() }; // [n, V]
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
}
