//! Test helper: a tiny checkpoint in the K2.6 Hugging Face layout (nested text_config with
//! quantization_config, index + `model-000NN-of-0000MM.safetensors` shards, `language_model.*` names,
//! INT4 expert triplets or BF16 experts, F32 e_score_correction_bias, vision/projector tensors) and an
//! optional DFlash drafter dir, written with the reference `safetensors` crate (not our writer).
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype as SD;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Shape knobs of the tiny model.
#[derive(Clone, Debug)]
pub struct Tiny {
    pub hidden: usize,
    pub inter: usize,
    pub moe_inter: usize,
    pub layers: usize,
    pub heads: usize,
    pub experts: usize,
    pub vocab: usize,
    pub int4: bool,
    pub shards: usize,
    pub seed: u64,
}

impl Default for Tiny {
    fn default() -> Self {
        Tiny {
            hidden: 64,
            inter: 128,
            moe_inter: 64,
            layers: 3,
            heads: 4,
            experts: 8,
            vocab: 256,
            int4: true,
            shards: 3,
            seed: 7,
        }
    }
}

pub type Tensors = BTreeMap<String, (SD, Vec<usize>, Vec<u8>)>;

pub fn config(t: &Tiny) -> serde_json::Value {
    let mut text = json!({
        "model_type": "kimi_k2", "hidden_size": t.hidden, "intermediate_size": t.inter,
        "moe_intermediate_size": t.moe_inter, "num_hidden_layers": t.layers, "num_attention_heads": t.heads,
        "num_key_value_heads": t.heads, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": t.experts, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.827,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 4096, "vocab_size": t.vocab, "tie_word_embeddings": false, "attention_bias": false,
        "kv_cache_dtype": null
    });
    if t.int4 {
        text["quantization_config"] = json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": null,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null, "output_activations": null,
                "weights": {"type": "int", "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": true,
                            "dynamic": false, "observer": "minmax", "observer_kwargs": {}, "actorder": null}}},
            "ignore": ["re:.*self_attn.*", "re:vision_tower.*"]
        });
    }
    json!({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
           "vision_config": {"patch_size": 14}})
}

fn rand_bytes(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}

/// Random BF16 values in about [-1, 1] (finite, no NaN).
fn rand_bf16(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|_| half::bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes())
        .collect()
}

pub fn tensors(t: &Tiny) -> Tensors {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(t.seed);
    let mut m = Tensors::new();
    let h = t.hidden;
    let bf = |m: &mut Tensors, rng: &mut rand_chacha::ChaCha8Rng, name: String, shape: Vec<usize>| {
        let n = shape.iter().product();
        m.insert(name, (SD::BF16, shape, rand_bf16(rng, n)));
    };
    let p = "language_model.model.";
    bf(&mut m, &mut rng, format!("{p}embed_tokens.weight"), vec![t.vocab, h]);
    bf(&mut m, &mut rng, format!("{p}norm.weight"), vec![h]);
    bf(
        &mut m,
        &mut rng,
        "language_model.lm_head.weight".into(),
        vec![t.vocab, h],
    );
    for l in 0..t.layers {
        let q = format!("{p}layers.{l}.");
        for (n, s) in [
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("self_attn.q_a_proj.weight", vec![32, h]),
            ("self_attn.q_a_layernorm.weight", vec![32]),
            ("self_attn.q_b_proj.weight", vec![t.heads * 24, 32]),
            ("self_attn.kv_a_proj_with_mqa.weight", vec![40, h]),
            ("self_attn.kv_a_layernorm.weight", vec![32]),
            ("self_attn.kv_b_proj.weight", vec![t.heads * 32, 32]),
            ("self_attn.o_proj.weight", vec![h, t.heads * 16]),
        ] {
            bf(&mut m, &mut rng, format!("{q}{n}"), s);
        }
        if l == 0 {
            bf(&mut m, &mut rng, format!("{q}mlp.gate_proj.weight"), vec![t.inter, h]);
            bf(&mut m, &mut rng, format!("{q}mlp.up_proj.weight"), vec![t.inter, h]);
            bf(&mut m, &mut rng, format!("{q}mlp.down_proj.weight"), vec![h, t.inter]);
            continue;
        }
        bf(&mut m, &mut rng, format!("{q}mlp.gate.weight"), vec![t.experts, h]);
        let bias: Vec<u8> = (0..t.experts).flat_map(|i| (i as f32 * 0.25).to_le_bytes()).collect();
        m.insert(
            format!("{q}mlp.gate.e_score_correction_bias"),
            (SD::F32, vec![t.experts], bias),
        );
        bf(
            &mut m,
            &mut rng,
            format!("{q}mlp.shared_experts.gate_proj.weight"),
            vec![t.moe_inter, h],
        );
        bf(
            &mut m,
            &mut rng,
            format!("{q}mlp.shared_experts.up_proj.weight"),
            vec![t.moe_inter, h],
        );
        bf(
            &mut m,
            &mut rng,
            format!("{q}mlp.shared_experts.down_proj.weight"),
            vec![h, t.moe_inter],
        );
        for e in 0..t.experts {
            for (proj, n, k) in [
                ("gate_proj", t.moe_inter, h),
                ("up_proj", t.moe_inter, h),
                ("down_proj", h, t.moe_inter),
            ] {
                let b = format!("{q}mlp.experts.{e}.{proj}");
                if t.int4 {
                    m.insert(
                        format!("{b}.weight_packed"),
                        (SD::I32, vec![n, k / 8], rand_bytes(&mut rng, n * k / 2)),
                    );
                    let sc: Vec<u8> = (0..n * k / 32)
                        .flat_map(|_| half::bf16::from_f32(rng.random_range(0.001f32..0.1)).to_le_bytes())
                        .collect();
                    m.insert(format!("{b}.weight_scale"), (SD::BF16, vec![n, k / 32], sc));
                    let shape: Vec<u8> = [n as i32, k as i32].iter().flat_map(|v| v.to_le_bytes()).collect();
                    m.insert(format!("{b}.weight_shape"), (SD::I32, vec![2], shape));
                } else {
                    bf(&mut m, &mut rng, format!("{b}.weight"), vec![n, k]);
                }
            }
        }
    }
    bf(
        &mut m,
        &mut rng,
        "vision_tower.patch_embed.proj.weight".into(),
        vec![8, 3, 2, 2],
    );
    bf(&mut m, &mut rng, "mm_projector.proj.0.weight".into(), vec![8, 8]);
    m
}

/// Write `tensors` to one safetensors file with the reference crate.
pub fn write_safetensors(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = [("format".to_string(), "pt".to_string())].into_iter().collect();
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

/// Write config.json + index + shards (names spread round-robin by layer) into `dir`.
pub fn write_checkpoint_with(dir: &Path, t: &Tiny, cfg: &serde_json::Value, all: &Tensors) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(cfg).unwrap()).unwrap();
    let shard_of = |name: &str| -> usize {
        let l = name
            .split("layers.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|x| x.parse::<usize>().ok());
        l.map_or(t.shards - 1, |l| l % t.shards)
    };
    let mut weight_map = serde_json::Map::new();
    for s in 0..t.shards {
        let fname = format!("model-{:05}-of-{:06}.safetensors", s + 1, t.shards);
        let part: Tensors = all
            .iter()
            .filter(|(n, _)| shard_of(n) == s)
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        for n in part.keys() {
            weight_map.insert(n.clone(), json!(fname));
        }
        write_safetensors(&dir.join(&fname), &part);
    }
    let total: usize = all.values().map(|v| v.2.len()).sum();
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

pub fn write_checkpoint(dir: &Path, t: &Tiny) {
    write_checkpoint_with(dir, t, &config(t), &tensors(t));
}

/// A 2-layer DFlash drafter for a target of hidden size `h` (heads 4, kv heads 2, head_dim 16).
pub fn write_drafter(dir: &Path, h: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = json!({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 2,
        "hidden_size": h, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 4096, "vocab_size": 256,
        "num_target_layers": 3, "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 250, "block_size": 4}});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let mut m = Tensors::new();
    let mut add = |n: String, s: Vec<usize>| {
        let k = s.iter().product();
        m.insert(n, (SD::BF16, s, rand_bf16(&mut rng, k)));
    };
    add("fc.weight".into(), vec![h, 2 * h]);
    add("hidden_norm.weight".into(), vec![h]);
    add("norm.weight".into(), vec![h]);
    for l in 0..2 {
        let p = format!("layers.{l}.");
        for (n, s) in [
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![64, h]),
            ("self_attn.k_proj.weight", vec![32, h]),
            ("self_attn.v_proj.weight", vec![32, h]),
            ("self_attn.o_proj.weight", vec![h, 64]),
            ("self_attn.q_norm.weight", vec![16]),
            ("self_attn.k_norm.weight", vec![16]),
            ("mlp.gate_proj.weight", vec![128, h]),
            ("mlp.up_proj.weight", vec![128, h]),
            ("mlp.down_proj.weight", vec![h, 128]),
        ] {
            add(format!("{p}{n}"), s);
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &m);
}

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kdtree-convert"))
}

/// Run the binary; return (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let o = bin().args(args).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Every file under `dir` (relative path → bytes), for byte-for-byte comparison.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut m = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                m.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    m
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}
