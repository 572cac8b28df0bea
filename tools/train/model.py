"""PyTorch twins of the kdtree CPU reference: the K2.6 / DeepSeek-V3 target and the DFlash drafter.

Target (engine/src/model/{target,attention,ffn}.rs, k26-format.md §4): RMSNorm `w * (x * rsqrt(mean(x²) + eps))`
(eps = rms_norm_eps, q_a/kv_a latent norms 1e-6 as transformers); MLA with q_lora (q_a -> norm -> q_b, per head
[nope | rope]), latent KV (kv_a -> [c_kv | k_rope], c_kv normed, kv_b per head [k_nope | v]), one shared rope key,
interleaved (GPT-J) YaRN rope on the rope dims, softmax scale qk^-0.5 * mscale(factor, mscale_all_dim)²; layer 0
dense SwiGLU; then noaux_tc MoE: f32 router logits, s = sigmoid, top-k on s + e_score_correction_bias, weights =
unbiased s / (sum + 1e-20) * routed_scaling_factor, plus one shared expert.
Drafter (engine/src/drafter.rs, ddtree.md §1): ctx = hidden_norm(fc(concat taps)); per layer Qwen3 pre-norm block,
queries from the block [anchor, mask * (B-1)], keys/values = [k_norm(k_proj(ctx)) ; k_norm(k_proj(block))] (q/k norm
per head, NeoX rope over the full head_dim at absolute positions, YaRN inverse frequencies, cos/sin amplitude 1),
non-causal inside the block, scale head_dim^-0.5; final norm; the target's lm_head.
Training runs these in bf16 autocast; the engine-agreement check (check_engine.py) runs them in f32.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LATENT_EPS = 1e-6


def yarn_get_mscale(scale, mscale):
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim, theta, rs):
    """engine cpu::ops::yarn_inv_freq: f64 math, rounded to f32 once."""
    half = dim // 2
    extra = [1.0 / theta ** (2 * i / dim) for i in range(half)]
    if rs is None:
        return torch.tensor(extra, dtype=torch.float32)
    orig = rs["original_max_position_embeddings"]
    corr = lambda r: dim * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(corr(rs["beta_fast"])), 0.0)
    high = min(math.ceil(corr(rs["beta_slow"])), dim - 1.0)
    if low == high:
        high += 0.001
    out = []
    for i in range(half):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        mask = 1.0 - ramp
        out.append(extra[i] / rs["factor"] * (1 - mask) + extra[i] * mask)
    return torch.tensor(out, dtype=torch.float32)


def cos_sin(inv_freq, pos, factor=1.0):
    """cos/sin [.., D/2] for integer positions `pos` (angle formed in f32, as transformers and the engine)."""
    ang = pos.to(torch.float32)[..., None] * inv_freq.to(pos.device)
    ang = ang.double()
    return (ang.cos() * factor).float(), (ang.sin() * factor).float()


def rope_interleaved(x, cos, sin):
    """x [..., P]: pairs (2i, 2i+1) rotate by angle i; cos/sin broadcastable to [..., P/2]."""
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rope_neox(x, cos, sin):
    """x [..., D]: pairs (i, i + D/2) rotate by angle i."""
    h = x.shape[-1] // 2
    a, b = x[..., :h].float(), x[..., h:].float()
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def linear(i, o):
    return nn.Linear(i, o, bias=False)


def fake_int4(w):
    """Straight-through INT4 group-32 symmetric fake quantisation along the last dim (K)."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    s = (g.detach().abs().amax(-1, keepdim=True) / 7.5).clamp_min(2 ** -7)
    q = (g / s).clamp(-8, 7).round() * s
    return w + (q.reshape(w.shape) - w).detach()


class MLA(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        h, nh = c["hidden_size"], c["num_attention_heads"]
        self.nope, self.rope, self.vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.kvl = c["kv_lora_rank"]
        self.nh = nh
        self.q_a_proj = linear(h, c["q_lora_rank"])
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"], LATENT_EPS)
        self.q_b_proj = linear(c["q_lora_rank"], nh * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = linear(h, self.kvl + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kvl, LATENT_EPS)
        self.kv_b_proj = linear(self.kvl, nh * (self.nope + self.vd))
        self.o_proj = linear(nh * self.vd, h)
        rs = c["rope_scaling"]
        m = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"]) if rs and rs.get("mscale_all_dim", 0) else 1.0
        self.scale = (self.nope + self.rope) ** -0.5 * m * m

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.nh, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = ckv[..., :self.kvl], ckv[..., self.kvl:]
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, self.nh, self.nope + self.vd)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        q_pe = rope_interleaved(q_pe, cos[:, :, None], sin[:, :, None])
        k_pe = rope_interleaved(k_pe, cos, sin)[:, :, None].expand(B, T, self.nh, self.rope)
        qh = torch.cat((q_nope, q_pe), -1).transpose(1, 2)
        kh = torch.cat((k_nope, k_pe), -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, v.transpose(1, 2), is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.vd))


class SwiGLU(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(h, i), linear(h, i), linear(i, h)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts are stored stacked ([E, I, H] gate/up, [E, H, I] down) and computed densely (every
    expert on every token, weighted by the sparse combine matrix: same result as dispatching the top-k)."""

    def __init__(self, c):
        super().__init__()
        h, e, i = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
        self.k, self.rsf = c["num_experts_per_tok"], c["routed_scaling_factor"]
        self.gate = nn.Linear(h, e, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.w_gate = nn.Parameter(torch.empty(e, i, h))
        self.w_up = nn.Parameter(torch.empty(e, i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = SwiGLU(h, i * c["n_shared_experts"])
        self.fake_quant = False
        self.sparse = False  # inference: run only the selected experts, in ascending expert id (as the engine)
        self.last_load = None

    def forward_sparse(self, xf, idx, w):
        out = torch.zeros_like(xf, dtype=torch.float32)
        for e in range(self.w_gate.shape[0]):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = xf[rows]
            y = (F.silu(xe @ self.w_gate[e].T) * (xe @ self.w_up[e].T)) @ self.w_down[e].T
            out.index_add_(0, rows, y.float() * w[rows, slot][:, None])
        return out

    def route(self, x):
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())  # [N, E] f32, never autocast
        s = torch.sigmoid(logits)
        idx = torch.topk(s + self.e_score_correction_bias, self.k, dim=-1).indices
        w = s.gather(-1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.rsf
        return idx, w

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        idx, w = self.route(xf)
        if self.sparse:
            return self.forward_sparse(xf, idx, w).to(x.dtype).reshape(shape) + self.shared_experts(x)
        combine = torch.zeros(xf.shape[0], self.w_gate.shape[0], device=x.device, dtype=torch.float32)
        combine.scatter_(1, idx, w)
        self.last_load = torch.bincount(idx.flatten(), minlength=self.w_gate.shape[0]).detach()
        wg, wu, wd = self.w_gate, self.w_up, self.w_down
        if self.fake_quant:
            wg, wu, wd = fake_int4(wg), fake_int4(wu), fake_int4(wd)
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else xf.dtype
        xe = xf.to(dt)
        g = torch.einsum("nh,eih->eni", xe, wg.to(dt))
        u = torch.einsum("nh,eih->eni", xe, wu.to(dt))
        y = torch.einsum("eni,ehi->enh", F.silu(g) * u, wd.to(dt))  # [E, N, H]
        out = torch.einsum("enh,ne->nh", y, combine.to(y.dtype))
        return (out.to(x.dtype).reshape(shape) + self.shared_experts(x))


class Layer(nn.Module):
    def __init__(self, c, dense):
        super().__init__()
        eps = c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)
        self.self_attn = MLA(c)
        self.mlp = SwiGLU(c["hidden_size"], c["intermediate_size"]) if dense else MoE(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Target(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c, l < c["first_k_dense_replace"]) for l in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = linear(c["hidden_size"], c["vocab_size"])
        self.register_buffer("inv_freq", yarn_inv_freq(c["qk_rope_head_dim"], c["rope_theta"], c["rope_scaling"]),
                             persistent=False)

    def init_weights(self, gen):
        res = 1.0 / math.sqrt(2 * len(self.layers))
        for n, p in self.named_parameters():
            if n.endswith("layernorm.weight") or n.endswith("norm.weight"):
                nn.init.ones_(p)
            elif "w_gate" in n or "w_up" in n:
                nn.init.normal_(p, 0, p.shape[-1] ** -0.5, generator=gen)
            elif "w_down" in n or "o_proj" in n or "down_proj" in n:
                nn.init.normal_(p, 0, p.shape[-1] ** -0.5 * res, generator=gen)
            elif "embed_tokens" in n:
                nn.init.normal_(p, 0, 1.0, generator=gen)
            else:
                nn.init.normal_(p, 0, p.shape[-1] ** -0.5, generator=gen)

    def moe_layers(self):
        return [l.mlp for l in self.layers if isinstance(l.mlp, MoE)]

    def forward(self, ids, taps=(), pos0=0):
        """ids [B, T] -> (logits [B, T, V], taps [B, T, n_tap * H] (residual after each tap layer))."""
        B, T = ids.shape
        pos = torch.arange(pos0, pos0 + T, device=ids.device)
        cos, sin = cos_sin(self.inv_freq, pos)
        cos, sin = cos[None], sin[None]
        x = self.embed_tokens(ids)
        got = {}
        for l, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if l in taps:
                got[l] = x
        logits = self.lm_head(self.norm(x))
        tap = torch.cat([got[l] for l in taps], -1) if taps else None
        return logits, tap


class DraftLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        h, self.nh, self.kvh, self.hd = d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]
        eps = d["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.q_proj, self.k_proj = linear(h, self.nh * self.hd), linear(h, self.kvh * self.hd)
        self.v_proj, self.o_proj = linear(h, self.kvh * self.hd), linear(self.nh * self.hd, h)
        self.q_norm, self.k_norm = RMSNorm(self.hd, eps), RMSNorm(self.hd, eps)
        self.mlp = SwiGLU(h, d["intermediate_size"])

    def kv(self, x, cos, sin):
        """x [B, S, H] at positions with cos/sin [B or 1, S, D/2] -> k, v [B, kvh, S, D]."""
        B, S, _ = x.shape
        k = rope_neox(self.k_norm(self.k_proj(x).view(B, S, self.kvh, self.hd)), cos[:, :, None], sin[:, :, None])
        v = self.v_proj(x).view(B, S, self.kvh, self.hd)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, ctx, cos_b, sin_b, cos_c, sin_c, mask):
        """x [B, Q, H] block tokens, ctx [B, C, H]; mask [B, 1, Q, C + Q] bool (True = visible)."""
        B, Q, _ = x.shape
        hn = self.input_layernorm(x)
        q = rope_neox(self.q_norm(self.q_proj(hn).view(B, Q, self.nh, self.hd)), cos_b[:, :, None], sin_b[:, :, None])
        kc, vc = self.kv(ctx, cos_c, sin_c)
        kb, vb = self.kv(hn, cos_b, sin_b)
        k, v = torch.cat((kc, kb), 2), torch.cat((vc, vb), 2)
        g = self.nh // self.kvh
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=self.hd ** -0.5)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.hd))
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        h = d["hidden_size"]
        n_tap = len(d["dflash_config"]["target_layer_ids"])
        self.fc = linear(n_tap * h, h)
        self.hidden_norm = RMSNorm(h, d["rms_norm_eps"])
        self.layers = nn.ModuleList(DraftLayer(d) for _ in range(d["num_hidden_layers"]))
        self.norm = RMSNorm(h, d["rms_norm_eps"])
        rs = d["rope_scaling"]
        self.attn_factor = yarn_get_mscale(rs["factor"], rs["mscale"]) / yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
        self.register_buffer("inv_freq", yarn_inv_freq(d["head_dim"], d["rope_theta"], rs), persistent=False)

    def init_weights(self, gen):
        res = 1.0 / math.sqrt(2 * len(self.layers))
        for n, p in self.named_parameters():
            if n.endswith("norm.weight"):
                nn.init.ones_(p)
            elif "o_proj" in n or "down_proj" in n:
                nn.init.normal_(p, 0, p.shape[-1] ** -0.5 * res, generator=gen)
            else:
                nn.init.normal_(p, 0, p.shape[-1] ** -0.5, generator=gen)

    def forward(self, block_emb, block_pos, taps, ctx_pos, mask, lm_head):
        """block_emb [B, Q, H] (target embeddings of anchor / mask tokens) at block_pos [B, Q];
        taps [B, C, n_tap*H] at ctx_pos [C]; mask [B, 1, Q, C + Q]. Returns logits [B, Q, V]."""
        ctx = self.hidden_norm(self.fc(taps))
        cb, sb = cos_sin(self.inv_freq, block_pos, self.attn_factor)
        cc, sc = cos_sin(self.inv_freq, ctx_pos, self.attn_factor)
        cc, sc = cc[None], sc[None]
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, cb, sb, cc, sc, mask)
        return lm_head(self.norm(x))
