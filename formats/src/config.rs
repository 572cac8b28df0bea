//! Model configuration as the engine needs it, parsed from a Hugging Face `config.json`.
//!
//! K2.6 nests the DeepSeek-V3 text tower under `text_config` (with `quantization_config` inside it);
//! a plain DeepseekV3 checkpoint has the same keys at the top level. Both are accepted. Every key we
//! do not type is kept in `extra` so nothing in the source config is lost.
//! Reference: shared k26-format.md §1.2 (fields), §1.3 (YaRN per family), §7 (DFlash drafter).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// YaRN rope scaling (`rope_scaling` in config.json). `beta_fast` differs per family: read, never assume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(rename = "type", alias = "rope_type")]
    pub kind: String,
    pub factor: f64,
    pub original_max_position_embeddings: u64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Defaults to 1 when absent (DeepSeek `rope_scaling.get("mscale", 1)`).
    #[serde(default = "one")]
    pub mscale: f64,
    /// Defaults to 0 when absent (DeepSeek `rope_scaling.get("mscale_all_dim", 0)`): no mscale² on the
    /// softmax scale then. K2.6 sets it to 1.
    #[serde(default)]
    pub mscale_all_dim: f64,
}

fn one() -> f64 {
    1.0
}

/// `text_config` of Kimi K2.6 (DeepSeek-V3 architecture).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    pub hidden_size: usize,
    /// Dense MLP width (layers < first_k_dense_replace).
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    #[serde(default = "one_usize")]
    pub moe_layer_freq: usize,
    #[serde(default = "one_usize")]
    pub n_group: usize,
    #[serde(default = "one_usize")]
    pub topk_group: usize,
    #[serde(default)]
    pub topk_method: Option<String>,
    #[serde(default)]
    pub scoring_func: Option<String>,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    #[serde(default)]
    pub hidden_act: Option<String>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    /// compressed-tensors config, kept verbatim.
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
    /// Every other key of text_config, kept verbatim.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

fn one_usize() -> usize {
    1
}

impl TextConfig {
    /// Query/key head size: nope + rope (192 on K2.6). Never `head_dim` (transformers sets that to rope dim).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Whether layer `l` is a MoE layer (DeepSeek rule).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.n_routed_experts > 0 && l >= self.first_k_dense_replace && l.is_multiple_of(self.moe_layer_freq.max(1))
    }
}

/// `dflash_config` block of a DFlash drafter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DflashConfig {
    pub target_layer_ids: Vec<usize>,
    pub mask_token_id: u32,
    #[serde(default)]
    pub block_size: Option<usize>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// DFlash drafter `config.json` (Qwen3-style, no embedding and no lm_head of its own).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    /// Older checkpoints keep block_size at the top level, newer inside dflash_config.
    #[serde(default)]
    pub block_size: Option<usize>,
    #[serde(default)]
    pub num_target_layers: Option<usize>,
    pub dflash_config: DflashConfig,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl DrafterConfig {
    /// Block size B (bonus + B-1 mask tokens), wherever the checkpoint put it.
    pub fn block_size(&self) -> Option<usize> {
        self.dflash_config.block_size.or(self.block_size)
    }
}

/// Error from reading a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The JSON error is part of the message, not `source()` (see error.rs: printed once).
    #[error("{path}: invalid JSON: {err}")]
    Json { path: String, err: serde_json::Error },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
}

/// Parse the text config from a HF `config.json` body: nested `text_config` (K2.5/K2.6) or flat (DeepseekV3).
/// A top-level `quantization_config` is folded into the text config when the nested one has none.
pub fn parse_text_config(path: &str, body: &str) -> Result<TextConfig, ConfigError> {
    let root: serde_json::Value =
        serde_json::from_str(body).map_err(|err| ConfigError::Json { path: path.into(), err })?;
    let obj = root.as_object().ok_or_else(|| ConfigError::Invalid {
        path: path.into(),
        msg: "top level is not a JSON object".into(),
    })?;
    let mut text = match obj.get("text_config") {
        Some(t) => t.clone(),
        None => root.clone(),
    };
    if let (Some(q), Some(t)) = (obj.get("quantization_config"), text.as_object_mut()) {
        t.entry("quantization_config").or_insert_with(|| q.clone());
    }
    serde_json::from_value(text).map_err(|e| ConfigError::Invalid {
        path: path.into(),
        msg: format!("text_config: {e}"),
    })
}

/// Whether a `config.json` body nests its text config under `text_config` (K2.5/K2.6, whose tensors
/// are named `language_model.*`); false for a flat DeepseekV3 config or a body that is not a JSON object.
pub fn has_text_config(body: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body).is_ok_and(|v| v.get("text_config").is_some())
}

/// Parse a DFlash drafter `config.json` body.
pub fn parse_drafter_config(path: &str, body: &str) -> Result<DrafterConfig, ConfigError> {
    let cfg: DrafterConfig = serde_json::from_str(body).map_err(|err| ConfigError::Json { path: path.into(), err })?;
    if cfg.block_size().is_none() {
        return Err(ConfigError::Invalid {
            path: path.into(),
            msg: "no block_size (neither top-level nor in dflash_config)".into(),
        });
    }
    Ok(cfg)
}
