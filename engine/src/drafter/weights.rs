//! The DFlash drafter's shapes ([`DrafterDims`], validated from its config) and host weights
//! ([`DrafterWeights`], logical bf16 tensors under the checkpoint names `drafter.*`). The drafter has no
//! tensor-parallel split yet, so its own weights are gathered over ranks at load; the target tables it
//! borrows stay per rank. Tests: engine/tests/ddtree_drafter.rs (config errors, load by name).
//!
//! Dimension letters: H hidden, Hq query heads, Hk kv heads, D head_dim, I intermediate.

use anyhow::{ensure, Result};
use half::bf16;
use kdtree_formats::config::DrafterConfig;

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
        let block = cfg
            .block_size()
            .ok_or_else(|| anyhow::anyhow!("drafter config has no block_size"))?;
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
        ensure!(
            d.kv_heads > 0 && d.heads.is_multiple_of(d.kv_heads),
            "drafter: {} heads not a multiple of {} kv heads",
            d.heads,
            d.kv_heads
        );
        ensure!(
            d.head_dim.is_multiple_of(2),
            "drafter: head_dim {} must be even for RoPE",
            d.head_dim
        );
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

/// The drafter one rank of `ranks` computes alone (a rank slice, model/dummy.rs): query heads, kv heads and
/// the MLP's intermediate width divided by R (the plan's head and intermediate splits), the vocabulary the
/// target slice's V/R ids, and the mask token that vocabulary's row `mask_token_id mod V/R` (rank r's table
/// holds other ids than the full model's mask; any row costs the same).
pub fn slice_config(cfg: &DrafterConfig, ranks: usize) -> Result<DrafterConfig> {
    let div = |what: &str, n: usize| -> Result<usize> {
        ensure!(
            ranks > 0 && n.is_multiple_of(ranks),
            "drafter rank slice: {what} {n} does not divide over {ranks} ranks"
        );
        Ok(n / ranks)
    };
    let mut c = cfg.clone();
    c.num_attention_heads = div("num_attention_heads", cfg.num_attention_heads)?;
    c.num_key_value_heads = div("num_key_value_heads", cfg.num_key_value_heads)?;
    c.intermediate_size = div("intermediate_size", cfg.intermediate_size)?;
    c.vocab_size = div("vocab_size", cfg.vocab_size)?;
    c.dflash_config.mask_token_id %= c.vocab_size as u32;
    Ok(c)
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
            ensure!(
                v.len() == want,
                "{name}: got {} values, expected {shape:?} = {want}",
                v.len()
            );
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
        Ok(DrafterWeights {
            fc,
            hidden_norm,
            norm,
            layers,
        })
    }
}
