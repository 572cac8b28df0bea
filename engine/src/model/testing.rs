//! Tiny K2.6-shaped models with seeded random weights, held in memory, for tests (here and in
//! engine/tests/target_*.rs) and for helpers that need a target without files. Shapes follow k26-format
//! §2.2 scaled down; the config keeps every K2.6 feature (q_lora, YaRN, dense layer 0 then MoE with a
//! shared expert, noaux_tc bias) and adds group-limited routing (n_group 2, topk_group 1) so that path runs.

use super::source::{MemSource, MemTensor, TensorSource};
use super::weights::Weights;
use anyhow::Result;
use half::bf16;
use kdtree_formats::config::{parse_text_config, TextConfig};
use kdtree_formats::plan::{ExpertsMode, Layout};
use kdtree_formats::Dtype;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::Arc;

/// Tensor-name prefix the tiny models use (K2.6's).
pub const PREFIX: &str = "language_model.";

/// config.json of the tiny model: hidden 64, 8 heads (nope 16, rope 8, v 16), q_lora 32, kv_lora 32,
/// 3 layers (layer 0 dense), 8 experts top-2 of moe width 128, vocab 96. `q_lora` None drops q_a.
pub fn tiny_config(q_lora: Option<usize>) -> TextConfig {
    let q = q_lora.map_or("null".to_string(), |v| v.to_string());
    let json = format!(
        r#"{{"text_config": {{
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": {q}, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": true, "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": {{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
        "max_position_embeddings": 256, "vocab_size": 96, "tie_word_embeddings": false, "attention_bias": false}}}}"#
    );
    parse_text_config("tiny_config", &json).expect("tiny config parses")
}

fn bf16_tensor(rng: &mut ChaCha8Rng, shape: &[usize], center: f32, spread: f32) -> MemTensor {
    let n: usize = shape.iter().product();
    let v: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(center + rng.random_range(-spread..spread)))
        .collect();
    MemTensor {
        dtype: Dtype::BF16,
        shape: shape.to_vec(),
        layout: Layout::Plain,
        data: bytemuck::cast_slice(&v).to_vec(),
    }
}

/// Whole tensors (converted names, [`PREFIX`]) of a random model for `t`, seeded.
pub fn random_tensors(t: &TextConfig, seed: u64) -> HashMap<String, MemTensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut m = HashMap::new();
    let (h, v, nh) = (t.hidden_size, t.vocab_size, t.num_attention_heads);
    let qk = t.qk_head_dim();
    let lin =
        |rng: &mut ChaCha8Rng, out: usize, inp: usize| bf16_tensor(rng, &[out, inp], 0.0, 1.7 / (inp as f32).sqrt());
    let norm = |rng: &mut ChaCha8Rng, n: usize| bf16_tensor(rng, &[n], 1.0, 0.2);
    let p = format!("{PREFIX}model.");
    m.insert(
        format!("{p}embed_tokens.weight"),
        bf16_tensor(&mut rng, &[v, h], 0.0, 1.0),
    );
    m.insert(format!("{p}norm.weight"), norm(&mut rng, h));
    m.insert(format!("{PREFIX}lm_head.weight"), lin(&mut rng, v, h));
    for l in 0..t.num_hidden_layers {
        let lp = format!("{p}layers.{l}.");
        m.insert(format!("{lp}input_layernorm.weight"), norm(&mut rng, h));
        m.insert(format!("{lp}post_attention_layernorm.weight"), norm(&mut rng, h));
        let a = format!("{lp}self_attn.");
        match t.q_lora_rank {
            Some(ql) => {
                m.insert(format!("{a}q_a_proj.weight"), lin(&mut rng, ql, h));
                m.insert(format!("{a}q_a_layernorm.weight"), norm(&mut rng, ql));
                m.insert(format!("{a}q_b_proj.weight"), lin(&mut rng, nh * qk, ql));
            }
            None => {
                m.insert(format!("{a}q_proj.weight"), lin(&mut rng, nh * qk, h));
            }
        }
        m.insert(
            format!("{a}kv_a_proj_with_mqa.weight"),
            lin(&mut rng, t.kv_lora_rank + t.qk_rope_head_dim, h),
        );
        m.insert(format!("{a}kv_a_layernorm.weight"), norm(&mut rng, t.kv_lora_rank));
        m.insert(
            format!("{a}kv_b_proj.weight"),
            lin(&mut rng, nh * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank),
        );
        m.insert(format!("{a}o_proj.weight"), lin(&mut rng, h, nh * t.v_head_dim));
        let mlp = format!("{lp}mlp.");
        let swiglu = |rng: &mut ChaCha8Rng, m: &mut HashMap<String, MemTensor>, p: &str, i: usize| {
            m.insert(format!("{p}gate_proj.weight"), lin(rng, i, h));
            m.insert(format!("{p}up_proj.weight"), lin(rng, i, h));
            m.insert(format!("{p}down_proj.weight"), lin(rng, h, i));
        };
        if !t.is_moe_layer(l) {
            swiglu(&mut rng, &mut m, &mlp, t.intermediate_size);
            continue;
        }
        let e = t.n_routed_experts;
        m.insert(format!("{mlp}gate.weight"), lin(&mut rng, e, h));
        let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.05f32..0.05)).collect();
        m.insert(
            format!("{mlp}gate.e_score_correction_bias"),
            MemTensor {
                dtype: Dtype::F32,
                shape: vec![e],
                layout: Layout::Plain,
                data: bytemuck::cast_slice(&bias).to_vec(),
            },
        );
        if t.n_shared_experts > 0 {
            swiglu(
                &mut rng,
                &mut m,
                &format!("{mlp}shared_experts."),
                t.moe_intermediate_size * t.n_shared_experts,
            );
        }
        let mi = t.moe_intermediate_size;
        for (proj, n, k) in [("gate_proj", mi, h), ("up_proj", mi, h), ("down_proj", h, mi)] {
            let packed: Vec<u8> = (0..e * n * k / 2).map(|_| rng.random::<u8>()).collect();
            let sc = 0.45 / (k as f32).sqrt(); // q has std ≈ 4.6, so w has std ≈ 2 / sqrt(k)
            let scales: Vec<bf16> = (0..e * n * k / 32)
                .map(|_| bf16::from_f32(sc * rng.random_range(0.5f32..1.5)))
                .collect();
            let stem = format!("{mlp}experts.{proj}");
            m.insert(
                format!("{stem}.weight_packed"),
                MemTensor {
                    dtype: Dtype::U8,
                    shape: vec![e, n, k],
                    layout: Layout::Int4G32,
                    data: packed,
                },
            );
            m.insert(
                format!("{stem}.weight_scale"),
                MemTensor {
                    dtype: Dtype::BF16,
                    shape: vec![e, n, k / 32],
                    layout: Layout::Int4G32Scale,
                    data: bytemuck::cast_slice(&scales).to_vec(),
                },
            );
        }
    }
    m
}

/// Random tiny weights split over `ranks` ranks (experts `mode`) and loaded.
pub fn tiny_weights(t: &TextConfig, seed: u64, ranks: usize, mode: ExpertsMode) -> Result<Arc<Weights>> {
    let src: Arc<dyn TensorSource> = Arc::new(MemSource::new(
        t.clone(),
        PREFIX,
        &random_tensors(t, seed),
        ranks,
        mode,
    )?);
    Ok(Arc::new(Weights::load(src)?))
}
