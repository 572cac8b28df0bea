//! The CPU K2.6 target session: [`CpuTarget`] implements `api::Target` (tree forward with parents, commit
//! of an accepted path) over [`Weights`] and the latent cache.
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
use super::cache::{LatentCache, TreeMask};
use super::ffn;
use super::trace::Trace;
use super::weights::{Ffn, Weights};
use crate::api::{LogitRows, StepOut, Target, TargetInfo};
use crate::cpu::ops;
use anyhow::{ensure, Result};
use std::sync::Arc;

/// A target session on the CPU reference backend.
pub struct CpuTarget {
    w: Arc<Weights>,
    info: TargetInfo,
    cache: LatentCache,
    mode: AttnMode,
    trace: Option<Trace>,
    /// Parents of the last forward's nodes (commit checks the path against them).
    last_parents: Vec<i32>,
}

impl CpuTarget {
    pub fn new(w: Arc<Weights>, tap_layers: Vec<usize>, mode: AttnMode) -> Result<CpuTarget> {
        let c = &w.cfg;
        for &l in &tap_layers {
            ensure!(l < c.layers, "tap layer {l} >= num_hidden_layers {}", c.layers);
        }
        let info =
            TargetInfo { vocab_size: c.vocab, hidden_size: c.hidden, num_layers: c.layers, max_positions: c.max_positions, tap_layers };
        let cache = LatentCache::new(c.layers, c.latent_width());
        Ok(CpuTarget { w, info, cache, mode, trace: None, last_parents: Vec::new() })
    }
    pub fn weights(&self) -> &Arc<Weights> {
        &self.w
    }
    pub fn mode(&self) -> AttnMode {
        self.mode
    }
}

impl Target for CpuTarget {
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn committed(&self) -> usize {
        self.cache.committed
    }

    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        let w = self.w.clone();
        let c = &w.cfg;
        let t = tokens.len();
        ensure!(t > 0, "forward: no tokens");
        ensure!(parents.len() == t, "forward: {t} tokens but {} parents", parents.len());
        for (i, &tok) in tokens.iter().enumerate() {
            ensure!((tok as usize) < c.vocab, "forward: tokens[{i}] = {tok} >= vocab {}", c.vocab);
        }
        let mask = TreeMask::from_parents(parents)?;
        let positions: Vec<usize> = mask.depth.iter().map(|&d| self.cache.committed + d).collect();
        let maxpos = positions.iter().copied().max().unwrap_or(0);
        ensure!(maxpos < c.max_positions, "forward: position {maxpos} >= max_positions {}", c.max_positions);
        self.cache.drop_scratch();

        let h = c.hidden;
        let taps_n = self.info.tap_layers.len();
        let mut taps = vec![0f32; if taps_n > 0 { t * taps_n * h } else { 0 }]; // [T, n_taps * H]
        let mut x = w.embed(tokens); // [T, H] residual stream
        for (l, layer) in w.layers.iter().enumerate() {
            let a = mla(c, &layer.attn, l, &ops::rms_norm(&x, &layer.input_norm, c.eps), &mask, &positions, &mut self.cache, self.mode);
            x.iter_mut().zip(&a).for_each(|(r, v)| *r += v);
            let xn = ops::rms_norm(&x, &layer.post_norm, c.eps);
            let m = match &layer.ffn {
                Ffn::Dense(ranks) => ffn::dense(ranks, &xn, t),
                Ffn::Moe(moe) => ffn::moe(c, moe, l, &xn, t, self.trace.as_mut()),
            };
            x.iter_mut().zip(&m).for_each(|(r, v)| *r += v);
            if let Some(tr) = self.trace.as_mut() {
                tr.f32(format!("layers.{l}.attn_out"), &[t, h], &a);
                tr.f32(format!("layers.{l}.mlp_out"), &[t, h], &m);
                tr.f32(format!("layers.{l}.residual"), &[t, h], &x);
            }
            for (k, _) in self.info.tap_layers.iter().enumerate().filter(|(_, &tl)| tl == l) {
                for i in 0..t {
                    taps[(i * taps_n + k) * h..(i * taps_n + k + 1) * h].copy_from_slice(&x[i * h..(i + 1) * h]);
                }
            }
        }
        self.cache.scratch = t;
        self.last_parents = parents.to_vec();
        // Only the rows asked for go through the final norm and lm_head (a row's result does not depend
        // on the other rows, so the values equal those of an all-rows forward bit for bit).
        let first = match rows {
            LogitRows::All => 0,
            LogitRows::Last => t - 1,
            LogitRows::None => t,
        };
        let n = t - first;
        let xn = w.final_norm(&x[first * h..]);
        let logits = if n > 0 { w.lm_head(&xn, n) } else { Vec::new() }; // [n, V]
        if let Some(tr) = self.trace.as_mut() {
            tr.f32("final_norm".into(), &[n, h], &xn);
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
        self.cache.commit(path)?;
        self.last_parents.clear();
        Ok(())
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.cache.truncate(len)?;
        self.last_parents.clear();
        Ok(())
    }

    fn reset(&mut self) {
        self.cache.reset();
        self.last_parents.clear();
    }

    fn start_trace(&mut self) {
        self.trace = Some(Trace::default());
    }

    fn take_trace(&mut self) -> Option<Trace> {
        self.trace.take()
    }
}
