//! DFlash drafter forward (CPU reference) implementing [`api::Drafter`].
//!
//! What it computes (ddtree.md §1, z-lab `dflash/model.py`, liranringel/ddtree `model/dflash.py`):
//! * context: `ctx = hidden_norm(fc(concat taps))`; in every draft layer its keys/values are that layer's
//!   `k_norm(k_proj(ctx))` (RoPE at the tokens' absolute positions) and `v_proj(ctx)`. They depend only on
//!   the committed token and its position, so they are computed once per committed token per layer and
//!   cached ([`DFlashDrafter::extend_context`]); the cache never holds block (draft) K/V.
//! * block: `[bonus, mask × (B−1)]` embedded with the target's `embed_tokens`, at positions
//!   `start..start+B`; each layer is pre-norm Qwen3: non-causal GQA attention of the block queries over
//!   `[K_ctx ; K_block]` (q_norm/k_norm per head, then NeoX rotate_half RoPE over the full head_dim,
//!   scale head_dim^-0.5), then SwiGLU MLP; final `norm`; the target's `lm_head`; rows 1..B−1 returned.
//! * RoPE/YaRN from the drafter config: inverse frequencies per transformers `_compute_yarn_parameters`
//!   (cpu::ops::yarn_inv_freq) and cos/sin amplitude = the transformers default
//!   `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` (cpu::ops::yarn_attention_factor),
//!   which is 1.0 for the Kimi drafters (mscale = mscale_all_dim = 1); with both keys absent the formats
//!   defaults (1, 0) give `1 + 0.1 ln(factor)`, transformers' plain-YaRN default. vllm-ascend forces `1 + 0.1 ln 64 ≈ 1.416` for Kimi-K2.5-DFlash and
//!   reports higher acceptance (ddtree.md §1.9); not applied here.
//!
//! Tensor-parallel shards: the loader hands over *logical* (gathered) tensors, so the forward is the
//! same for every R and never sums per-rank partials.
//! Activations are f32, weights bf16, every reduction in the fixed order of cpu::ops.
//! Tests: engine/tests/ddtree_drafter.rs (chunking invariance, non-causality, naive from-scratch reference).
//!
//! Dimension letters: H hidden, C committed context rows, B block, Hq query heads, Hk kv heads, D head_dim,
//! I intermediate, V vocab, n_tap number of tapped target layers.

use crate::api::Drafter;
use crate::cpu::ops;
use anyhow::{bail, ensure, Result};
use half::bf16;
use kdtree_formats::config::DrafterConfig;
use rayon::prelude::*;
use std::sync::Arc;

/// The target's token table and LM head, borrowed by the drafter (it has neither of its own).
pub trait TargetTables: Send + Sync {
    fn hidden_size(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// `embed_tokens` rows of `tokens`: [n, H] f32.
    fn embed(&self, tokens: &[u32]) -> Vec<f32>;
    /// `lm_head(x)` for x [n, H] f32: [n, V] f32 logits in global vocab order.
    fn lm_head(&self, x: &[f32], n: usize) -> Vec<f32>;
}

/// Whole (vocab-gathered) bf16 tables held in memory.
pub struct DenseTables {
    pub hidden: usize,
    pub vocab: usize,
    /// [V, H] bf16
    pub embed_tokens: Vec<bf16>,
    /// [V, H] bf16
    pub lm_head: Vec<bf16>,
}

impl TargetTables for DenseTables {
    fn hidden_size(&self) -> usize {
        self.hidden
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        ops::embedding_bf16(&[&self.embed_tokens], self.hidden, tokens)
    }
    fn lm_head(&self, x: &[f32], n: usize) -> Vec<f32> {
        ops::lm_head_bf16(x, n, self.hidden, &[&self.lm_head])
    }
}

/// The CPU target's own per-rank tables (vocab-parallel `[V/R, H]` shards), used without a copy: embed looks
/// up the owning rank's row; lm_head runs each rank's shard and places its columns at the rank's vocab
/// offset (global vocab order, ddtree.md §5.6 item 10).
impl TargetTables for crate::model::Weights {
    fn hidden_size(&self) -> usize {
        self.cfg.hidden
    }
    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        crate::model::Weights::embed(self, tokens)
    }
    fn lm_head(&self, x: &[f32], n: usize) -> Vec<f32> {
        crate::model::Weights::lm_head(self, x, n)
    }
}

/// Shapes of the drafter, from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterDims {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub n_taps: usize,
    pub block: usize,
    pub mask_token_id: u32,
    pub vocab: usize,
    pub eps: f32,
}

impl DrafterDims {
    pub fn from_config(cfg: &DrafterConfig) -> Result<Self> {
        let block = cfg.block_size().ok_or_else(|| anyhow::anyhow!("drafter config has no block_size"))?;
        let d = DrafterDims {
            hidden: cfg.hidden_size,
            layers: cfg.num_hidden_layers,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            intermediate: cfg.intermediate_size,
            n_taps: cfg.dflash_config.target_layer_ids.len(),
            block,
            mask_token_id: cfg.dflash_config.mask_token_id,
            vocab: cfg.vocab_size,
            eps: cfg.rms_norm_eps as f32,
        };
        ensure!(d.kv_heads > 0 && d.heads.is_multiple_of(d.kv_heads), "drafter: {} heads not a multiple of {} kv heads", d.heads, d.kv_heads);
        ensure!(d.head_dim.is_multiple_of(2), "drafter: head_dim {} must be even for RoPE", d.head_dim);
        ensure!(d.block >= 2, "drafter: block_size {} < 2", d.block);
        ensure!(d.n_taps > 0, "drafter: dflash_config.target_layer_ids is empty");
        // The mask token is embedded at every block position but the first: it must be a vocabulary row.
        ensure!(
            (d.mask_token_id as usize) < d.vocab,
            "drafter: dflash_config.mask_token_id {} is outside the vocabulary (vocab_size {})",
            d.mask_token_id,
            d.vocab
        );
        Ok(d)
    }
}

/// One draft decoder layer, checkpoint names under `drafter.layers.{i}.`.
pub struct DraftLayer {
    pub input_layernorm: Vec<bf16>,          // [H]
    pub q_proj: Vec<bf16>,                   // [Hq*D, H]
    pub k_proj: Vec<bf16>,                   // [Hk*D, H]
    pub v_proj: Vec<bf16>,                   // [Hk*D, H]
    pub o_proj: Vec<bf16>,                   // [H, Hq*D]
    pub q_norm: Vec<bf16>,                   // [D]
    pub k_norm: Vec<bf16>,                   // [D]
    pub post_attention_layernorm: Vec<bf16>, // [H]
    pub gate_proj: Vec<bf16>,                // [I, H]
    pub up_proj: Vec<bf16>,                  // [I, H]
    pub down_proj: Vec<bf16>,                // [H, I]
}

/// All drafter weights as logical (unsplit) bf16 tensors.
pub struct DrafterWeights {
    pub fc: Vec<bf16>,          // [H, n_tap*H]
    pub hidden_norm: Vec<bf16>, // [H]
    pub norm: Vec<bf16>,        // [H]
    pub layers: Vec<DraftLayer>,
}

impl DrafterWeights {
    /// Load every `drafter.*` tensor through `get(name, logical_shape)`, which must return the whole
    /// logical tensor (ranks gathered along their split axis) as bf16, row-major. Lengths are checked here.
    pub fn load_with(d: &DrafterDims, mut get: impl FnMut(&str, &[usize]) -> Result<Vec<bf16>>) -> Result<Self> {
        let (h, qd, kd, i) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate);
        let mut take = |name: String, shape: &[usize]| -> Result<Vec<bf16>> {
            let v = get(&name, shape)?;
            let want: usize = shape.iter().product();
            ensure!(v.len() == want, "{name}: got {} values, expected {shape:?} = {want}", v.len());
            Ok(v)
        };
        let fc = take("drafter.fc.weight".into(), &[h, d.n_taps * h])?;
        let hidden_norm = take("drafter.hidden_norm.weight".into(), &[h])?;
        let norm = take("drafter.norm.weight".into(), &[h])?;
        let mut layers = Vec::with_capacity(d.layers);
        for l in 0..d.layers {
            let p = format!("drafter.layers.{l}.");
            layers.push(DraftLayer {
                input_layernorm: take(format!("{p}input_layernorm.weight"), &[h])?,
                q_proj: take(format!("{p}self_attn.q_proj.weight"), &[qd, h])?,
                k_proj: take(format!("{p}self_attn.k_proj.weight"), &[kd, h])?,
                v_proj: take(format!("{p}self_attn.v_proj.weight"), &[kd, h])?,
                o_proj: take(format!("{p}self_attn.o_proj.weight"), &[h, qd])?,
                q_norm: take(format!("{p}self_attn.q_norm.weight"), &[d.head_dim])?,
                k_norm: take(format!("{p}self_attn.k_norm.weight"), &[d.head_dim])?,
                post_attention_layernorm: take(format!("{p}post_attention_layernorm.weight"), &[h])?,
                gate_proj: take(format!("{p}mlp.gate_proj.weight"), &[i, h])?,
                up_proj: take(format!("{p}mlp.up_proj.weight"), &[i, h])?,
                down_proj: take(format!("{p}mlp.down_proj.weight"), &[h, i])?,
            });
        }
        Ok(DrafterWeights { fc, hidden_norm, norm, layers })
    }
}

/// Cached context K/V of one layer (committed context only).
#[derive(Default, Clone)]
struct LayerCache {
    k: Vec<f32>, // [C, Hk*D] after k_norm and RoPE
    v: Vec<f32>, // [C, Hk*D]
}

/// A DFlash drafter session.
pub struct DFlashDrafter {
    dims: DrafterDims,
    w: DrafterWeights,
    tables: Arc<dyn TargetTables>,
    inv_freq: Vec<f32>, // [D/2]
    attention_factor: f64,
    cache: Vec<LayerCache>,
    ctx_len: usize,
}

impl DFlashDrafter {
    /// Load the drafter of a converted model (`drafter.*` tensors, gathered over ranks) with the target's
    /// tables. Errors when the model has no drafter.
    pub fn load(src: &dyn crate::model::TensorSource, tables: Arc<dyn TargetTables>) -> Result<Self> {
        let cfg = src.drafter_config().ok_or_else(|| anyhow::anyhow!("model has no drafter (no drafter config)"))?.clone();
        let dims = DrafterDims::from_config(&cfg)?;
        let w = DrafterWeights::load_with(&dims, |name, shape| {
            let (v, logical) = crate::model::source::gather_bf16(src, name)?;
            ensure!(logical == shape, "{name}: logical shape {logical:?}, expected {shape:?}");
            Ok(v)
        })?;
        Self::new(&cfg, w, tables)
    }

    pub fn new(cfg: &DrafterConfig, w: DrafterWeights, tables: Arc<dyn TargetTables>) -> Result<Self> {
        let dims = DrafterDims::from_config(cfg)?;
        ensure!(tables.hidden_size() == dims.hidden, "drafter hidden {} != target hidden {}", dims.hidden, tables.hidden_size());
        ensure!(tables.vocab_size() == dims.vocab, "drafter vocab {} != target vocab {}", dims.vocab, tables.vocab_size());
        ensure!(w.layers.len() == dims.layers, "drafter: {} layers loaded, config says {}", w.layers.len(), dims.layers);
        let inv_freq = ops::yarn_inv_freq(dims.head_dim, cfg.rope_theta, cfg.rope_scaling.as_ref());
        let attention_factor = ops::yarn_attention_factor(cfg.rope_scaling.as_ref());
        let cache = vec![LayerCache::default(); dims.layers];
        Ok(DFlashDrafter { dims, w, tables, inv_freq, attention_factor, cache, ctx_len: 0 })
    }
    pub fn dims(&self) -> &DrafterDims {
        &self.dims
    }
    pub fn rope_attention_factor(&self) -> f64 {
        self.attention_factor
    }

    /// q_norm/k_norm per head then NeoX RoPE, in place on x [rows, heads*D] at positions pos0.. .
    fn norm_rope(&self, x: &mut [f32], heads: usize, weight: &[bf16], pos0: usize) {
        let dd = self.dims.head_dim;
        let normed = ops::rms_norm(x, weight, self.dims.eps); // rows*heads vectors of D
        x.copy_from_slice(&normed);
        for (r, row) in x.chunks_mut(heads * dd).enumerate() {
            let (cos, sin) = ops::rope_cos_sin(&self.inv_freq, pos0 + r, self.attention_factor);
            for hv in row.chunks_mut(dd) {
                ops::rope_neox(hv, &cos, &sin);
            }
        }
    }

    /// Non-causal GQA attention of q [B, Hq*D] over the keys/values of `[context ; block]`: context rows
    /// `kc`/`vc` [C, Hk*D] then block rows `kb`/`vb` [B, Hk*D] (the cache is read in place). Scores,
    /// softmax and the weighted sum run over the C + B rows in that order. Returns [B, Hq*D].
    fn attention(&self, q: &[f32], (kc, vc): (&[f32], &[f32]), (kb, vb): (&[f32], &[f32]), b: usize) -> Vec<f32> {
        let DrafterDims { heads, kv_heads, head_dim: dd, .. } = self.dims;
        let (qw, kw) = (heads * dd, kv_heads * dd);
        let nc = kc.len() / kw;
        let group = heads / kv_heads;
        let scale = (dd as f32).powf(-0.5);
        let mut out = vec![0f32; b * qw];
        out.par_chunks_mut(dd).enumerate().for_each(|(idx, o)| {
            let (t, hq) = (idx / heads, idx % heads);
            let hk = hq / group;
            let qv = &q[t * qw + hq * dd..t * qw + (hq + 1) * dd];
            let head = |r: usize| r * kw + hk * dd..r * kw + (hk + 1) * dd; // head hk of row r
            let dot = |kv: &[f32]| qv.iter().zip(kv).fold(0f32, |a, (x, y)| a + x * y) * scale;
            let mut s: Vec<f32> = (0..nc)
                .map(|j| dot(&kc[head(j)]))
                .chain((0..b).map(|j| dot(&kb[head(j)])))
                .collect();
            ops::softmax(&mut s);
            for (j, &p) in s.iter().enumerate() {
                let vv = if j < nc { &vc[head(j)] } else { &vb[head(j - nc)] };
                for (oi, &vi) in o.iter_mut().zip(vv) {
                    *oi += p * vi;
                }
            }
        });
        out
    }
}

impl Drafter for DFlashDrafter {
    fn block_size(&self) -> usize {
        self.dims.block
    }

    fn context_len(&self) -> usize {
        self.ctx_len
    }

    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()> {
        let DrafterDims { hidden: h, n_taps, kv_heads, head_dim, eps, .. } = self.dims;
        if taps.len() != n * n_taps * h {
            bail!("extend_context: taps has {} values, expected n={n} x {n_taps} taps x H={h}", taps.len());
        }
        if n == 0 {
            return Ok(());
        }
        // [n, H] f32
        let ctx = ops::rms_norm(&ops::matmul_bf16(taps, &self.w.fc, n, n_taps * h, h), &self.w.hidden_norm, eps);
        let kw = kv_heads * head_dim;
        for l in 0..self.dims.layers {
            let lw = &self.w.layers[l];
            let mut k = ops::matmul_bf16(&ctx, &lw.k_proj, n, h, kw); // [n, Hk*D]
            self.norm_rope(&mut k, kv_heads, &lw.k_norm, self.ctx_len);
            let v = ops::matmul_bf16(&ctx, &lw.v_proj, n, h, kw); // [n, Hk*D]
            self.cache[l].k.extend_from_slice(&k);
            self.cache[l].v.extend_from_slice(&v);
        }
        self.ctx_len += n;
        Ok(())
    }

    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>> {
        let DrafterDims { hidden: h, heads, kv_heads, head_dim, intermediate, block: b, mask_token_id, eps, .. } = self.dims;
        if start != self.ctx_len {
            bail!("draft: block starts at {start} but the drafter context holds {} positions", self.ctx_len);
        }
        let (qw, kw) = (heads * head_dim, kv_heads * head_dim);
        let mut ids = vec![mask_token_id; b];
        ids[0] = bonus;
        let mut x = self.tables.embed(&ids); // [B, H]
        for l in 0..self.dims.layers {
            let lw = &self.w.layers[l];
            let hn = ops::rms_norm(&x, &lw.input_layernorm, eps); // [B, H]
            let mut q = ops::matmul_bf16(&hn, &lw.q_proj, b, h, qw); // [B, Hq*D]
            self.norm_rope(&mut q, heads, &lw.q_norm, start);
            let mut kb = ops::matmul_bf16(&hn, &lw.k_proj, b, h, kw); // [B, Hk*D]
            self.norm_rope(&mut kb, kv_heads, &lw.k_norm, start);
            let vb = ops::matmul_bf16(&hn, &lw.v_proj, b, h, kw); // [B, Hk*D]
            let c = &self.cache[l];
            let att = self.attention(&q, (&c.k, &c.v), (&kb, &vb), b); // [B, Hq*D]
            let o = ops::matmul_bf16(&att, &lw.o_proj, b, qw, h);
            x.iter_mut().zip(&o).for_each(|(a, d)| *a += d);
            let hn = ops::rms_norm(&x, &lw.post_attention_layernorm, eps);
            let g = ops::matmul_bf16(&hn, &lw.gate_proj, b, h, intermediate); // [B, I]
            let u = ops::matmul_bf16(&hn, &lw.up_proj, b, h, intermediate); // [B, I]
            let m = ops::matmul_bf16(&ops::silu_mul(&g, &u), &lw.down_proj, b, intermediate, h);
            x.iter_mut().zip(&m).for_each(|(a, d)| *a += d);
        }
        let xn = ops::rms_norm(&x[h..], &self.w.norm, eps); // [B-1, H]: block positions 1..B-1
        Ok(self.tables.lm_head(&xn, b - 1))
    }

    fn truncate_context(&mut self, len: usize) -> Result<()> {
        ensure!(len <= self.ctx_len, "truncate_context to {len}: the context holds {} positions", self.ctx_len);
        let kw = self.dims.kv_heads * self.dims.head_dim;
        for c in &mut self.cache {
            c.k.truncate(len * kw);
            c.v.truncate(len * kw);
        }
        self.ctx_len = len;
        Ok(())
    }

    fn reset(&mut self) {
        self.cache.iter_mut().for_each(|c| *c = LayerCache::default());
        self.ctx_len = 0;
    }
}
