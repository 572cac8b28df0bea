//! config.json bodies of a synthetic checkpoint, shaped exactly like Kimi K2.6's (shared k26-format.md §1):
//! top-level KimiK25 keys, `text_config` (model_type kimi_k2, every DeepSeek-V3 field) with the compressed-tensors
//! `quantization_config` nested inside it (int4, group 32, symmetric, pack-quantized, K2.6's six-entry ignore
//! list), `vision_config`; and the DFlash drafter config (§7, parsed by formats::config::DrafterConfig).
//! Values not in the preset are K2.6's. Tested in synth/mod.rs tests (parse through formats::config + plan).

use super::preset::Preset;
use super::vocab;
use serde_json::{json, Value};

/// K2.6 YaRN settings (beta_fast 32, unlike K2-Thinking).
pub fn rope_scaling() -> Value {
    json!({"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
}

pub const RMS_NORM_EPS: f64 = 1e-5;
pub const ROPE_THETA: f64 = 50000.0;
pub const ROUTED_SCALING_FACTOR: f64 = 2.827;

/// The compressed-tensors quantization_config of K2.6 (nested in text_config).
pub fn quantization_config() -> Value {
    json!({
        "config_groups": {"group_0": {
            "input_activations": null,
            "output_activations": null,
            "targets": ["Linear"],
            "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
                        "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                        "symmetric": true, "type": "int"}
        }},
        "format": "pack-quantized",
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed"
    })
}

/// Ids of the specials for this preset (first special = mergeable count).
pub struct Ids {
    pub bos: usize,
    pub eos: usize,
    pub pad: usize,
    pub media_pad: usize,
    pub unk: usize,
}

pub fn ids(p: &Preset) -> Ids {
    let b = p.tokenizer.mergeable;
    Ids {
        bos: b + vocab::BOS,
        eos: b + vocab::IM_END,
        pad: b + vocab::PAD,
        media_pad: b + vocab::MEDIA_PAD,
        unk: b + vocab::UNK,
    }
}

/// The model's config.json.
pub fn model_config(p: &Preset) -> Value {
    let t = &p.text;
    let v = &p.vision;
    let id = ids(p);
    let mut text = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": id.bos,
        "dtype": "bfloat16",
        "eos_token_id": id.eos,
        "ep_size": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": "kimi_k2",
        "moe_layer_freq": 1,
        "n_group": 1,
        "norm_topk_prob": true,
    });
    let rest = json!({
        "num_key_value_heads": t.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "pad_token_id": id.pad,
        "pretraining_tp": 1,
        "quantization_config": quantization_config(),
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": rope_scaling(),
        "rope_theta": ROPE_THETA,
        "routed_scaling_factor": ROUTED_SCALING_FACTOR,
        "scoring_func": "sigmoid",
        "seq_aux": true,
        "tie_word_embeddings": false,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": true,
        "vocab_size": p.vocab_size()
    });
    let obj = text.as_object_mut().expect("object");
    obj.extend(rest.as_object().expect("object").clone());
    // The preset's widths, under their config.json names (TextPreset's fields are those names).
    let Value::Object(widths) = serde_json::to_value(t).expect("TextPreset serializes") else {
        unreachable!("a struct serializes to an object")
    };
    obj.extend(widths);
    obj.sort_keys();
    let vision = json!({
        "init_pos_emb_height": v.pos_emb[0],
        "init_pos_emb_time": 4,
        "init_pos_emb_width": v.pos_emb[1],
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_hidden_size": v.hidden,
        "mm_projector_type": "patchmerger",
        "model_type": "",
        "patch_size": 14,
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": t.hidden_size,
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": v.hidden,
        "vt_intermediate_size": v.intermediate,
        "vt_num_attention_heads": v.heads,
        "vt_num_hidden_layers": v.blocks
    });
    json!({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"
        },
        "bos_token_id": id.bos,
        "dtype": "bfloat16",
        "eos_token_id": id.eos,
        "ignore_index": -100,
        "media_placeholder_token_id": id.media_pad,
        "model_type": "kimi_k25",
        "pad_token_id": id.pad,
        "text_config": text,
        "tie_word_embeddings": false,
        "transformers_version": "4.57.1",
        "use_unified_vision_chunk": true,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": vision
    })
}

/// generation_config.json (eos = <|im_end|>, as K2.6).
pub fn generation_config(p: &Preset) -> Value {
    let id = ids(p);
    json!({
        "bos_token_id": id.bos,
        "eos_token_id": id.eos,
        "pad_token_id": id.pad,
        "max_length": p.text.max_position_embeddings
    })
}

/// The DFlash drafter's config.json.
pub fn drafter_config(p: &Preset) -> Value {
    let d = &p.drafter;
    json!({
        "architectures": ["DFlashDraftModel"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": d.block_size,
        "dflash_config": {
            "block_size": d.block_size,
            "mask_token_id": ids(p).unk,
            "target_layer_ids": p.target_layer_ids()
        },
        "dtype": "bfloat16",
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.text.hidden_size,
        "intermediate_size": d.intermediate_size,
        "max_position_embeddings": p.text.max_position_embeddings,
        "model_type": "qwen3",
        "num_attention_heads": d.num_attention_heads,
        "num_hidden_layers": d.num_hidden_layers,
        "num_key_value_heads": d.num_key_value_heads,
        "num_target_layers": p.text.num_hidden_layers,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": rope_scaling(),
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": false,
        "use_cache": true,
        "vocab_size": p.vocab_size()
    })
}
