//! [`ModelConfig`]: everything the target forward needs from the text config, derived once (shapes, MoE
//! router constants, YaRN inverse frequencies and softmax scale).
//!
//! Must match: k26-format.md §1.2 (K2.6 values), §4.3 (softmax scale), §4.4 (YaRN). Test below (K2.6
//! constants).

use crate::cpu::ops;
use anyhow::{ensure, Result};
use kdtree_formats::config::TextConfig;

/// eps of `q_a_layernorm` and `kv_a_layernorm`. transformers' `DeepseekV3Attention` (and DeepSeek's HF
/// remote code) build these norms without passing eps, so they use the class default 1e-6; vLLM passes
/// `rms_norm_eps` (1e-5 on K2.6). We follow transformers, because the crosscheck runs transformers'
/// `DeepseekV3ForCausalLM` (k26-format §4.2). The difference is numerically negligible.
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// Everything the forward needs from the text config, derived once.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub hidden: usize,
    /// Vocabulary V (V/R for a rank slice: see `slice_rank`).
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
    /// Rank count R of the plan the weights were loaded under.
    pub ranks: usize,
    /// Some(r) when only rank r of the R ranks was loaded (a rank slice, `Weights::load_on`); `vocab` is
    /// then that rank's V/R ids.
    pub slice_rank: Option<usize>,
}

impl ModelConfig {
    pub fn from_text(t: &TextConfig, ranks: usize) -> Result<ModelConfig> {
        if let Some(f) = t.scoring_func.as_deref() {
            ensure!(
                f == "sigmoid",
                "scoring_func {f:?} is not supported (only sigmoid, as DeepSeek-V3/K2)"
            );
        }
        if let Some(a) = t.hidden_act.as_deref() {
            ensure!(a == "silu", "hidden_act {a:?} is not supported (only silu)");
        }
        ensure!(
            t.n_group >= 1 && t.n_routed_experts.is_multiple_of(t.n_group),
            "n_group {} does not divide {} experts",
            t.n_group,
            t.n_routed_experts
        );
        ensure!(
            t.topk_group <= t.n_group,
            "topk_group {} > n_group {}",
            t.topk_group,
            t.n_group
        );
        ensure!(
            t.num_experts_per_tok <= t.n_routed_experts,
            "num_experts_per_tok {} > n_routed_experts {}",
            t.num_experts_per_tok,
            t.n_routed_experts
        );
        ensure!(
            t.qk_rope_head_dim.is_multiple_of(2),
            "qk_rope_head_dim {} must be even",
            t.qk_rope_head_dim
        );
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
            slice_rank: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// K2.6 `text_config` values of k26-format §1.2.
    const K26: &str = concat!(
        r#"{"text_config": {"hidden_size": 7168, "intermediate_size": 18432, "#,
        r#""moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": true, "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0, "#,
        r#""original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 262144, "vocab_size": 163840, "tie_word_embeddings": false, "head_dim": 64}}"#
    );

    #[test]
    fn k26_constants() {
        let t = kdtree_formats::config::parse_text_config("k26", K26).unwrap();
        let c = ModelConfig::from_text(&t, 8).unwrap();
        // k26-format §4.3: scale = 192^-0.5 · (0.1 ln 64 + 1)² = 0.14467963.
        assert!(
            (c.softmax_scale - 0.144_679_63).abs() < 1e-7,
            "softmax scale {}",
            c.softmax_scale
        );
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
