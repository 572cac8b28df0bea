//! Model presets for `kdtree-convert synth`: the TOML files of manifests/presets/ (embedded with include_str!
//! so the binary works anywhere), or a path to another TOML file of the same shape.
//!
//! Every preset must pass the default 8-rank plan in `--experts tp` and `ep` (checked by [`Preset::validate`]
//! and, through formats::plan, by the tests at the bottom). Drafter tap ids follow z-lab's
//! `build_target_layer_ids` (shared ddtree.md §1.2), with an evenly spread fallback for very shallow targets.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// The presets shipped in the binary: (name, TOML text).
pub const BUILTIN: [(&str, &str); 4] = [
    ("tiny", include_str!("../../../../manifests/presets/tiny.toml")),
    ("small", include_str!("../../../../manifests/presets/small.toml")),
    (
        "k26-slice",
        include_str!("../../../../manifests/presets/k26-slice.toml"),
    ),
    ("k26", include_str!("../../../../manifests/presets/k26.toml")),
];

/// Ranks the presets are checked against (the default plan).
pub const CHECK_RANKS: usize = 8;
/// Reserved special ids after the mergeable ranks (Kimi: 256).
pub const NUM_SPECIALS: usize = 256;

/// Text tower widths, named as K2.6's `text_config` keys (configs.rs writes them under these names). Fields not
/// here take K2.6 values (see configs.rs).
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TextPreset {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    pub max_position_embeddings: usize,
}

/// Tokenizer: `mergeable` BPE ranks, then 256 specials (vocab = mergeable + 256).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerPreset {
    pub mergeable: usize,
}

/// MoonViT-style vision tower and patch-merger projector (names of k26-format §2.3).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionPreset {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub blocks: usize,
    /// init_pos_emb height, width.
    pub pos_emb: [usize; 2],
}

/// DFlash drafter (Qwen3-style GQA with q/k norms).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterPreset {
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    /// Number of target taps (default: num_hidden_layers, as z-lab's Kimi drafters).
    #[serde(default)]
    pub num_taps: Option<usize>,
    #[serde(default = "block8")]
    pub block_size: usize,
}

fn block8() -> usize {
    8
}

/// dtype of the expert `weight_shape` tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ShapeDtype {
    I32,
    I64,
    /// I32 for even experts, I64 for odd ones.
    #[serde(rename = "mixed")]
    Mixed,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SynthPreset {
    pub weight_shape_dtype: ShapeDtype,
}

/// One preset file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    pub name: String,
    pub text: TextPreset,
    pub tokenizer: TokenizerPreset,
    pub vision: VisionPreset,
    pub drafter: DrafterPreset,
    pub synth: SynthPreset,
}

impl Preset {
    /// A built-in preset by name, or else a TOML file at that path.
    pub fn load(name_or_path: &str) -> Result<Preset> {
        let p = match BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            Some((n, text)) => Self::parse(text).with_context(|| format!("built-in preset {n}"))?,
            None => {
                let path = Path::new(name_or_path);
                if !path.exists() {
                    let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
                    bail!("unknown preset {name_or_path:?}: not one of {names:?} and no such file");
                }
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                Self::parse(&text).with_context(|| format!("preset {}", path.display()))?
            }
        };
        p.validate()?;
        Ok(p)
    }

    pub fn parse(text: &str) -> Result<Preset> {
        Ok(toml::from_str(text)?)
    }

    /// Same preset with `layers` target layers (at least first_k_dense_replace + 1 so one MoE layer exists).
    pub fn with_layers(mut self, layers: usize) -> Result<Preset> {
        if layers <= self.text.first_k_dense_replace {
            bail!(
                "--layers {layers}: need more than first_k_dense_replace = {}",
                self.text.first_k_dense_replace
            );
        }
        self.text.num_hidden_layers = layers;
        self.validate()?;
        Ok(self)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.mergeable + NUM_SPECIALS
    }

    /// Drafter tap layer ids for this target depth.
    pub fn target_layer_ids(&self) -> Vec<usize> {
        let n = self.drafter.num_taps.unwrap_or(self.drafter.num_hidden_layers);
        build_target_layer_ids(self.text.num_hidden_layers, n)
    }

    /// The divisibility rules of the 8-rank plan (tp and ep) and basic shape sanity.
    pub fn validate(&self) -> Result<()> {
        let t = &self.text;
        let d = &self.drafter;
        let r = CHECK_RANKS;
        let mut bad = Vec::new();
        let mut need = |ok: bool, what: String| {
            if !ok {
                bad.push(what)
            }
        };
        need(
            t.num_attention_heads.is_multiple_of(r),
            format!("heads {} % {r}", t.num_attention_heads),
        );
        need(
            self.vocab_size().is_multiple_of(r),
            format!("vocab {} % {r}", self.vocab_size()),
        );
        need(
            t.intermediate_size.is_multiple_of(r),
            format!("intermediate {} % {r}", t.intermediate_size),
        );
        need(
            t.moe_intermediate_size.is_multiple_of(r) && (t.moe_intermediate_size / r).is_multiple_of(32),
            format!("(moe_intermediate {} / {r}) % 32", t.moe_intermediate_size),
        );
        need(
            t.n_routed_experts.is_multiple_of(r),
            format!("experts {} % {r}", t.n_routed_experts),
        );
        need(
            t.hidden_size.is_multiple_of(32),
            format!("hidden {} % 32", t.hidden_size),
        );
        need(
            t.qk_rope_head_dim.is_multiple_of(2),
            format!("rope dim {} even", t.qk_rope_head_dim),
        );
        need(
            t.num_experts_per_tok >= 1 && t.num_experts_per_tok <= t.n_routed_experts,
            "1 <= top-k <= experts".into(),
        );
        need(
            t.num_hidden_layers > t.first_k_dense_replace,
            "at least one MoE layer".into(),
        );
        need(t.n_shared_experts == 1, "n_shared_experts must be 1 (K2.6)".into());
        need(
            d.num_attention_heads.is_multiple_of(r) && d.num_key_value_heads.is_multiple_of(r),
            format!(
                "drafter heads {}/{} % {r}",
                d.num_attention_heads, d.num_key_value_heads
            ),
        );
        need(
            d.num_attention_heads.is_multiple_of(d.num_key_value_heads.max(1)),
            "drafter heads % kv heads".into(),
        );
        need(
            d.intermediate_size.is_multiple_of(r),
            format!("drafter intermediate {} % {r}", d.intermediate_size),
        );
        need(
            d.head_dim.is_multiple_of(2) && d.num_hidden_layers >= 1 && d.block_size >= 2,
            "drafter head_dim even, >= 1 layer, block >= 2".into(),
        );
        need(
            self.tokenizer.mergeable >= 256,
            "mergeable >= 256 (all single bytes)".into(),
        );
        need(
            self.vision.hidden.is_multiple_of(self.vision.heads.max(1)),
            "vision hidden % heads".into(),
        );
        if !bad.is_empty() {
            bail!("preset {} fails the {r}-rank plan rules: {}", self.name, bad.join(", "));
        }
        Ok(())
    }
}

/// z-lab `build_target_layer_ids`: `n` ids spread over [1, layers-3] with Python rounding (half to even);
/// 1 tap -> the middle layer. For targets too shallow for that rule (layers < n + 3): evenly over
/// [0, layers-1], duplicates removed.
pub fn build_target_layer_ids(layers: usize, n: usize) -> Vec<usize> {
    if n == 1 {
        return vec![layers / 2];
    }
    if layers >= n + 3 {
        let (start, end) = (1.0f64, (layers - 3) as f64);
        let span = end - start;
        return (0..n)
            .map(|i| (start + i as f64 * span / (n - 1) as f64).round_ties_even() as usize)
            .collect();
    }
    let mut ids: Vec<usize> = (0..n)
        .map(|i| (i as f64 * (layers - 1) as f64 / (n - 1) as f64).round_ties_even() as usize)
        .collect();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_builtin_presets_parse_and_validate() {
        for (name, _) in BUILTIN {
            let p = Preset::load(name).unwrap();
            assert_eq!(p.name, name);
        }
    }

    #[test]
    fn target_layer_ids_match_zlab_rule() {
        assert_eq!(build_target_layer_ids(61, 6), vec![1, 12, 24, 35, 47, 58]);
        assert_eq!(build_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(build_target_layer_ids(10, 1), vec![5]);
        assert_eq!(build_target_layer_ids(4, 3), vec![0, 2, 3]);
        assert_eq!(build_target_layer_ids(4, 6), vec![0, 1, 2, 3]);
        assert_eq!(
            Preset::load("k26").unwrap().target_layer_ids(),
            vec![1, 12, 24, 35, 47, 58]
        );
    }

    #[test]
    fn bad_presets_are_refused() {
        let tiny = BUILTIN[0].1;
        let p = Preset::parse(&tiny.replace("num_attention_heads = 8", "num_attention_heads = 12")).unwrap();
        assert!(p.validate().unwrap_err().to_string().contains("heads 12"));
        let p = Preset::parse(&tiny.replace("moe_intermediate_size = 256", "moe_intermediate_size = 128")).unwrap();
        assert!(p.validate().unwrap_err().to_string().contains("moe_intermediate"));
        assert!(Preset::parse(&format!("{tiny}\nbogus = 1\n")).is_err());
        assert!(Preset::load("tiny").unwrap().with_layers(1).is_err());
        assert!(Preset::load("no-such-preset").is_err());
    }
}
