#!/usr/bin/env python3
"""Self-tests of crosscheck.py that need no Rust binary: INT4 unpacking, the transformers mapping, and
transformers vs the numpy k26-format §4 implementation on a small K2.6-layout checkpoint written here.

Run: crosscheck/.venv-crosscheck/bin/python crosscheck/test_crosscheck.py
"""

import json
import os
import sys
import tempfile
import unittest

import numpy as np

import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "crosscheck_py", os.path.join(os.path.dirname(os.path.abspath(__file__)), "crosscheck.py"))
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

TEXT_CONFIG = {
    "model_type": "kimi_k2",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    # factor 64 with orig 64 makes the YaRN ramp fall inside the 4 rope frequency pairs
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"type": "int", "num_bits": 4, "group_size": 32, "strategy": "group",
                                                  "symmetric": True, "dynamic": False}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
    },
}


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed q in [-8, 7], [N, K] -> compressed-tensors int32 words [N, K/8] (element 8w+j at bits 4j)."""
    u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
    words = np.zeros(u.shape[:2], dtype=np.int64)
    for j in range(8):
        words |= u[:, :, j] << (4 * j)
    return words.astype(np.uint32).view(np.int32)


def write_checkpoint(path: str, tc: dict, seed: int = 7):
    """A K2.6-layout checkpoint: bf16 dense weights, INT4 routed experts, F32 bias, a vision tensor."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    H, L = tc["hidden_size"], tc["num_hidden_layers"]
    nh, dn, dr, dv = tc["num_attention_heads"], tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    t = {}

    def bf16(shape, std):
        return torch.from_numpy(rng.normal(0.0, std, size=shape).astype(np.float32)).to(torch.bfloat16)

    def norm_w(n):
        return torch.from_numpy((1.0 + rng.normal(0.0, 0.1, size=n)).astype(np.float32)).to(torch.bfloat16)

    p = "language_model.model."
    t[p + "embed_tokens.weight"] = bf16((tc["vocab_size"], H), 1.0)
    t[p + "norm.weight"] = norm_w(H)
    t["language_model.lm_head.weight"] = bf16((tc["vocab_size"], H), H ** -0.5)
    for l in range(L):
        a = f"{p}layers.{l}.self_attn."
        t[a + "q_a_proj.weight"] = bf16((tc["q_lora_rank"], H), H ** -0.5)
        t[a + "q_a_layernorm.weight"] = norm_w(tc["q_lora_rank"])
        t[a + "q_b_proj.weight"] = bf16((nh * (dn + dr), tc["q_lora_rank"]), tc["q_lora_rank"] ** -0.5)
        t[a + "kv_a_proj_with_mqa.weight"] = bf16((tc["kv_lora_rank"] + dr, H), H ** -0.5)
        t[a + "kv_a_layernorm.weight"] = norm_w(tc["kv_lora_rank"])
        t[a + "kv_b_proj.weight"] = bf16((nh * (dn + dv), tc["kv_lora_rank"]), tc["kv_lora_rank"] ** -0.5)
        t[a + "o_proj.weight"] = bf16((H, nh * dv), (nh * dv) ** -0.5)
        t[f"{p}layers.{l}.input_layernorm.weight"] = norm_w(H)
        t[f"{p}layers.{l}.post_attention_layernorm.weight"] = norm_w(H)
        m = f"{p}layers.{l}.mlp."
        if not cc.is_moe_layer(tc, l):
            I = tc["intermediate_size"]
            t[m + "gate_proj.weight"] = bf16((I, H), H ** -0.5)
            t[m + "up_proj.weight"] = bf16((I, H), H ** -0.5)
            t[m + "down_proj.weight"] = bf16((H, I), I ** -0.5)
            continue
        I, E = tc["moe_intermediate_size"], tc["n_routed_experts"]
        t[m + "gate.weight"] = bf16((E, H), H ** -0.5)
        t[m + "gate.e_score_correction_bias"] = torch.from_numpy(rng.normal(0, 0.05, size=E).astype(np.float32))
        t[m + "shared_experts.gate_proj.weight"] = bf16((I, H), H ** -0.5)
        t[m + "shared_experts.up_proj.weight"] = bf16((I, H), H ** -0.5)
        t[m + "shared_experts.down_proj.weight"] = bf16((H, I), I ** -0.5)
        for e in range(E):
            for name, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                q = rng.integers(-8, 8, size=(n, k))
                scale = np.abs(rng.normal(0, 0.4 * k ** -0.5 / 4, size=(n, k // 32))).astype(np.float32) + 1e-3
                b = f"{m}experts.{e}.{name}."
                t[b + "weight_packed"] = torch.from_numpy(pack_int4(q))
                t[b + "weight_scale"] = torch.from_numpy(scale).to(torch.bfloat16)
                t[b + "weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
    t["vision_tower.patch_embed.proj.bias"] = bf16((8,), 1.0)
    os.makedirs(path, exist_ok=True)
    names = sorted(t)
    half = len(names) // 2
    shards = {"model-00001-of-000002.safetensors": names[:half], "model-00002-of-000002.safetensors": names[half:]}
    for fname, part in shards.items():
        save_file({k: t[k].contiguous() for k in part}, os.path.join(path, fname))
    total = sum(t[k].numel() * t[k].element_size() for k in names)
    index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                   "text_config": tc}, f, indent=1)


class Int4(unittest.TestCase):
    def test_worked_example(self):
        # k26-format §3.3: q = [-8,-1,0,1,7,3,-3,2] packs to 0xA5BF9870; scale 0.01
        import torch

        q = np.array([[-8, -1, 0, 1, 7, 3, -3, 2] * 4])
        words = pack_int4(q)
        self.assertEqual(int(words[0, 0].view(np.uint32)), 0xA5BF9870)
        self.assertEqual(int(words[0, 0]), -1514170256)
        w = cc.unpack_int4(torch.from_numpy(words), torch.tensor([[0.01]], dtype=torch.float32), (1, 32))
        np.testing.assert_allclose(w.numpy()[0, :8], np.array([-8, -1, 0, 1, 7, 3, -3, 2]) * 0.01, rtol=1e-6)

    def test_random_roundtrip_and_groups(self):
        import torch

        rng = np.random.default_rng(1)
        q = rng.integers(-8, 8, size=(5, 64))
        s = rng.uniform(0.5, 2.0, size=(5, 2)).astype(np.float32)
        w = cc.unpack_int4(torch.from_numpy(pack_int4(q)), torch.from_numpy(s), (5, 64)).numpy()
        np.testing.assert_array_equal(w, q.astype(np.float32) * np.repeat(s, 32, axis=1))


class Transformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = os.path.join(cls.tmp.name, "ckpt")
        write_checkpoint(cls.dir, TEXT_CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_state_dict_covers_module(self):
        tc, t, model = cc.build_hf(self.dir, None)
        l1 = model.model.layers[1].mlp.experts
        self.assertEqual(tuple(l1.gate_up_proj.shape), (8, 64, 64))
        # expert 3 gate rows are the first half of gate_up_proj[3]
        g = cc.expert_weight(t, "model.layers.1.mlp.experts.3.gate_proj")
        np.testing.assert_array_equal(l1.gate_up_proj[3, :32].detach().numpy(), g.numpy())
        self.assertEqual(model.model.layers[1].self_attn.q_a_layernorm.variance_epsilon, 1e-6)

    def test_spec_matches_transformers_and_is_deterministic(self):
        eps = 1e-6
        tc, t, model = cc.build_hf(self.dir, eps)
        ids = [3, 17, 5, 60, 9, 41, 77, 2, 88, 13, 30, 64]
        a = cc.spec_forward(tc, t, ids, eps)
        b = cc.hf_logits(model, ids)
        self.assertTrue(np.isfinite(b).all())
        self.assertGreater(np.abs(b).max(), 0.1)
        e = cc.errors(a, b)
        self.assertLess(e["rel_step"], 1e-5, e)
        np.testing.assert_array_equal(b, cc.hf_logits(model, ids))  # deterministic
        # the latent-norm eps is visible to the check: a large eps must move the logits
        a2 = cc.spec_forward(tc, t, ids, 1e-1)
        self.assertGreater(cc.errors(a2, b)["rel_step"], 1e-4)

    def test_teacher_forced_equals_greedy_logits(self):
        _, _, model = cc.build_hf(self.dir, None)
        prompt = [5, 6, 7]
        toks, rows = cc.hf_greedy(model, prompt, 6)
        forced = cc.hf_teacher_forced(model, prompt, toks)
        self.assertEqual(forced.shape, rows.shape)
        np.testing.assert_allclose(forced, rows, rtol=0, atol=1e-4 * np.abs(rows).max())
        self.assertTrue((forced.argmax(1) == toks).all())


if __name__ == "__main__":
    unittest.main()
