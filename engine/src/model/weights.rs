//! The K2.6 target's weights, per rank, as the TP plan of docs/design/interfaces.md splits them, plus the
//! model constants the forward needs ([`ModelConfig`]). Loading checks every shard's dtype, shape and
//! recorded split against the plan (so a test that loads R = 1, 2, 4, 8 proves the engine reads the plan
//! right). Weights stay zero-copy views of the source ([`Slab`]).
//!
//! Must match: k26-format.md §2.2 (names, shapes), §5.2-§5.3 (splits). Tests: below (K2.6 constants),
//! engine/tests/target_plans.rs (every plan), engine/tests/target_model.rs.
//!
//! Dimension letters: H hidden, V vocab, R ranks, Hr = heads/R, E experts, I intermediate widths.

use super::source::{expect, expect_split, Slab, TensorSource};
use crate::cpu::ops;
use anyhow::{bail, ensure, Result};
use half::bf16;
use kdtree_formats::config::TextConfig;
use kdtree_formats::Dtype;
use std::sync::Arc;

/// eps of `q_a_layernorm` and `kv_a_layernorm`. transformers' `DeepseekV3Attention` (and DeepSeek's HF
/// remote code) build these norms without passing eps, so they use the class default 1e-6; vLLM passes
/// `rms_norm_eps` (1e-5 on K2.6). We follow transformers, because the crosscheck runs transformers'
/// `DeepseekV3ForCausalLM` (k26-format §4.2). The difference is numerically negligible.
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// Everything the forward needs from the text config, derived once.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub hidden: usize,
    pub vocab: usize,
    pub layers: usize,
    pub heads: usize,
    pub q_lora: Option<usize>,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub intermediate: usize,
    pub moe_intermediate: usize,
    pub n_experts: usize,
    pub n_shared: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling: f32,
    /// `rms_norm_eps` (input, post-attention and final norms).
    pub eps: f32,
    /// eps of q_a/kv_a layernorms, [`LATENT_NORM_EPS`].
    pub latent_eps: f32,
    pub max_positions: usize,
    /// YaRN inverse frequencies `[rope/2]`.
    pub inv_freq: Vec<f32>,
    /// cos/sin amplitude (1.0 on K2.6).
    pub rope_attention_factor: f64,
    /// `qk_head_dim^-0.5 · mscale²` (k26-format §4.3).
    pub softmax_scale: f32,
    /// Which layers are MoE.
    pub moe_layers: Vec<bool>,
    pub ranks: usize,
}

impl ModelConfig {
    pub fn from_text(t: &TextConfig, ranks: usize) -> Result<ModelConfig> {
        if let Some(f) = t.scoring_func.as_deref() {
            ensure!(f == "sigmoid", "scoring_func {f:?} is not supported (only sigmoid, as DeepSeek-V3/K2)");
        }
        if let Some(a) = t.hidden_act.as_deref() {
            ensure!(a == "silu", "hidden_act {a:?} is not supported (only silu)");
        }
        ensure!(
            t.n_group >= 1 && t.n_routed_experts % t.n_group == 0,
            "n_group {} does not divide {} experts",
            t.n_group,
            t.n_routed_experts
        );
        ensure!(t.topk_group <= t.n_group, "topk_group {} > n_group {}", t.topk_group, t.n_group);
        ensure!(
            t.num_experts_per_tok <= t.n_routed_experts,
            "num_experts_per_tok {} > n_routed_experts {}",
            t.num_experts_per_tok,
            t.n_routed_experts
        );
        ensure!(t.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim {} must be even", t.qk_rope_head_dim);
        let qk = t.qk_head_dim() as f64;
        // transformers: scaling *= mscale² only when rope_scaling has a non-zero mscale_all_dim.
        let mscale = match &t.rope_scaling {
            Some(s) if s.mscale_all_dim != 0.0 => ops::yarn_get_mscale(s.factor, s.mscale_all_dim),
            _ => 1.0,
        };
        Ok(ModelConfig {
            hidden: t.hidden_size,
            vocab: t.vocab_size,
            layers: t.num_hidden_layers,
            heads: t.num_attention_heads,
            q_lora: t.q_lora_rank,
            kv_lora: t.kv_lora_rank,
            nope: t.qk_nope_head_dim,
            rope: t.qk_rope_head_dim,
            v_dim: t.v_head_dim,
            intermediate: t.intermediate_size,
            moe_intermediate: t.moe_intermediate_size,
            n_experts: t.n_routed_experts,
            n_shared: t.n_shared_experts,
            top_k: t.num_experts_per_tok,
            n_group: t.n_group,
            topk_group: t.topk_group,
            norm_topk_prob: t.norm_topk_prob,
            routed_scaling: t.routed_scaling_factor as f32,
            eps: t.rms_norm_eps as f32,
            latent_eps: LATENT_NORM_EPS,
            max_positions: t.max_position_embeddings,
            inv_freq: ops::yarn_inv_freq(t.qk_rope_head_dim, t.rope_theta, t.rope_scaling.as_ref()),
            rope_attention_factor: ops::yarn_attention_factor(t.rope_scaling.as_ref()),
            softmax_scale: (qk.powf(-0.5) * mscale * mscale) as f32,
            moe_layers: (0..t.num_hidden_layers).map(|l| t.is_moe_layer(l)).collect(),
            ranks,
        })
    }
    pub fn qk_head_dim(&self) -> usize {
        self.nope + self.rope
    }
    /// Latent cache width per token per layer: kv_lora + rope (576 on K2.6).
    pub fn latent_width(&self) -> usize {
        self.kv_lora + self.rope
    }
    pub fn heads_per_rank(&self) -> usize {
        self.heads / self.ranks
    }
    /// The MoE router's constants.
    pub fn router(&self) -> ops::Router {
        ops::Router {
            n_experts: self.n_experts,
            n_group: self.n_group,
            topk_group: self.topk_group,
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling: self.routed_scaling,
        }
    }
}

/// A bf16 matrix `[rows, cols]` (torch Linear layout `[out, in]`).
pub struct Mat {
    pub w: Slab<bf16>,
    pub rows: usize,
    pub cols: usize,
}

impl Mat {
    /// `x[T, cols] · W^T` → `[T, rows]` f32.
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        ops::matmul_bf16(x, &self.w, t, self.cols, self.rows)
    }
}

/// Stacked INT4 group-32 experts of one rank: `packed` `[count, n, k/2]` u8, `scales` `[count, n, k/32]`
/// bf16, holding global experts `first..first + count`.
pub struct I4Stack {
    pub packed: Slab<u8>,
    pub scales: Slab<bf16>,
    pub first: usize,
    pub count: usize,
    pub n: usize,
    pub k: usize,
}

impl I4Stack {
    /// Whether this rank holds global expert `e`.
    pub fn holds(&self, e: usize) -> bool {
        e >= self.first && e < self.first + self.count
    }
    /// Global expert `e`'s `[n, k]` matrix (must be held).
    pub fn expert(&self, e: usize) -> ops::ExpertI4<'_> {
        assert!(self.holds(e), "expert {e} not on this rank (holds {}..{})", self.first, self.first + self.count);
        let i = e - self.first;
        let (pb, sb) = (self.n * self.k / 2, self.n * self.k / 32);
        ops::ExpertI4 { packed: &self.packed[i * pb..(i + 1) * pb], scales: &self.scales[i * sb..(i + 1) * sb], n: self.n, k: self.k }
    }
}

/// One rank's slice of a SwiGLU MLP: gate/up `[I/R, H]`, down `[H, I/R]`.
pub struct Mlp {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

/// One rank's attention heads `head0..head0 + Hr`: q_b (or q_proj) `[Hr·qk, ·]`, kv_b `[Hr·(nope+v), kv_lora]`,
/// o_proj `[H, Hr·v]`.
pub struct AttnRank {
    pub q: Mat,
    pub kv_b: Mat,
    pub o_proj: Mat,
    pub head0: usize,
}

/// MLA weights of one layer: replicated q_a (+ norm), kv_a (+ norm), and per-rank head slices.
pub struct Attn {
    /// q_a_proj `[q_lora, H]` and q_a_layernorm `[q_lora]`; None when q_lora_rank is None (q_proj instead).
    pub q_a: Option<(Mat, Slab<bf16>)>,
    /// kv_a_proj_with_mqa `[kv_lora + rope, H]`.
    pub kv_a: Mat,
    /// kv_a_layernorm `[kv_lora]`.
    pub kv_a_norm: Slab<bf16>,
    pub ranks: Vec<AttnRank>,
}

/// MoE weights of one layer.
pub struct Moe {
    /// mlp.gate `[E, H]` (replicated).
    pub router: Mat,
    /// e_score_correction_bias `[E]` f32 (noaux_tc only).
    pub bias: Option<Slab<f32>>,
    /// Shared experts, per rank (empty when n_shared_experts = 0).
    pub shared: Vec<Mlp>,
    /// Routed experts per rank: gate/up `[E_r, I_r, H]`, down `[E_r, H, I_r]`.
    pub gate: Vec<I4Stack>,
    pub up: Vec<I4Stack>,
    pub down: Vec<I4Stack>,
}

pub enum Ffn {
    Dense(Vec<Mlp>),
    Moe(Moe),
}

pub struct Layer {
    pub input_norm: Slab<bf16>,
    pub post_norm: Slab<bf16>,
    pub attn: Attn,
    pub ffn: Ffn,
}

/// All target weights, per rank.
pub struct Weights {
    pub cfg: ModelConfig,
    /// embed_tokens per rank `[V/R, H]` (vocab-parallel).
    pub embed: Vec<Mat>,
    /// model.norm `[H]`.
    pub norm: Slab<bf16>,
    /// lm_head per rank `[V/R, H]` (vocab-parallel; embed_tokens when tied).
    pub lm_head: Vec<Mat>,
    pub layers: Vec<Layer>,
}

/// Loader context: the source and helpers that check shape and split.
struct Ld<'a> {
    owner: &'a Arc<dyn TensorSource>,
    r: usize,
}

impl Ld<'_> {
    fn src(&self) -> &dyn TensorSource {
        &**self.owner
    }
    /// A bf16 tensor of `rank` with shard `shape`, split as `split` (axis, offset) or replicated.
    fn bf16(&self, name: &str, rank: usize, shape: &[usize], split: Option<(usize, usize)>) -> Result<Slab<bf16>> {
        let t = expect(self.src(), name, rank, Dtype::BF16, shape)?;
        match split {
            Some((a, off)) if self.r > 1 => expect_split(&t, name, rank, Some(a), off)?,
            // R = 1: the plan may record the split axis with offset 0 or no split at all.
            Some(_) => ensure!(t.split_offset == 0, "{name}: single rank but split offset {}", t.split_offset),
            None => expect_split(&t, name, rank, None, 0)?,
        }
        // SAFETY: `t` was just returned by `self.owner.tensor(..)` (through `expect`).
        Ok(unsafe { Slab::new(self.owner, t.data) })
    }
    fn mat(&self, name: &str, rank: usize, rows: usize, cols: usize, split: Option<(usize, usize)>) -> Result<Mat> {
        Ok(Mat { w: self.bf16(name, rank, &[rows, cols], split)?, rows, cols })
    }
    /// Replicated vector `[n]` (rank 0's copy; every rank must hold one).
    fn vec_rep(&self, name: &str, n: usize) -> Result<Slab<bf16>> {
        for rank in 1..self.r {
            expect(self.src(), name, rank, Dtype::BF16, &[n])?;
        }
        self.bf16(name, 0, &[n], None)
    }
    /// Per-rank SwiGLU slice, intermediate `i` split by rows (gate/up) and columns (down).
    fn mlp(&self, p: &str, h: usize, i: usize) -> Result<Vec<Mlp>> {
        ensure!(i % self.r == 0, "{p}: intermediate {i} does not divide over {} ranks", self.r);
        let ir = i / self.r;
        (0..self.r)
            .map(|rank| {
                Ok(Mlp {
                    gate: self.mat(&format!("{p}gate_proj.weight"), rank, ir, h, Some((0, rank * ir)))?,
                    up: self.mat(&format!("{p}up_proj.weight"), rank, ir, h, Some((0, rank * ir)))?,
                    down: self.mat(&format!("{p}down_proj.weight"), rank, h, ir, Some((1, rank * ir)))?,
                })
            })
            .collect()
    }
    /// Routed experts `{stem}.{proj}` of logical `[E, n, k]`, per rank; TP or EP read from the manifest.
    fn experts(&self, stem: &str, proj: &str, e: usize, n: usize, k: usize) -> Result<Vec<I4Stack>> {
        let pname = format!("{stem}.{proj}.weight_packed");
        let sname = format!("{stem}.{proj}.weight_scale");
        (0..self.r)
            .map(|rank| {
                let p = self.src().tensor(&pname, rank)?;
                let s = self.src().tensor(&sname, rank)?;
                ensure!(
                    p.dtype == Dtype::U8 && s.dtype == Dtype::BF16,
                    "{pname}: expected U8 + BF16 scales, found {} + {}",
                    p.dtype,
                    s.dtype
                );
                ensure!(p.logical_shape == [e, n, k], "{pname}: logical shape {:?}, expected [{e}, {n}, {k}]", p.logical_shape);
                ensure!(p.shape.len() == 3, "{pname} (rank {rank}): shape {:?} is not 3-D", p.shape);
                let (cnt, nr, kr) = (p.shape[0], p.shape[1], p.shape[2] * 2);
                let (first, want_nr, want_kr) = match p.split_axis {
                    None if self.r == 1 => (0, n, k),
                    Some(0) => (p.split_offset, n, k),
                    Some(1) => (0, n / self.r, k),
                    Some(2) => (0, n, k / self.r),
                    other => bail!("{pname} (rank {rank}): unexpected split axis {other:?}"),
                };
                let want_cnt = if p.split_axis == Some(0) { e / self.r } else { e };
                ensure!(
                    (cnt, nr, kr) == (want_cnt, want_nr, want_kr),
                    "{pname} (rank {rank}): shard [{cnt}, {nr}, {kr}/2], expected [{want_cnt}, {want_nr}, {want_kr}/2]"
                );
                match p.split_axis {
                    Some(0) => ensure!(first == rank * cnt, "{pname} (rank {rank}): starts at expert {first}, expected {}", rank * cnt),
                    Some(1) => expect_split(&p, &pname, rank, Some(1), rank * nr)?,
                    Some(2) => expect_split(&p, &pname, rank, Some(2), rank * kr)?,
                    _ => {}
                }
                ensure!(s.shape == [cnt, nr, kr / 32], "{sname} (rank {rank}): shape {:?}, expected [{cnt}, {nr}, {}]", s.shape, kr / 32);
                // SAFETY: `p` and `s` were just returned by `self.owner.tensor(..)`.
                let (packed, scales) = unsafe { (Slab::new(self.owner, p.data), Slab::new(self.owner, s.data)) };
                Ok(I4Stack {
                    packed,
                    scales,
                    first,
                    count: cnt,
                    n: nr,
                    k: kr,
                })
            })
            .collect()
    }
}

impl Weights {
    /// Load the target from `src` (any rank count of the plan), checking every shard against the plan.
    pub fn load(src: Arc<dyn TensorSource>) -> Result<Weights> {
        let t = src.text_config().clone();
        let r = src.ranks();
        let cfg = ModelConfig::from_text(&t, r)?;
        let (h, v, nh) = (cfg.hidden, cfg.vocab, cfg.heads);
        ensure!(r >= 1 && nh % r == 0, "{nh} heads do not divide over {r} ranks");
        ensure!(v % r == 0, "vocab {v} does not divide over {r} ranks");
        let prefix = ["language_model.", ""]
            .into_iter()
            .find(|p| src.tensor(&format!("{p}model.embed_tokens.weight"), 0).is_ok())
            .ok_or_else(|| anyhow::anyhow!("no embed_tokens.weight (tried prefixes \"language_model.\" and \"\")"))?
            .to_string();
        let ld = Ld { owner: &src, r };
        let m = format!("{prefix}model.");
        let vr = v / r;
        let vocab_mats = |name: &str| -> Result<Vec<Mat>> { (0..r).map(|k| ld.mat(name, k, vr, h, Some((0, k * vr)))).collect() };
        let embed = vocab_mats(&format!("{m}embed_tokens.weight"))?;
        let lm_head = if t.tie_word_embeddings {
            vocab_mats(&format!("{m}embed_tokens.weight"))?
        } else {
            vocab_mats(&format!("{prefix}lm_head.weight"))?
        };
        let norm = ld.vec_rep(&format!("{m}norm.weight"), h)?;
        let (hr, qk) = (nh / r, cfg.qk_head_dim());
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("{m}layers.{l}.");
            let a = format!("{p}self_attn.");
            let q_a = match cfg.q_lora {
                Some(ql) => {
                    Some((ld.mat(&format!("{a}q_a_proj.weight"), 0, ql, h, None)?, ld.vec_rep(&format!("{a}q_a_layernorm.weight"), ql)?))
                }
                None => None,
            };
            let ranks = (0..r)
                .map(|k| {
                    let q = match cfg.q_lora {
                        Some(ql) => ld.mat(&format!("{a}q_b_proj.weight"), k, hr * qk, ql, Some((0, k * hr * qk)))?,
                        None => ld.mat(&format!("{a}q_proj.weight"), k, hr * qk, h, Some((0, k * hr * qk)))?,
                    };
                    let kvw = cfg.nope + cfg.v_dim;
                    Ok(AttnRank {
                        q,
                        kv_b: ld.mat(&format!("{a}kv_b_proj.weight"), k, hr * kvw, cfg.kv_lora, Some((0, k * hr * kvw)))?,
                        o_proj: ld.mat(&format!("{a}o_proj.weight"), k, h, hr * cfg.v_dim, Some((1, k * hr * cfg.v_dim)))?,
                        head0: k * hr,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let attn = Attn {
                q_a,
                kv_a: ld.mat(&format!("{a}kv_a_proj_with_mqa.weight"), 0, cfg.latent_width(), h, None)?,
                kv_a_norm: ld.vec_rep(&format!("{a}kv_a_layernorm.weight"), cfg.kv_lora)?,
                ranks,
            };
            let mlp = format!("{p}mlp.");
            let ffn = if !cfg.moe_layers[l] {
                Ffn::Dense(ld.mlp(&mlp, h, cfg.intermediate)?)
            } else {
                let e = cfg.n_experts;
                let bias = if t.topk_method.as_deref() == Some("noaux_tc") {
                    let name = format!("{mlp}gate.e_score_correction_bias");
                    let tb = expect(&*src, &name, 0, Dtype::F32, &[e])?;
                    // SAFETY: `tb` was just returned by `src.tensor(..)` (through `expect`).
                    Some(unsafe { Slab::new(&src, tb.data) })
                } else {
                    None
                };
                let shared = if cfg.n_shared > 0 {
                    ld.mlp(&format!("{mlp}shared_experts."), h, cfg.moe_intermediate * cfg.n_shared)?
                } else {
                    Vec::new()
                };
                let stem = format!("{mlp}experts");
                let mi = cfg.moe_intermediate;
                Ffn::Moe(Moe {
                    router: ld.mat(&format!("{mlp}gate.weight"), 0, e, h, None)?,
                    bias,
                    shared,
                    gate: ld.experts(&stem, "gate_proj", e, mi, h)?,
                    up: ld.experts(&stem, "up_proj", e, mi, h)?,
                    down: ld.experts(&stem, "down_proj", e, h, mi)?,
                })
            };
            layers.push(Layer {
                input_norm: ld.vec_rep(&format!("{p}input_layernorm.weight"), h)?,
                post_norm: ld.vec_rep(&format!("{p}post_attention_layernorm.weight"), h)?,
                attn,
                ffn,
            });
        }
        Ok(Weights { cfg, embed, norm, lm_head, layers })
    }

    /// `embed_tokens` rows of `tokens`: `[n, H]` f32, each looked up on the rank owning its vocab slice.
    pub fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let shards: Vec<&[bf16]> = self.embed.iter().map(|m| &m.w[..]).collect();
        ops::embedding_bf16(&shards, self.cfg.hidden, tokens)
    }

    /// Final RMSNorm (`model.norm`, eps = rms_norm_eps) of `x` `[n, H]`.
    pub fn final_norm(&self, x: &[f32]) -> Vec<f32> {
        ops::rms_norm(x, &self.norm, self.cfg.eps)
    }

    /// `lm_head(x)` for `x` `[n, H]` f32 (already normed): `[n, V]` f32 logits, the vocab-parallel rank
    /// slices merged in global id order.
    pub fn lm_head(&self, x: &[f32], n: usize) -> Vec<f32> {
        let shards: Vec<&[bf16]> = self.lm_head.iter().map(|m| &m.w[..]).collect();
        ops::lm_head_bf16(x, n, self.cfg.hidden, &shards)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// K2.6 `text_config` values of k26-format §1.2.
    const K26: &str = r#"{"text_config": {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": true, "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 262144, "vocab_size": 163840, "tie_word_embeddings": false, "head_dim": 64}}"#;

    #[test]
    fn k26_constants() {
        let t = kdtree_formats::config::parse_text_config("k26", K26).unwrap();
        let c = ModelConfig::from_text(&t, 8).unwrap();
        // k26-format §4.3: scale = 192^-0.5 · (0.1 ln 64 + 1)² = 0.14467963.
        assert!((c.softmax_scale - 0.144_679_63).abs() < 1e-7, "softmax scale {}", c.softmax_scale);
        assert_eq!(c.rope_attention_factor, 1.0);
        assert_eq!((c.qk_head_dim(), c.latent_width(), c.heads_per_rank()), (192, 576, 8));
        assert_eq!(c.inv_freq.len(), 32, "rope dims from qk_rope_head_dim, never head_dim");
        assert_eq!(c.moe_layers.iter().filter(|&&m| m).count(), 60);
        assert!(!c.moe_layers[0]);
        // Ramp low = 8, high = 20: dim 8 is pure extrapolation, dim 20 pure interpolation (÷64).
        let extra = |i: usize| 50000f64.powf(-2.0 * i as f64 / 64.0);
        assert_eq!(c.inv_freq[8], extra(8) as f32);
        assert_eq!(c.inv_freq[20], (extra(20) / 64.0) as f32);
        assert_eq!(c.latent_eps, 1e-6);
        assert_eq!(c.eps, 1e-5);
    }
}
