"""Write the trained pair in the exact Kimi K2.6 / DFlash Hugging Face layouts that `kdtree-convert synth`
writes (tools/kdtree-convert/src/synth/: configs.rs, tensors.rs, mod.rs, vocab.rs; k26-format.md §1-§2, §6-§7).

* config.json: KimiK25 top level, `text_config` (model_type kimi_k2, DeepSeek-V3 keys) with the compressed-tensors
  `quantization_config` nested inside, `vision_config`; generation_config.json (eos = <|im_end|>).
* shards `model-000NN-of-0000MM.safetensors`: one per decoder layer, then embed/lm_head/norm, then mm_projector,
  then vision_tower (both tiny and untrained: kdtree-convert skips them, they are there for the layout); index
  `model.safetensors.index.json` (weight_map sorted by name).
* routed experts as compressed-tensors triplets `weight_packed` I32 [N, K/8], `weight_scale` BF16 [N, K/32],
  `weight_shape` I32 [2]; `e_score_correction_bias` F32; everything else BF16.
* drafter/config.json (DFlashDraftModel, model_type qwen3, dflash_config) + drafter/model.safetensors (no prefix).
* quantize_int4: compressed-tensors' int4 group-32 symmetric rule bit for bit (formats/src/int4.rs; checked
  against tools/kdtree-convert/fixtures/ct_int4 by test_train.py).
"""
import json
import os

import torch
from safetensors.torch import save_file

import bpe

RMS_NORM_EPS = 1e-5
ROPE_THETA = 50000.0
ROUTED_SCALING_FACTOR = 2.827
ROPE_SCALING = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# tiny untrained vision tower / projector (the synth "tiny" preset's widths)
VISION = {"hidden": 32, "intermediate": 64, "heads": 2, "blocks": 1, "pos_emb": [4, 4]}


def quantization_config():
    return {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                        "type": "int"}}},
        "format": "pack-quantized",
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }


def special_ids(n_mergeable):
    return {"bos": n_mergeable + bpe.BOS, "eos": n_mergeable + bpe.IM_END, "pad": n_mergeable + bpe.PAD,
            "media_pad": n_mergeable + bpe.MEDIA_PAD, "unk": n_mergeable + bpe.UNK}


def text_config(t, n_mergeable):
    """text_config as the model code reads it (and as config.json stores it)."""
    ids = special_ids(n_mergeable)
    c = {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": ids["bos"], "dtype": "bfloat16", "eos_token_id": ids["eos"],
        "ep_size": 1, "hidden_act": "silu", "initializer_range": 0.02, "model_type": "kimi_k2", "moe_layer_freq": 1,
        "n_group": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 0, "pad_token_id": ids["pad"],
        "pretraining_tp": 1, "quantization_config": quantization_config(), "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": dict(ROPE_SCALING), "rope_theta": ROPE_THETA, "routed_scaling_factor": ROUTED_SCALING_FACTOR,
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc", "use_cache": True, "vocab_size": n_mergeable + bpe.NUM_SPECIALS,
        "num_key_value_heads": t["num_attention_heads"],
    }
    c.update(t)
    return dict(sorted(c.items()))


def model_config(t, n_mergeable):
    ids = special_ids(n_mergeable)
    v = VISION
    vision = {
        "init_pos_emb_height": v["pos_emb"][0], "init_pos_emb_time": 4, "init_pos_emb_width": v["pos_emb"][1],
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": v["hidden"],
        "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 14, "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": t["hidden_size"],
        "video_attn_type": "spatial_temporal", "vt_hidden_size": v["hidden"], "vt_intermediate_size": v["intermediate"],
        "vt_num_attention_heads": v["heads"], "vt_num_hidden_layers": v["blocks"],
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "bos_token_id": ids["bos"], "dtype": "bfloat16", "eos_token_id": ids["eos"], "ignore_index": -100,
        "media_placeholder_token_id": ids["media_pad"], "model_type": "kimi_k25", "pad_token_id": ids["pad"],
        "text_config": text_config(t, n_mergeable), "tie_word_embeddings": False,
        "transformers_version": "4.57.1", "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>", "vision_config": vision,
    }


def drafter_config(t, d, n_mergeable, tap_ids):
    return {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": d["block_size"],
        "dflash_config": {"block_size": d["block_size"], "mask_token_id": special_ids(n_mergeable)["unk"],
                          "target_layer_ids": list(tap_ids)},
        "dtype": "bfloat16", "head_dim": d["head_dim"], "hidden_act": "silu", "hidden_size": t["hidden_size"],
        "intermediate_size": d["intermediate_size"], "max_position_embeddings": t["max_position_embeddings"],
        "model_type": "qwen3", "num_attention_heads": d["num_attention_heads"],
        "num_hidden_layers": d["num_hidden_layers"], "num_key_value_heads": d["num_key_value_heads"],
        "num_target_layers": t["num_hidden_layers"], "rms_norm_eps": RMS_NORM_EPS, "rope_scaling": dict(ROPE_SCALING),
        "rope_theta": ROPE_THETA, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": n_mergeable + bpe.NUM_SPECIALS,
    }


def quantize_int4(w):
    """compressed-tensors int4 group-32 symmetric pack-quantized: w [N, K] -> (weight_packed I32 [N, K/8],
    weight_scale BF16 [N, K/32]). scale = bf16(amax / 7.5) (0 -> 2^-7); q = round_half_even(clamp(bf16(x / scale),
    -8, 7)); element k in word k/8 at bits 4(k%8), stored as q + 8."""
    n, k = w.shape
    assert k % 32 == 0, f"K={k} is not a multiple of 32"
    g = w.detach().to(torch.bfloat16).float().reshape(n, k // 32, 32)
    scale = (g.abs().amax(-1) / 7.5).to(torch.bfloat16)
    scale = torch.where(scale.float() == 0, torch.full_like(scale, 2 ** -7), scale)
    q = (g / scale.float()[..., None]).to(torch.bfloat16).float().clamp(-8, 7).round()
    u = (q.reshape(n, k) + 8).to(torch.int64).reshape(n, k // 8, 8)
    word = (u << (4 * torch.arange(8, dtype=torch.int64))).sum(-1)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.contiguous(), scale.contiguous()


def dequantize_int4(packed, scale, k):
    """Exact f32 values (q * scale) of a packed [N, K/8] I32 + [N, K/32] BF16 pair."""
    n = packed.shape[0]
    w = packed.to(torch.int64) & 0xFFFFFFFF
    u = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], -1).reshape(n, k)
    q = (u - 8).float()
    return q * scale.float().repeat_interleave(32, dim=1)


def bf16(t):
    return t.detach().to(torch.bfloat16).contiguous().cpu()


def target_tensors(model, t):
    """Per-shard dicts of checkpoint tensors (decoder layers, then embed/head/norm)."""
    shards = []
    for l, layer in enumerate(model.layers):
        p = f"language_model.model.layers.{l}."
        a = layer.self_attn
        s = {p + "input_layernorm.weight": bf16(layer.input_layernorm.weight),
             p + "post_attention_layernorm.weight": bf16(layer.post_attention_layernorm.weight)}
        for name in ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]:
            s[p + f"self_attn.{name}.weight"] = bf16(getattr(a, name).weight)
        s[p + "self_attn.q_a_layernorm.weight"] = bf16(a.q_a_layernorm.weight)
        s[p + "self_attn.kv_a_layernorm.weight"] = bf16(a.kv_a_layernorm.weight)
        m = layer.mlp
        if l < t["first_k_dense_replace"]:
            for name in ["gate_proj", "up_proj", "down_proj"]:
                s[p + f"mlp.{name}.weight"] = bf16(getattr(m, name).weight)
        else:
            s[p + "mlp.gate.weight"] = bf16(m.gate.weight)
            s[p + "mlp.gate.e_score_correction_bias"] = m.e_score_correction_bias.detach().float().contiguous().cpu()
            for name in ["gate_proj", "up_proj", "down_proj"]:
                s[p + f"mlp.shared_experts.{name}.weight"] = bf16(getattr(m.shared_experts, name).weight)
            for e in range(m.w_gate.shape[0]):
                for name, w in [("gate_proj", m.w_gate[e]), ("up_proj", m.w_up[e]), ("down_proj", m.w_down[e])]:
                    packed, scale = quantize_int4(w.detach().float().cpu())
                    q = p + f"mlp.experts.{e}.{name}."
                    s[q + "weight_packed"] = packed
                    s[q + "weight_scale"] = scale
                    s[q + "weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
        shards.append(s)
    shards.append({"language_model.model.embed_tokens.weight": bf16(model.embed_tokens.weight),
                   "language_model.model.norm.weight": bf16(model.norm.weight),
                   "language_model.lm_head.weight": bf16(model.lm_head.weight)})
    return shards


def vision_tensors(hidden, gen):
    """Tiny untrained mm_projector and vision_tower (names of k26-format §2.3)."""
    v = VISION
    vt, vi = v["hidden"], v["intermediate"]
    r = lambda *shape: bf16(torch.randn(*shape, generator=gen) * 0.02)
    one = lambda n: bf16(torch.ones(n))
    m = 4 * vt
    proj = {"mm_projector.pre_norm.weight": one(vt), "mm_projector.pre_norm.bias": r(vt),
            "mm_projector.proj.0.weight": r(m, m), "mm_projector.proj.0.bias": r(m),
            "mm_projector.proj.2.weight": r(hidden, m), "mm_projector.proj.2.bias": r(hidden)}
    vis = {"vision_tower.patch_embed.proj.weight": r(vt, 3, 14, 14), "vision_tower.patch_embed.proj.bias": r(vt),
           "vision_tower.patch_embed.pos_emb.weight": r(v["pos_emb"][0], v["pos_emb"][1], vt),
           "vision_tower.encoder.final_layernorm.weight": one(vt),
           "vision_tower.encoder.final_layernorm.bias": r(vt)}
    for b in range(v["blocks"]):
        p = f"vision_tower.encoder.blocks.{b}."
        vis.update({p + "wqkv.weight": r(3 * vt, vt), p + "wqkv.bias": r(3 * vt), p + "wo.weight": r(vt, vt),
                    p + "wo.bias": r(vt), p + "norm0.weight": one(vt), p + "norm0.bias": r(vt),
                    p + "norm1.weight": one(vt), p + "norm1.bias": r(vt), p + "mlp.fc0.weight": r(vi, vt),
                    p + "mlp.fc0.bias": r(vi), p + "mlp.fc1.weight": r(vt, vi), p + "mlp.fc1.bias": r(vt)})
    return [proj, vis]


def drafter_tensors(dr):
    s = {"fc.weight": bf16(dr.fc.weight), "hidden_norm.weight": bf16(dr.hidden_norm.weight),
         "norm.weight": bf16(dr.norm.weight)}
    for l, layer in enumerate(dr.layers):
        p = f"layers.{l}."
        s[p + "input_layernorm.weight"] = bf16(layer.input_layernorm.weight)
        s[p + "post_attention_layernorm.weight"] = bf16(layer.post_attention_layernorm.weight)
        for name in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            s[p + f"self_attn.{name}.weight"] = bf16(getattr(layer, name).weight)
        s[p + "self_attn.q_norm.weight"] = bf16(layer.q_norm.weight)
        s[p + "self_attn.k_norm.weight"] = bf16(layer.k_norm.weight)
        for name in ["gate_proj", "up_proj", "down_proj"]:
            s[p + f"mlp.{name}.weight"] = bf16(getattr(layer.mlp, name).weight)
    return s


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_pair(out, target, drafter, t, d, tokens, tap_ids, chat_template, seed):
    """Write the target checkpoint into `out` and the drafter into `out/drafter`."""
    os.makedirs(os.path.join(out, "drafter"), exist_ok=True)
    n = len(tokens)
    write_json(os.path.join(out, "config.json"), model_config(t, n))
    ids = special_ids(n)
    write_json(os.path.join(out, "generation_config.json"),
               {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
                "max_length": t["max_position_embeddings"]})
    bpe.write_files(out, tokens, t["max_position_embeddings"])
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(chat_template)
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    shards = target_tensors(target, t) + vision_tensors(t["hidden_size"], gen)
    weight_map, total = {}, 0
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors"
        save_file(s, os.path.join(out, name), metadata={"format": "pt"})
        for k, v in s.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    write_json(os.path.join(out, "model.safetensors.index.json"),
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    write_json(os.path.join(out, "drafter", "config.json"), drafter_config(t, d, n, tap_ids))
    save_file(drafter_tensors(drafter), os.path.join(out, "drafter", "model.safetensors"), metadata={"format": "pt"})
