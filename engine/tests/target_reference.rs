//! The CPU target against an independent f64 transcription of k26-format §4 (written from the spec, not
//! from engine code): HF-style rope (permute the rope dims, then NeoX rotate_half), explicit causal
//! softmax attention with per-head expanded k/v, INT4 decoded from the 32-bit-word view of §3.2, and the
//! transformers router (sigmoid, bias for selection, top-2 group scores, masked_fill 0, top-k, normalise,
//! scale). Whole unsplit tensors come straight from `model::testing::random_tensors`.

use kdtree_engine::api::Target;
use kdtree_engine::model::testing::{random_tensors, tiny_config, PREFIX};
use kdtree_engine::model::{AttnMode, CpuTarget, MemSource, MemTensor, TensorSource, Weights};
use kdtree_formats::config::TextConfig;
use kdtree_formats::plan::ExpertsMode;
use std::collections::HashMap;
use std::sync::Arc;

/// f32 engine vs f64 reference, relative to the largest |logit|. Measured ≤ 2e-6; 25x.
const REF_REL: f64 = 5e-5;

struct Ref<'a> {
    t: &'a TextConfig,
    m: &'a HashMap<String, MemTensor>,
}

fn mm(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
    // x [T, K] · w [N, K]^T → [T, N]
    let (t, n) = (x.len() / k, w.len() / k);
    let mut y = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|c| x[i * k + c] * w[j * k + c]).sum();
        }
    }
    y
}

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
            r.iter().zip(w).map(move |(v, g)| g * v * inv)
        })
        .collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

impl Ref<'_> {
    fn get(&self, name: &str) -> Vec<f64> {
        let t = &self.m[&format!("{PREFIX}{name}")];
        match t.dtype {
            kdtree_formats::Dtype::BF16 => t
                .data
                .chunks(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
                .collect(),
            kdtree_formats::Dtype::F32 => t
                .data
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                .collect(),
            d => panic!("{name}: dtype {d}"),
        }
    }
    /// Expert `e` of `{stem}.{proj}` decoded per §3.2: word = packed[n][k/8] (LE), u = word >> 4(k%8) & 15.
    fn expert(&self, stem: &str, e: usize) -> (Vec<f64>, usize) {
        let p = &self.m[&format!("{PREFIX}{stem}.weight_packed")];
        let s = self.get(&format!("{stem}.weight_scale"));
        let (n, k) = (p.shape[1], p.shape[2]);
        let mut w = vec![0.0; n * k];
        for r in 0..n {
            let row = &p.data[(e * n + r) * k / 2..(e * n + r + 1) * k / 2];
            for c in 0..k {
                let word = u32::from_le_bytes(row[c / 8 * 4..c / 8 * 4 + 4].try_into().unwrap());
                let q = ((word >> (4 * (c % 8))) & 0xF) as f64 - 8.0;
                w[r * k + c] = q * s[(e * n + r) * (k / 32) + c / 32];
            }
        }
        (w, k)
    }
    fn swiglu(&self, p: &str, x: &[f64]) -> Vec<f64> {
        let h = self.t.hidden_size;
        let g = mm(x, &self.get(&format!("{p}gate_proj.weight")), h);
        let u = mm(x, &self.get(&format!("{p}up_proj.weight")), h);
        let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        mm(&a, &self.get(&format!("{p}down_proj.weight")), a.len() / (x.len() / h))
    }

    /// Logits [T, V] of a causal chain of `ids` from position 0.
    fn forward(&self, ids: &[u32]) -> Vec<f64> {
        let t = self.t;
        let (h, nh, n) = (t.hidden_size, t.num_attention_heads, ids.len());
        let (dn, dr, dv, c) = (t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank);
        let qk = dn + dr;
        let emb = self.get("model.embed_tokens.weight");
        let mut x: Vec<f64> = ids
            .iter()
            .flat_map(|&i| emb[i as usize * h..(i as usize + 1) * h].to_vec())
            .collect();
        // YaRN inv_freq, k26-format §4.4.
        let s = t.rope_scaling.as_ref().unwrap();
        let base = t.rope_theta;
        let corr = |r: f64| {
            dr as f64 * (s.original_max_position_embeddings as f64 / (r * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let (low, high) = (
            corr(s.beta_fast).floor().max(0.0),
            corr(s.beta_slow).ceil().min(dr as f64 - 1.0),
        );
        let inv: Vec<f64> = (0..dr / 2)
            .map(|i| {
                let extra = base.powf(-2.0 * i as f64 / dr as f64);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                extra / s.factor * ramp + extra * (1.0 - ramp)
            })
            .collect();
        // HF rope: permute [x0,x2,..,x1,x3,..], then x*cos + rotate_half(x)*sin with cos = cat(f, f).
        let rope = |v: &[f64], pos: usize| -> Vec<f64> {
            let p: Vec<f64> = (0..dr / 2)
                .map(|i| v[2 * i])
                .chain((0..dr / 2).map(|i| v[2 * i + 1]))
                .collect();
            (0..dr)
                .map(|j| {
                    let f = inv[j % (dr / 2)] * pos as f64;
                    let rot = if j < dr / 2 { -p[j + dr / 2] } else { p[j - dr / 2] };
                    p[j] * f.cos() + rot * f.sin()
                })
                .collect()
        };
        let mscale = 0.1 * s.mscale_all_dim * s.factor.ln() + 1.0;
        let scale = (qk as f64).powf(-0.5) * mscale * mscale;
        for l in 0..t.num_hidden_layers {
            let p = format!("model.layers.{l}.");
            let a = format!("{p}self_attn.");
            let xn = rms(&x, &self.get(&format!("{p}input_layernorm.weight")), t.rms_norm_eps);
            let q = match t.q_lora_rank {
                Some(ql) => {
                    let cq = rms(
                        &mm(&xn, &self.get(&format!("{a}q_a_proj.weight")), h),
                        &self.get(&format!("{a}q_a_layernorm.weight")),
                        1e-6,
                    );
                    mm(&cq, &self.get(&format!("{a}q_b_proj.weight")), ql)
                }
                None => mm(&xn, &self.get(&format!("{a}q_proj.weight")), h),
            };
            let ckv = mm(&xn, &self.get(&format!("{a}kv_a_proj_with_mqa.weight")), h); // [n, c + dr]
            let lat: Vec<f64> = (0..n)
                .flat_map(|i| {
                    rms(
                        &ckv[i * (c + dr)..i * (c + dr) + c],
                        &self.get(&format!("{a}kv_a_layernorm.weight")),
                        1e-6,
                    )
                })
                .collect();
            let kv = mm(&lat, &self.get(&format!("{a}kv_b_proj.weight")), c); // [n, nh*(dn+dv)]
            let kpe: Vec<Vec<f64>> = (0..n)
                .map(|i| rope(&ckv[i * (c + dr) + c..(i + 1) * (c + dr)], i))
                .collect();
            let mut heads = vec![0.0; n * nh * dv];
            for i in 0..n {
                for hh in 0..nh {
                    let qh = &q[(i * nh + hh) * qk..(i * nh + hh + 1) * qk];
                    let qpe = rope(&qh[dn..], i);
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kh = &kv[(j * nh + hh) * (dn + dv)..];
                            ((0..dn).map(|d| qh[d] * kh[d]).sum::<f64>()
                                + (0..dr).map(|d| qpe[d] * kpe[j][d]).sum::<f64>())
                                * scale
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                    for (j, sj) in sc.iter().enumerate() {
                        for d in 0..dv {
                            heads[(i * nh + hh) * dv + d] +=
                                (sj - m).exp() / z * kv[(j * nh + hh) * (dn + dv) + dn + d];
                        }
                    }
                }
            }
            let o = mm(&heads, &self.get(&format!("{a}o_proj.weight")), nh * dv);
            x.iter_mut().zip(&o).for_each(|(r, v)| *r += v);
            let xn = rms(
                &x,
                &self.get(&format!("{p}post_attention_layernorm.weight")),
                t.rms_norm_eps,
            );
            let mlp = format!("{p}mlp.");
            let out = if !t.is_moe_layer(l) {
                self.swiglu(&mlp, &xn)
            } else {
                let e = t.n_routed_experts;
                let logits = mm(&xn, &self.get(&format!("{mlp}gate.weight")), h);
                let bias = self.get(&format!("{mlp}gate.e_score_correction_bias"));
                let mut out = vec![0.0; n * h];
                for i in 0..n {
                    let sg: Vec<f64> = logits[i * e..(i + 1) * e]
                        .iter()
                        .map(|z| 1.0 / (1.0 + (-z).exp()))
                        .collect();
                    let mut sel: Vec<f64> = sg.iter().zip(&bias).map(|(a, b)| a + b).collect();
                    let gs = e / t.n_group;
                    let mut gscore: Vec<(f64, usize)> = (0..t.n_group)
                        .map(|g| {
                            let mut v = sel[g * gs..(g + 1) * gs].to_vec();
                            v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                            (v[0] + v[1], g)
                        })
                        .collect();
                    gscore.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
                    let keep: Vec<usize> = gscore[..t.topk_group].iter().map(|g| g.1).collect();
                    for (j, v) in sel.iter_mut().enumerate() {
                        if !keep.contains(&(j / gs)) {
                            *v = 0.0;
                        }
                    }
                    let mut order: Vec<usize> = (0..e).collect();
                    order.sort_by(|&a, &b| sel[b].partial_cmp(&sel[a]).unwrap());
                    let top = &order[..t.num_experts_per_tok];
                    let den: f64 = top.iter().map(|&j| sg[j]).sum::<f64>() + 1e-20;
                    let xi = &xn[i * h..(i + 1) * h];
                    for &ex in top {
                        let wt = sg[ex] / den * t.routed_scaling_factor;
                        let stem = format!("{mlp}experts");
                        let (g, k) = self.expert(&format!("{stem}.gate_proj"), ex);
                        let (u, _) = self.expert(&format!("{stem}.up_proj"), ex);
                        let (d, kd) = self.expert(&format!("{stem}.down_proj"), ex);
                        let a: Vec<f64> = mm(xi, &g, k)
                            .iter()
                            .zip(mm(xi, &u, k))
                            .map(|(g, u)| silu(*g) * u)
                            .collect();
                        let y = mm(&a, &d, kd);
                        (0..h).for_each(|dd| out[i * h + dd] += wt * y[dd]);
                    }
                }
                let sh = self.swiglu(&format!("{mlp}shared_experts."), &xn);
                out.iter().zip(&sh).map(|(a, b)| a + b).collect()
            };
            x.iter_mut().zip(&out).for_each(|(r, v)| *r += v);
        }
        let xn = rms(&x, &self.get("model.norm.weight"), t.rms_norm_eps);
        mm(&xn, &self.get("lm_head.weight"), h)
    }
}

#[test]
fn cpu_target_matches_f64_spec_transcription() {
    let ids = [5u32, 17, 90, 3, 3, 64, 41];
    for q_lora in [Some(32), None] {
        let cfg = tiny_config(q_lora);
        let tensors = random_tensors(&cfg, 11);
        let want = Ref { t: &cfg, m: &tensors }.forward(&ids);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let src: Arc<dyn TensorSource> =
            Arc::new(MemSource::new(cfg.clone(), PREFIX, &tensors, 1, ExpertsMode::Tp).unwrap());
        let w = Arc::new(Weights::load(src).unwrap());
        for mode in [AttnMode::Naive, AttnMode::Absorbed] {
            let mut t = CpuTarget::new(w.clone(), vec![], mode).unwrap();
            let got = t
                .forward(&ids, &(0..ids.len() as i32).map(|i| i - 1).collect::<Vec<_>>())
                .unwrap()
                .logits;
            let err = got
                .iter()
                .zip(&want)
                .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
                / scale;
            println!("q_lora={q_lora:?} {mode:?}: max rel vs f64 reference {err:e} (max |logit| {scale:.3})");
            assert!(err < REF_REL, "q_lora={q_lora:?} {mode:?}: rel {err} vs f64 reference");
        }
    }
}
