//! The one config validator (issue 16 item 9): every size in a target or drafter config is bounded, and
//! the cross-field rules the engine relies on hold (n_group divides n_routed_experts, topk_group <=
//! n_group, num_experts_per_tok <= n_routed_experts, drafter hidden / vocab = target's, mask_token_id <
//! vocab, target_layer_ids < num_hidden_layers, ...). kdtree-convert calls it before planning (so a
//! config the runner would refuse is refused before a byte is written, and no size allocates without
//! bound), `ModelDir::open` calls it on the manifest's configs, and kdtree-golden / kdtree-run can call
//! `check_model` on what they load. Bounds are generous (K2.6 values in brackets) but finite.
//! Tests: bottom of this file, tools/kdtree-convert/tests/bad_config.rs.

use crate::config::{ConfigError, DrafterConfig, RopeScaling, TextConfig};

/// Upper bounds on config sizes. Each is far above any published DeepSeek-V3 / K2.x / Qwen3 value.
pub mod limits {
    /// hidden_size [7168]
    pub const HIDDEN: usize = 1 << 16;
    /// intermediate_size, moe_intermediate_size [18432, 2048]
    pub const INTERMEDIATE: usize = 1 << 20;
    /// num_hidden_layers [61]
    pub const LAYERS: usize = 1024;
    /// num_attention_heads, num_key_value_heads [64]
    pub const HEADS: usize = 1024;
    /// q_lora_rank, kv_lora_rank [1536, 512]
    pub const LORA_RANK: usize = 1 << 16;
    /// qk_nope_head_dim, qk_rope_head_dim, v_head_dim, drafter head_dim [128, 64, 128]
    pub const HEAD_DIM: usize = 4096;
    /// n_routed_experts [384]
    pub const EXPERTS: usize = 4096;
    /// n_shared_experts [1]
    pub const SHARED_EXPERTS: usize = 64;
    /// num_hidden_layers × n_routed_experts [23,424]: bounds the plan (9 source tensors per pair).
    pub const LAYER_EXPERTS: usize = 1 << 18;
    /// vocab_size [163,840]
    pub const VOCAB: usize = 1 << 22;
    /// max_position_embeddings [262,144]
    pub const POSITIONS: usize = 1 << 24;
    /// drafter num_hidden_layers [5 on z-lab DFlash], len(target_layer_ids)
    pub const DRAFTER_LAYERS: usize = 256;
    /// drafter block_size [8 or 16]
    pub const BLOCK: usize = 1024;
}

struct Check<'a> {
    path: &'a str,
}

impl Check<'_> {
    fn fail(&self, msg: String) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_string(),
            msg,
        }
    }
    /// `lo <= v <= hi`, naming the key.
    fn range(&self, key: &str, v: usize, lo: usize, hi: usize) -> Result<(), ConfigError> {
        if v < lo || v > hi {
            return Err(self.fail(format!("{key} = {v} is out of range (must be {lo}..={hi})")));
        }
        Ok(())
    }
    /// Finite and, when `positive`, > 0.
    fn real(&self, key: &str, v: f64, positive: bool) -> Result<(), ConfigError> {
        if !v.is_finite() || (positive && v <= 0.0) {
            return Err(self.fail(format!(
                "{key} = {v} must be a finite{} number",
                if positive { " positive" } else { "" }
            )));
        }
        Ok(())
    }
    fn rule(&self, ok: bool, msg: impl FnOnce() -> String) -> Result<(), ConfigError> {
        if ok {
            Ok(())
        } else {
            Err(self.fail(msg()))
        }
    }
    fn rope(&self, prefix: &str, r: &RopeScaling) -> Result<(), ConfigError> {
        self.real(&format!("{prefix}rope_scaling.factor"), r.factor, true)?;
        self.range(
            &format!("{prefix}rope_scaling.original_max_position_embeddings"),
            r.original_max_position_embeddings.min(usize::MAX as u64) as usize,
            1,
            limits::POSITIONS,
        )?;
        self.real(&format!("{prefix}rope_scaling.beta_fast"), r.beta_fast, false)?;
        self.real(&format!("{prefix}rope_scaling.beta_slow"), r.beta_slow, false)?;
        self.real(&format!("{prefix}rope_scaling.mscale"), r.mscale, false)?;
        self.real(&format!("{prefix}rope_scaling.mscale_all_dim"), r.mscale_all_dim, false)
    }
}

/// Check a target text config; `path` names the file (and section) in the error.
pub fn check_text(path: &str, t: &TextConfig) -> Result<(), ConfigError> {
    use limits::*;
    let c = Check { path };
    c.range("hidden_size", t.hidden_size, 1, HIDDEN)?;
    c.range("intermediate_size", t.intermediate_size, 1, INTERMEDIATE)?;
    c.range("moe_intermediate_size", t.moe_intermediate_size, 1, INTERMEDIATE)?;
    c.range("num_hidden_layers", t.num_hidden_layers, 1, LAYERS)?;
    c.range("num_attention_heads", t.num_attention_heads, 1, HEADS)?;
    if let Some(kv) = t.num_key_value_heads {
        c.range("num_key_value_heads", kv, 1, HEADS)?;
    }
    if let Some(q) = t.q_lora_rank {
        c.range("q_lora_rank", q, 1, LORA_RANK)?;
    }
    c.range("kv_lora_rank", t.kv_lora_rank, 1, LORA_RANK)?;
    c.range("qk_nope_head_dim", t.qk_nope_head_dim, 1, HEAD_DIM)?;
    c.range("qk_rope_head_dim", t.qk_rope_head_dim, 2, HEAD_DIM)?;
    c.rule(t.qk_rope_head_dim.is_multiple_of(2), || {
        format!(
            "qk_rope_head_dim = {} must be even (RoPE rotates pairs)",
            t.qk_rope_head_dim
        )
    })?;
    c.range("v_head_dim", t.v_head_dim, 1, HEAD_DIM)?;
    c.range("n_routed_experts", t.n_routed_experts, 0, EXPERTS)?;
    c.range("n_shared_experts", t.n_shared_experts, 0, SHARED_EXPERTS)?;
    c.range("first_k_dense_replace", t.first_k_dense_replace, 0, t.num_hidden_layers)?;
    c.range("moe_layer_freq", t.moe_layer_freq, 1, t.num_hidden_layers)?;
    if t.n_routed_experts > 0 {
        let e = t.n_routed_experts;
        c.range("num_experts_per_tok", t.num_experts_per_tok, 1, e)?;
        c.range("n_group", t.n_group, 1, e)?;
        c.rule(e.is_multiple_of(t.n_group), || {
            format!("n_group = {} does not divide n_routed_experts = {e}", t.n_group)
        })?;
        c.range("topk_group", t.topk_group, 1, t.n_group)?;
        let pairs = t.num_hidden_layers.saturating_mul(e);
        c.rule(pairs <= LAYER_EXPERTS, || {
            format!("num_hidden_layers × n_routed_experts = {pairs} exceeds {LAYER_EXPERTS}")
        })?;
        c.real("routed_scaling_factor", t.routed_scaling_factor, true)?;
    }
    c.range("vocab_size", t.vocab_size, 1, VOCAB)?;
    c.range("max_position_embeddings", t.max_position_embeddings, 1, POSITIONS)?;
    c.real("rms_norm_eps", t.rms_norm_eps, true)?;
    c.real("rope_theta", t.rope_theta, true)?;
    if let Some(r) = &t.rope_scaling {
        c.rope("", r)?;
    }
    for (key, id) in [
        ("bos_token_id", t.bos_token_id),
        ("eos_token_id", t.eos_token_id),
        ("pad_token_id", t.pad_token_id),
    ] {
        if let Some(id) = id {
            c.rule((id as usize) < t.vocab_size, || {
                format!("{key} = {id} is not below vocab_size = {}", t.vocab_size)
            })?;
        }
    }
    Ok(())
}

/// Check a DFlash drafter config against its target.
pub fn check_drafter(path: &str, d: &DrafterConfig, target: &TextConfig) -> Result<(), ConfigError> {
    use limits::*;
    let c = Check { path };
    c.rule(d.hidden_size == target.hidden_size, || {
        format!(
            "hidden_size = {} differs from the target's {} (fc maps target hidden states)",
            d.hidden_size, target.hidden_size
        )
    })?;
    c.rule(d.vocab_size == target.vocab_size, || {
        format!(
            "vocab_size = {} differs from the target's {} (the drafter uses the target's embedding and lm_head)",
            d.vocab_size, target.vocab_size
        )
    })?;
    c.range("num_hidden_layers", d.num_hidden_layers, 1, DRAFTER_LAYERS)?;
    c.range("num_attention_heads", d.num_attention_heads, 1, HEADS)?;
    c.range("num_key_value_heads", d.num_key_value_heads, 1, d.num_attention_heads)?;
    c.rule(d.num_attention_heads.is_multiple_of(d.num_key_value_heads), || {
        format!(
            "num_attention_heads = {} is not a multiple of num_key_value_heads = {}",
            d.num_attention_heads, d.num_key_value_heads
        )
    })?;
    c.range("head_dim", d.head_dim, 2, HEAD_DIM)?;
    c.rule(d.head_dim.is_multiple_of(2), || {
        format!("head_dim = {} must be even (RoPE rotates pairs)", d.head_dim)
    })?;
    c.range("intermediate_size", d.intermediate_size, 1, INTERMEDIATE)?;
    c.range("max_position_embeddings", d.max_position_embeddings, 1, POSITIONS)?;
    c.real("rms_norm_eps", d.rms_norm_eps, true)?;
    c.real("rope_theta", d.rope_theta, true)?;
    if let Some(r) = &d.rope_scaling {
        c.rope("", r)?;
    }
    let block = d.block_size().unwrap_or(0);
    c.range("block_size", block, 2, BLOCK)?;
    let m = d.dflash_config.mask_token_id;
    c.rule((m as usize) < d.vocab_size, || {
        format!(
            "dflash_config.mask_token_id = {m} is not below vocab_size = {}",
            d.vocab_size
        )
    })?;
    let ids = &d.dflash_config.target_layer_ids;
    c.range("len(dflash_config.target_layer_ids)", ids.len(), 1, DRAFTER_LAYERS)?;
    if let Some(&l) = ids.iter().find(|&&l| l >= target.num_hidden_layers) {
        return Err(c.fail(format!(
            "dflash_config.target_layer_ids holds {l}, but the target has num_hidden_layers = {}",
            target.num_hidden_layers
        )));
    }
    Ok(())
}

/// Check a target config and, when given, its drafter (`drafter_path` names the drafter's file).
pub fn check_model(path: &str, text: &TextConfig, drafter: Option<(&str, &DrafterConfig)>) -> Result<(), ConfigError> {
    check_text(path, text)?;
    if let Some((dp, d)) = drafter {
        check_drafter(dp, d, text)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse_drafter_config, parse_text_config};

    const K26: &str = include_str!("../tests/data/k26_config.json");

    fn k26() -> serde_json::Value {
        serde_json::from_str(K26).unwrap()
    }
    fn drafter() -> serde_json::Value {
        serde_json::json!({"hidden_size": 7168, "num_hidden_layers": 5, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 262144, "vocab_size": 163840,
            "dflash_config": {"target_layer_ids": [1, 15, 30, 45, 59], "mask_token_id": 163838, "block_size": 8}})
    }
    fn check(text: &serde_json::Value, d: &serde_json::Value) -> Result<(), ConfigError> {
        let t = parse_text_config("config.json", &text.to_string()).unwrap();
        let d = parse_drafter_config("drafter/config.json", &d.to_string()).unwrap();
        check_model("config.json", &t, Some(("drafter/config.json", &d)))
    }

    #[test]
    fn k26_and_its_drafter_pass() {
        check(&k26(), &drafter()).unwrap();
    }

    #[test]
    fn each_bad_value_is_refused_naming_its_key() {
        let big = 1usize << 31;
        let text_cases: Vec<(&str, serde_json::Value, &str)> = vec![
            (
                "num_hidden_layers",
                big.into(),
                "num_hidden_layers = 2147483648 is out of range",
            ),
            ("n_routed_experts", big.into(), "n_routed_experts = 2147483648"),
            ("hidden_size", 0.into(), "hidden_size = 0"),
            ("vocab_size", big.into(), "vocab_size"),
            ("num_attention_heads", big.into(), "num_attention_heads"),
            ("q_lora_rank", big.into(), "q_lora_rank"),
            ("kv_lora_rank", 0.into(), "kv_lora_rank"),
            ("moe_intermediate_size", big.into(), "moe_intermediate_size"),
            (
                "n_group",
                5.into(),
                "n_group = 5 does not divide n_routed_experts = 384",
            ),
            ("topk_group", 2.into(), "topk_group = 2 is out of range (must be 1..=1)"),
            ("num_experts_per_tok", 385.into(), "num_experts_per_tok = 385"),
            ("first_k_dense_replace", 62.into(), "first_k_dense_replace"),
            ("qk_rope_head_dim", 63.into(), "must be even"),
            (
                "eos_token_id",
                163840.into(),
                "eos_token_id = 163840 is not below vocab_size",
            ),
            ("max_position_embeddings", big.into(), "max_position_embeddings"),
        ];
        for (key, v, want) in text_cases {
            let mut c = k26();
            c["text_config"][key] = v;
            let e = check(&c, &drafter()).unwrap_err().to_string();
            assert!(e.starts_with("config.json: ") && e.contains(want), "{key}: {e}");
        }
        let mut c = k26();
        c["text_config"]["num_hidden_layers"] = 1024.into();
        c["text_config"]["n_routed_experts"] = 4096.into();
        assert!(check(&c, &drafter())
            .unwrap_err()
            .to_string()
            .contains("num_hidden_layers × n_routed_experts"));
        let drafter_cases: Vec<(&str, serde_json::Value, &str)> = vec![
            (
                "vocab_size",
                163841.into(),
                "vocab_size = 163841 differs from the target's 163840",
            ),
            ("hidden_size", 4096.into(), "hidden_size = 4096 differs"),
            (
                "num_key_value_heads",
                7.into(),
                "not a multiple of num_key_value_heads = 7",
            ),
            ("num_hidden_layers", big.into(), "num_hidden_layers"),
            ("head_dim", 127.into(), "must be even"),
        ];
        for (key, v, want) in drafter_cases {
            let mut d = drafter();
            d[key] = v;
            let e = check(&k26(), &d).unwrap_err().to_string();
            assert!(e.starts_with("drafter/config.json: ") && e.contains(want), "{key}: {e}");
        }
        for (key, v, want) in [
            (
                "mask_token_id",
                serde_json::json!(163840),
                "mask_token_id = 163840 is not below vocab_size",
            ),
            (
                "target_layer_ids",
                serde_json::json!([1, 61]),
                "target_layer_ids holds 61",
            ),
            (
                "target_layer_ids",
                serde_json::json!([]),
                "len(dflash_config.target_layer_ids) = 0",
            ),
            ("block_size", serde_json::json!(1), "block_size = 1"),
        ] {
            let mut d = drafter();
            d["dflash_config"][key] = v;
            let e = check(&k26(), &d).unwrap_err().to_string();
            assert!(e.contains(want), "{key}: {e}");
        }
    }
}
