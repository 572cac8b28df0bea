//! The CPU backend's compute ops (`backend::Compute`): each the cpu/ops function named in its body, with the
//! same arguments in the same order.

use super::backend::{CpuBackend, CpuRoutes};
use super::cache::LatentCache;
use super::ops;
use crate::backend::{AttnMode, Compute, I4Stack, Mat, PosOf, RopeTable, Slab, Visibility, VocabShards};
use anyhow::Result;
use half::bf16;

impl Compute for CpuBackend {
    fn decide_rows(
        &self,
        logits: &Vec<f32>,
        row0: usize,
        rows: usize,
        vocab: usize,
        s: &crate::sampling::Sampling,
        base: PosOf<'_, Self>,
        offset: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let end = row0 + rows;
        anyhow::ensure!(
            logits.len() >= end * vocab && out.len() >= end,
            "decide_rows: {} logits / {} outputs for rows {row0}..{end} of {vocab}",
            logits.len(),
            out.len()
        );
        let b = match base {
            PosOf::Kv(kv) => kv.committed,
            PosOf::Pos(p) => *p,
        };
        for i in 0..rows {
            let r = row0 + i;
            out[r] = crate::sampling::sample(&logits[r * vocab..(r + 1) * vocab], s, b + offset + i);
        }
        Ok(())
    }
    fn rope_at(
        &self,
        inv_freq: &Slab<f32>,
        factor: f64,
        base: PosOf<'_, Self>,
        offsets: Option<&Vec<u32>>,
        t: usize,
    ) -> RopeTable {
        let b = match base {
            PosOf::Kv(kv) => kv.committed,
            PosOf::Pos(p) => *p,
        };
        let offs: Vec<usize> = match offsets {
            Some(o) => o[..t].iter().map(|&d| d as usize).collect(),
            None => (0..t).collect(),
        };
        RopeTable::new(inv_freq, offs.into_iter().map(|o| b + o), factor)
    }
    fn rms_norm_in(&self, x: &Vec<f32>, w: &Slab<bf16>, eps: f32) -> Vec<f32> {
        self.rms_norm(x, w, eps)
    }
    fn silu_mul_in(&self, gate: &Vec<f32>, up: &Vec<f32>) -> Vec<f32> {
        self.silu_mul(gate, up)
    }
    fn add_rms_norm_in(&self, x: &mut Vec<f32>, a: &Vec<f32>, w: &Slab<bf16>, eps: f32) -> Vec<f32> {
        self.add(x, a);
        self.rms_norm(x, w, eps)
    }
    fn mla_attention_in(
        &self,
        q: &Vec<f32>,
        t: usize,
        kv: &LatentCache,
        l: usize,
        mask: &Visibility,
        kv_b: &Mat,
        d: &ops::MlaDims,
        mode: AttnMode,
    ) -> Vec<f32> {
        self.mla_attention(q, t, kv, l, mask, kv_b, d, mode)
    }
    fn mla_attention_segs_in(
        &self,
        q: &Vec<f32>,
        segs: &[(&LatentCache, &Visibility, usize)],
        l: usize,
        kv_b: &Mat,
        d: &ops::MlaDims,
        mode: AttnMode,
    ) -> Vec<f32> {
        self.mla_attention_segs(q, segs, l, kv_b, d, mode)
    }
    fn lin_in(&self, x: &Vec<f32>) -> Vec<f32> {
        x.clone()
    }
    fn linear_in(&self, x: &Vec<f32>, t: usize, w: &Mat) -> Vec<f32> {
        self.linear(x, t, w)
    }
    fn linear(&self, x: &Vec<f32>, t: usize, w: &Mat) -> Vec<f32> {
        ops::matmul_bf16(x, &w.w, t, w.cols, w.rows)
    }
    fn rms_norm(&self, x: &Vec<f32>, w: &Slab<bf16>, eps: f32) -> Vec<f32> {
        ops::rms_norm(x, w, eps)
    }
    fn add(&self, acc: &mut Vec<f32>, x: &Vec<f32>) {
        ops::add_assign(acc, x);
    }
    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>) -> Vec<f32> {
        ops::silu_mul(gate, up)
    }
    fn all_reduce(&self, partials: Vec<Vec<f32>>) -> Vec<f32> {
        // With a group, `0 + p0 + p1 + …` over the group's ranks is the same chain of adds as here, when each
        // rank thread holds one rank.
        match (&self.comm, partials.as_slice()) {
            (Some(_), [one]) => self.group_sum(one.clone()),
            _ => {
                let n = partials.first().map_or(0, Vec::len);
                self.group_sum(ops::all_reduce_sum(&partials, n))
            }
        }
    }
    fn embedding(&self, v: &VocabShards<'_, Mat>, h: usize, tokens: &[u32]) -> Vec<f32> {
        let s: Vec<&[bf16]> = v.mats.iter().map(|m| &m.w[..]).collect();
        if v.whole(|m| m.rows) {
            return ops::embedding_bf16(&s, h, tokens);
        }
        // This group's rows; the other groups' ids stay zero until the sum.
        let (lo, hi) = (v.first, v.first + v.mats.iter().map(|m| m.rows).sum::<usize>());
        let mut out = vec![0f32; tokens.len() * h];
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            assert!(t < v.vocab, "embedding_bf16: token {t} >= vocab {}", v.vocab);
            if (lo..hi).contains(&t) {
                out[i * h..(i + 1) * h].copy_from_slice(&ops::embedding_bf16(&s, h, &[(t - lo) as u32]));
            }
        }
        self.group_sum(out)
    }
    fn embedding_ids(&self, v: &VocabShards<'_, Mat>, h: usize, ids: &Vec<u32>, n: usize) -> Vec<f32> {
        self.embedding(v, h, &ids[..n])
    }
    fn lm_head(&self, x: &Vec<f32>, n: usize, h: usize, v: &VocabShards<'_, Mat>) -> Vec<f32> {
        let s: Vec<&[bf16]> = v.mats.iter().map(|m| &m.w[..]).collect();
        let local = ops::lm_head_bf16(x, n, h, &s);
        if v.whole(|m| m.rows) {
            return local;
        }
        // This group's columns of the global [n, V]; the other groups' columns are summed in.
        let w = local.len() / n.max(1);
        let mut out = vec![0f32; n * v.vocab];
        for i in 0..n {
            out[i * v.vocab + v.first..i * v.vocab + v.first + w].copy_from_slice(&local[i * w..(i + 1) * w]);
        }
        self.group_sum(out)
    }
    fn lm_head_argmax_into(
        &self,
        x: &Vec<f32>,
        n: usize,
        h: usize,
        v: &VocabShards<'_, Mat>,
        out: &mut Vec<u32>,
        row0: usize,
    ) -> Result<()> {
        anyhow::ensure!(
            out.len() >= row0 + n,
            "lm_head_argmax: {} outputs for rows {row0}..{}",
            out.len(),
            row0 + n
        );
        let s: Vec<&[bf16]> = v.mats.iter().map(|m| &m.w[..]).collect();
        if v.whole(|m| m.rows) {
            out[row0..row0 + n].copy_from_slice(&ops::lm_head_argmax_bf16(x, n, h, &s));
            return Ok(());
        }
        // Each local shard's (value, global id) in its slot of [n, slots, 2], the other groups' slots summed in
        // (exact: each slot is nonzero on one group only), then the merge in slot (global vocab) order.
        let (slots, slot0) = v.slots(|m| m.rows).map_err(anyhow::Error::msg)?;
        let mut pairs = vec![0f32; n * slots * 2];
        for (j, w) in s.iter().enumerate() {
            let vr = w.len() / h;
            ops::argmax_pairs(
                &ops::matmul_bf16(x, w, n, h, vr),
                n,
                v.first + j * vr,
                &mut pairs,
                slot0 + j,
                slots,
            );
        }
        let pairs = self.group_sum(pairs);
        for i in 0..n {
            out[row0 + i] = ops::merge_argmax_pairs(&pairs[i * slots * 2..(i + 1) * slots * 2]);
        }
        Ok(())
    }
    fn kv_append_latent_segs(
        &self,
        segs: &mut [(&mut LatentCache, usize)],
        l: usize,
        ckv: &Vec<f32>,
        norm: &Slab<bf16>,
        eps: f32,
        width: usize,
        rope_all: &RopeTable,
    ) {
        // Each segment alone, with its rows of the stacked table.
        let (mut at, half) = (0, rope_all.half);
        for (kv, ts) in segs.iter_mut() {
            let rope = RopeTable {
                half,
                cos: rope_all.cos[at * half..(at + *ts) * half].to_vec(),
                sin: rope_all.sin[at * half..(at + *ts) * half].to_vec(),
            };
            self.kv_append_latent(kv, l, &ckv[at * width..(at + *ts) * width].to_vec(), norm, eps, &rope);
            at += *ts;
        }
    }
    fn kv_append_latent(
        &self,
        kv: &mut LatentCache,
        l: usize,
        ckv: &Vec<f32>,
        norm: &Slab<bf16>,
        eps: f32,
        rope: &RopeTable,
    ) {
        let (c, w) = (norm.len(), kv.width);
        let t = ckv.len() / w;
        let mut rows = vec![0f32; t * w]; // [T, C + P]
        for i in 0..t {
            let src = &ckv[i * w..(i + 1) * w];
            let dst = &mut rows[i * w..(i + 1) * w];
            dst[..c].copy_from_slice(&ops::rms_norm(&src[..c], norm, eps));
            dst[c..].copy_from_slice(&src[c..]);
            let (cos, sin) = rope.row(i);
            ops::rope_interleaved(&mut dst[c..], cos, sin);
        }
        kv.append(l, &rows);
    }
    fn rope_q(&self, q: &mut Vec<f32>, heads: usize, nope: usize, rope: &RopeTable) {
        let (p, t) = (2 * rope.half, rope.cos.len() / rope.half.max(1));
        let qk = nope + p;
        for i in 0..t {
            let (cos, sin) = rope.row(i);
            for hh in 0..heads {
                let base = i * heads * qk + hh * qk + nope;
                ops::rope_interleaved(&mut q[base..base + p], cos, sin);
            }
        }
    }
    fn mla_attention(
        &self,
        q: &Vec<f32>,
        _t: usize,
        kv: &LatentCache,
        l: usize,
        mask: &Visibility,
        kv_b: &Mat,
        d: &ops::MlaDims,
        mode: AttnMode,
    ) -> Vec<f32> {
        let (committed, lat) = (kv.committed, &kv.rows[l]); // [committed + T, C + P]
        match mode {
            AttnMode::Naive => {
                // k_nope | v of every cached row, [S_all, Hr * (Dn + Dv)].
                let n_all = committed + mask.rows;
                let latents: Vec<f32> = lat
                    .chunks(kv.width)
                    .take(n_all)
                    .flat_map(|r| r[..d.kv_lora].to_vec())
                    .collect();
                let expanded = self.linear(&latents, n_all, kv_b);
                ops::mla_attention(d, q, lat, committed, mask, ops::MlaKv::Expanded(&expanded))
            }
            AttnMode::Absorbed => ops::mla_attention(d, q, lat, committed, mask, ops::MlaKv::Absorbed(&kv_b.w)),
        }
    }
    fn moe_route(&self, logits: &Vec<f32>, t: usize, r: &ops::Router, bias: Option<&Slab<f32>>) -> CpuRoutes {
        let e = r.n_experts;
        let bias = bias.map(|b| &b[..]);
        let per_token: Vec<(Vec<usize>, Vec<f32>)> = (0..t)
            .map(|i| ops::moe_route(r, &logits[i * e..(i + 1) * e], bias))
            .collect();
        let per_expert = ops::tokens_per_expert(&per_token, e);
        CpuRoutes { per_token, per_expert }
    }
    fn routes_to_host(&self, routes: &CpuRoutes) -> (Vec<i32>, Vec<f32>) {
        let ids = routes
            .per_token
            .iter()
            .flat_map(|(ids, _)| ids.iter().map(|&i| i as i32))
            .collect();
        let wts = routes.per_token.iter().flat_map(|(_, w)| w.iter().copied()).collect();
        (ids, wts)
    }
    fn moe_experts(
        &self,
        x: &Vec<f32>,
        t: usize,
        h: usize,
        routes: &CpuRoutes,
        gate: &I4Stack,
        up: &I4Stack,
        down: &I4Stack,
    ) -> Vec<f32> {
        ops::moe_experts_i4g32(x, t, h, &routes.per_expert, |ex| {
            gate.holds(ex)
                .then(|| [gate.expert(ex), up.expert(ex), down.expert(ex)])
        })
    }
    fn head_norm_rope_neox(&self, x: &Vec<f32>, w: &Slab<bf16>, eps: f32, heads: usize, rope: &RopeTable) -> Vec<f32> {
        let dd = w.len();
        let mut y = ops::rms_norm(x, w, eps); // rows·heads vectors of D
        for (r, row) in y.chunks_mut(heads * dd).enumerate() {
            let (cos, sin) = rope.row(r);
            for hv in row.chunks_mut(dd) {
                ops::rope_neox(hv, cos, sin);
            }
        }
        y
    }
    #[allow(clippy::too_many_arguments)]
    fn gqa_attention(
        &self,
        q: &Vec<f32>,
        b: usize,
        ctx: (&Vec<f32>, &Vec<f32>),
        ctx_len: &usize,
        block: (&Vec<f32>, &Vec<f32>),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Vec<f32> {
        let n = ctx_len * kv_heads * head_dim;
        ops::gqa_attention(
            q,
            b,
            (&ctx.0[..n], &ctx.1[..n]),
            (block.0, block.1),
            heads,
            kv_heads,
            head_dim,
        )
    }
}
