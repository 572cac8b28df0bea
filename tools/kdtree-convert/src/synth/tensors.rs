//! What a synthetic K2.6 checkpoint holds and how each tensor's bytes are generated.
//!
//! Names, dtypes, shapes and the shard grouping follow shared k26-format.md §2 exactly: `language_model.`
//! prefix, one shard per decoder layer (dense layer 0 first), then embed/lm_head/norm, then mm_projector, then
//! vision_tower; routed experts as compressed-tensors triplets (weight_packed I32 [N,K/8], weight_scale BF16
//! [N,K/32], weight_shape I32 or I64 [2]); e_score_correction_bias F32; all else BF16. Drafter names per
//! shared ddtree.md §1.1.
//!
//! Values: deterministic per (seed, tensor name, 4 MiB chunk index) with ChaCha8, so the output does not depend
//! on thread count or write order. Scaled so bf16 activations stay well-behaved: linear weights ~ N(0, 1/fan_in)
//! (residual outputs additionally / sqrt(2 * layers)), norms ~ 1, embeddings ~ N(0, 1), router bias small,
//! lm_head gives logits with std ~3 (spread, few near-ties). Normals are Irwin-Hall(4) (bounded at 3.5 sigma).
//! Expert nibbles are drawn from a near-symmetric bell-shaped table covering all 16 codes, with per-group scales
//! jittered ±20%. Tested in synth/mod.rs tests and tools/kdtree-convert/tests/synth.rs.

use super::preset::{Preset, ShapeDtype};
use half::bf16;
use kdtree_formats::dtype::Dtype;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// Generation chunk: the unit of determinism and of parallel work.
pub const CHUNK_BYTES: usize = 4 << 20;
/// How many of 256 random byte values map to q = 0, ±1, ..., ±7 (each side); q = -8 gets the remaining 2.
/// A bell-ish, near-symmetric distribution (mean -1/16) that uses all 16 codes.
const Q_COUNTS: [usize; 8] = [28, 28, 24, 20, 16, 12, 8, 5];
/// 8 random bits -> q in [-8, 7].
const Q_TABLE: [i8; 256] = q_table();
/// Standard deviation of q under Q_TABLE: sqrt(2914/256 - (1/16)^2).
const NIBBLE_Q_STD: f32 = 3.3733;

const fn q_table() -> [i8; 256] {
    let mut t = [-8i8; 256];
    let mut i = 0;
    let mut a = 0;
    while a < 8 {
        let mut c = 0;
        while c < Q_COUNTS[a] {
            t[i] = a as i8;
            i += 1;
            if a > 0 {
                t[i] = -(a as i8);
                i += 1;
            }
            c += 1;
        }
        a += 1;
    }
    t
}
/// Logit standard deviation aimed for at the lm_head.
const LOGIT_STD: f32 = 3.0;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// BF16 N(mean, std).
    Normal { mean: f32, std: f32 },
    /// F32 N(0, std).
    NormalF32 { std: f32 },
    /// Packed offset-8 nibbles (bytes of the I32 words), codes from the symmetric table.
    Nibbles,
    /// BF16 group scales so that q * scale has standard deviation `std` (±20% per group).
    Scales { std: f32 },
    /// weight_shape: the logical [N, K].
    Shape { n: usize, k: usize },
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl Spec {
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
    pub fn chunks(&self) -> usize {
        self.nbytes().div_ceil(CHUNK_BYTES)
    }
}

fn bf(name: String, shape: &[usize], mean: f32, std: f32) -> Spec {
    Spec {
        name,
        dtype: Dtype::BF16,
        shape: shape.to_vec(),
        init: Init::Normal { mean, std },
    }
}
fn linear(name: String, out: usize, inp: usize, gain: f32) -> Spec {
    bf(name, &[out, inp], 0.0, gain / (inp as f32).sqrt())
}
fn norm(name: String, n: usize) -> Spec {
    bf(name, &[n], 1.0, 0.05)
}

/// Routed expert triplet `{prefix}.{weight_packed, weight_scale, weight_shape}` of a [n, k] Linear.
fn expert(out: &mut Vec<Spec>, prefix: &str, n: usize, k: usize, gain: f32, shape_dtype: Dtype) {
    out.push(Spec {
        name: format!("{prefix}.weight_packed"),
        dtype: Dtype::I32,
        shape: vec![n, k / 8],
        init: Init::Nibbles,
    });
    let std = gain / (k as f32).sqrt();
    out.push(Spec {
        name: format!("{prefix}.weight_scale"),
        dtype: Dtype::BF16,
        shape: vec![n, k / 32],
        init: Init::Scales { std },
    });
    out.push(Spec {
        name: format!("{prefix}.weight_shape"),
        dtype: shape_dtype,
        shape: vec![2],
        init: Init::Shape { n, k },
    });
}

/// Tensors of decoder layer `l` (one shard).
pub fn layer(p: &Preset, l: usize) -> Vec<Spec> {
    let t = &p.text;
    let h = t.hidden_size;
    let res = 1.0 / (2.0 * t.num_hidden_layers as f32).sqrt();
    let pre = format!("language_model.model.layers.{l}");
    let qk = t.qk_nope_head_dim + t.qk_rope_head_dim;
    let heads = t.num_attention_heads;
    let mut v = vec![
        norm(format!("{pre}.input_layernorm.weight"), h),
        norm(format!("{pre}.post_attention_layernorm.weight"), h),
        linear(format!("{pre}.self_attn.q_a_proj.weight"), t.q_lora_rank, h, 1.0),
        norm(format!("{pre}.self_attn.q_a_layernorm.weight"), t.q_lora_rank),
        linear(
            format!("{pre}.self_attn.q_b_proj.weight"),
            heads * qk,
            t.q_lora_rank,
            1.0,
        ),
        linear(
            format!("{pre}.self_attn.kv_a_proj_with_mqa.weight"),
            t.kv_lora_rank + t.qk_rope_head_dim,
            h,
            1.0,
        ),
        norm(format!("{pre}.self_attn.kv_a_layernorm.weight"), t.kv_lora_rank),
        linear(
            format!("{pre}.self_attn.kv_b_proj.weight"),
            heads * (t.qk_nope_head_dim + t.v_head_dim),
            t.kv_lora_rank,
            1.0,
        ),
        linear(format!("{pre}.self_attn.o_proj.weight"), h, heads * t.v_head_dim, res),
    ];
    if l < t.first_k_dense_replace {
        let i = t.intermediate_size;
        v.push(linear(format!("{pre}.mlp.gate_proj.weight"), i, h, 1.0));
        v.push(linear(format!("{pre}.mlp.up_proj.weight"), i, h, 1.0));
        v.push(linear(format!("{pre}.mlp.down_proj.weight"), h, i, res));
        return v;
    }
    let (e, mi) = (t.n_routed_experts, t.moe_intermediate_size);
    v.push(linear(format!("{pre}.mlp.gate.weight"), e, h, 1.0));
    v.push(Spec {
        name: format!("{pre}.mlp.gate.e_score_correction_bias"),
        dtype: Dtype::F32,
        shape: vec![e],
        init: Init::NormalF32 { std: 0.02 },
    });
    let si = mi * t.n_shared_experts;
    v.push(linear(format!("{pre}.mlp.shared_experts.gate_proj.weight"), si, h, 1.0));
    v.push(linear(format!("{pre}.mlp.shared_experts.up_proj.weight"), si, h, 1.0));
    v.push(linear(format!("{pre}.mlp.shared_experts.down_proj.weight"), h, si, res));
    for x in 0..e {
        let sd = match p.synth.weight_shape_dtype {
            ShapeDtype::I32 => Dtype::I32,
            ShapeDtype::I64 => Dtype::I64,
            ShapeDtype::Mixed if x.is_multiple_of(2) => Dtype::I32,
            ShapeDtype::Mixed => Dtype::I64,
        };
        let ep = format!("{pre}.mlp.experts.{x}");
        expert(&mut v, &format!("{ep}.gate_proj"), mi, h, 1.0, sd);
        expert(&mut v, &format!("{ep}.up_proj"), mi, h, 1.0, sd);
        expert(&mut v, &format!("{ep}.down_proj"), h, mi, res, sd);
    }
    v
}

/// embed_tokens, final norm and lm_head (one shard).
pub fn embed_head(p: &Preset) -> Vec<Spec> {
    let (h, vocab) = (p.text.hidden_size, p.vocab_size());
    vec![
        bf("language_model.model.embed_tokens.weight".into(), &[vocab, h], 0.0, 1.0),
        norm("language_model.model.norm.weight".into(), h),
        linear("language_model.lm_head.weight".into(), vocab, h, LOGIT_STD),
    ]
}

/// mm_projector (patch merger: 2x2 tokens of the vision width into the text width).
pub fn projector(p: &Preset) -> Vec<Spec> {
    let (vt, h) = (p.vision.hidden, p.text.hidden_size);
    let m = 4 * vt;
    vec![
        norm("mm_projector.pre_norm.weight".into(), vt),
        bf("mm_projector.pre_norm.bias".into(), &[vt], 0.0, 0.02),
        linear("mm_projector.proj.0.weight".into(), m, m, 1.0),
        bf("mm_projector.proj.0.bias".into(), &[m], 0.0, 0.02),
        linear("mm_projector.proj.2.weight".into(), h, m, 1.0),
        bf("mm_projector.proj.2.bias".into(), &[h], 0.0, 0.02),
    ]
}

/// vision_tower (MoonViT names).
pub fn vision(p: &Preset) -> Vec<Spec> {
    let v = &p.vision;
    let (vt, vi) = (v.hidden, v.intermediate);
    let mut s = vec![
        bf(
            "vision_tower.patch_embed.proj.weight".into(),
            &[vt, 3, 14, 14],
            0.0,
            0.02,
        ),
        bf("vision_tower.patch_embed.proj.bias".into(), &[vt], 0.0, 0.02),
        bf(
            "vision_tower.patch_embed.pos_emb.weight".into(),
            &[v.pos_emb[0], v.pos_emb[1], vt],
            0.0,
            0.02,
        ),
        norm("vision_tower.encoder.final_layernorm.weight".into(), vt),
        bf("vision_tower.encoder.final_layernorm.bias".into(), &[vt], 0.0, 0.02),
    ];
    for b in 0..v.blocks {
        let pre = format!("vision_tower.encoder.blocks.{b}");
        s.push(linear(format!("{pre}.wqkv.weight"), 3 * vt, vt, 1.0));
        s.push(bf(format!("{pre}.wqkv.bias"), &[3 * vt], 0.0, 0.02));
        s.push(linear(format!("{pre}.wo.weight"), vt, vt, 1.0));
        s.push(bf(format!("{pre}.wo.bias"), &[vt], 0.0, 0.02));
        for n in ["norm0", "norm1"] {
            s.push(norm(format!("{pre}.{n}.weight"), vt));
            s.push(bf(format!("{pre}.{n}.bias"), &[vt], 0.0, 0.02));
        }
        s.push(linear(format!("{pre}.mlp.fc0.weight"), vi, vt, 1.0));
        s.push(bf(format!("{pre}.mlp.fc0.bias"), &[vi], 0.0, 0.02));
        s.push(linear(format!("{pre}.mlp.fc1.weight"), vt, vi, 1.0));
        s.push(bf(format!("{pre}.mlp.fc1.bias"), &[vt], 0.0, 0.02));
    }
    s
}

/// The shards of the target checkpoint, in file order.
pub fn target_shards(p: &Preset) -> Vec<Vec<Spec>> {
    let mut shards: Vec<Vec<Spec>> = (0..p.text.num_hidden_layers).map(|l| layer(p, l)).collect();
    shards.push(embed_head(p));
    shards.push(projector(p));
    shards.push(vision(p));
    shards
}

/// HF shard file name: 5-digit index, 6-digit total (`model-00001-of-000064.safetensors`).
pub fn shard_name(i: usize, total: usize) -> String {
    format!("model-{:05}-of-{:06}.safetensors", i + 1, total)
}

/// The drafter's tensors (no prefix, as z-lab checkpoints).
pub fn drafter(p: &Preset) -> Vec<Spec> {
    let d = &p.drafter;
    let h = p.text.hidden_size;
    let taps = p.target_layer_ids().len();
    let res = 1.0 / (2.0 * d.num_hidden_layers as f32).sqrt();
    let (q, kv) = (d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim);
    let mut s = vec![
        linear("fc.weight".into(), h, taps * h, 1.0),
        norm("hidden_norm.weight".into(), h),
        norm("norm.weight".into(), h),
    ];
    for l in 0..d.num_hidden_layers {
        let pre = format!("layers.{l}");
        s.push(norm(format!("{pre}.input_layernorm.weight"), h));
        s.push(linear(format!("{pre}.self_attn.q_proj.weight"), q, h, 1.0));
        s.push(linear(format!("{pre}.self_attn.k_proj.weight"), kv, h, 1.0));
        s.push(linear(format!("{pre}.self_attn.v_proj.weight"), kv, h, 1.0));
        s.push(linear(format!("{pre}.self_attn.o_proj.weight"), h, q, res));
        s.push(norm(format!("{pre}.self_attn.q_norm.weight"), d.head_dim));
        s.push(norm(format!("{pre}.self_attn.k_norm.weight"), d.head_dim));
        s.push(norm(format!("{pre}.post_attention_layernorm.weight"), h));
        s.push(linear(
            format!("{pre}.mlp.gate_proj.weight"),
            d.intermediate_size,
            h,
            1.0,
        ));
        s.push(linear(format!("{pre}.mlp.up_proj.weight"), d.intermediate_size, h, 1.0));
        s.push(linear(
            format!("{pre}.mlp.down_proj.weight"),
            h,
            d.intermediate_size,
            res,
        ));
    }
    s
}

fn chunk_rng(seed: u64, name: &str, chunk: usize) -> ChaCha8Rng {
    let mut hsh = Sha256::new();
    hsh.update(seed.to_le_bytes());
    hsh.update((name.len() as u64).to_le_bytes());
    hsh.update(name.as_bytes());
    hsh.update((chunk as u64).to_le_bytes());
    ChaCha8Rng::from_seed(hsh.finalize().into())
}

/// Irwin-Hall(4) standard normal approximation from one u64 (four 16-bit uniforms).
#[inline]
fn std_normal(r: u64) -> f32 {
    let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
    // sum of 4 U(0,1) has mean 2 and variance 1/3
    ((s as f32 + 2.0) / 65536.0 - 2.0) * 1.732_050_8
}

/// Bytes of chunk `c` of `spec` (the last chunk may be short), appended to `out`.
pub fn gen_chunk(spec: &Spec, seed: u64, c: usize, out: &mut Vec<u8>) {
    let total = spec.nbytes();
    let start = c * CHUNK_BYTES;
    let len = CHUNK_BYTES.min(total - start);
    let mut rng = chunk_rng(seed, &spec.name, c);
    out.reserve(len);
    match spec.init {
        Init::Normal { mean, std } => {
            let base = out.len();
            out.resize(base + len, 0);
            for o in out[base..].chunks_exact_mut(2) {
                let v = mean + std * std_normal(rng.next_u64());
                o.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        Init::NormalF32 { std } => {
            for _ in 0..len / 4 {
                out.extend_from_slice(&(std * std_normal(rng.next_u64())).to_le_bytes());
            }
        }
        Init::Nibbles => {
            // 8 random bits per nibble through Q_TABLE, stored as offset-8 codes (low nibble = even k).
            let code = |r: u64| (Q_TABLE[(r & 0xFF) as usize] + 8) as u8;
            let mut left = len;
            while left > 0 {
                let r = rng.next_u64();
                for j in 0..4.min(left) {
                    let rj = r >> (16 * j);
                    out.push(code(rj) | code(rj >> 8) << 4);
                }
                left -= 4.min(left);
            }
        }
        Init::Scales { std } => {
            let base = std / NIBBLE_Q_STD;
            for _ in 0..len / 2 {
                let u = (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
                out.extend_from_slice(&bf16::from_f32(base * (0.8 + 0.4 * u)).to_le_bytes());
            }
        }
        Init::Shape { n, k } => match spec.dtype {
            Dtype::I64 => {
                out.extend_from_slice(&(n as i64).to_le_bytes());
                out.extend_from_slice(&(k as i64).to_le_bytes());
            }
            _ => {
                out.extend_from_slice(&(n as i32).to_le_bytes());
                out.extend_from_slice(&(k as i32).to_le_bytes());
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q_table_is_full_near_symmetric_and_its_std_is_right() {
        let mut hist = [0usize; 16];
        for &q in &Q_TABLE {
            hist[(q + 8) as usize] += 1;
        }
        assert!(hist.iter().all(|&c| c > 0), "{hist:?}");
        assert_eq!(hist[0], 2);
        let mean = Q_TABLE.iter().map(|&q| q as f64).sum::<f64>() / 256.0;
        let var = Q_TABLE.iter().map(|&q| (q as f64 - mean).powi(2)).sum::<f64>() / 256.0;
        assert!((mean + 1.0 / 16.0).abs() < 1e-9);
        assert!((var.sqrt() - NIBBLE_Q_STD as f64).abs() < 1e-3);
    }
}
