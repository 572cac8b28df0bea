//! [`CpuBackend`]: the reference implementation of `backend::Backend` with the cpu/ops files.
//!
//! Activations are host `Vec<f32>`; uploads are identity moves, so weights stay zero-copy `Slab` views of
//! the mmapped shards; the latent cache is `model::cache::LatentCache`. Every op is the cpu/ops function
//! named in its body, with the same arguments in the same order, so the model's results are those of the
//! ops (bit for bit: golden/regen.sh --check). Tests: engine/tests/target_*.rs, ddtree_drafter.rs.

use super::ops;
use crate::backend::{Backend, PosOf, RopeTable, VocabShards, WeightRef};
use crate::ddtree::{build_tree_from_top_k, top_k_log_probs, walk_sampled, DraftTree, Visibility, Walk};
use crate::model::cache::LatentCache;
use crate::model::source::Slab;
use crate::model::weights::{I4Stack, Mat};
use crate::model::AttnMode;
use anyhow::Result;
use half::bf16;

/// The CPU reference backend (rayon, f32 accumulation, fixed reduction order). `comm`: this rank's group
/// when the ranks of a run are threads of their own (`crate::tp`), None when one backend holds them all.
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    pub comm: Option<super::comm::HostRank>,
    /// Check every weight's bytes against the manifest's checksum at load ([`Backend::checks_weights`]): on
    /// the CPU the weights are the mmapped shard bytes, so this finds a damaged shard file.
    pub check_weights: bool,
}

impl CpuBackend {
    /// The backend of rank `c.rank` of a group of rank threads.
    pub fn with_comm(c: super::comm::HostRank) -> CpuBackend {
        CpuBackend {
            comm: Some(c),
            check_weights: false,
        }
    }
    /// `x` summed over the group (identity without one). A failed group (a rank died) is a panic here, which
    /// the rank thread turns into that rank's error (ops are infallible on the CPU).
    fn group_sum(&self, x: Vec<f32>) -> Vec<f32> {
        match &self.comm {
            None => x,
            Some(c) => c
                .group
                .all_reduce(c.rank, x)
                .unwrap_or_else(|why| panic!("tensor-parallel group: {why}")),
        }
    }
}

/// The CPU tree workspace: the last build's tree, depths and mask and the last walk (`ddtree`). The device
/// round uses it only for trees that fill the budget (`ddtree::tree_is_full`: budget + 1 nodes).
pub struct CpuTree {
    pub budget: usize,
    /// Top-K per draft row.
    pub k: usize,
    pub rows: usize,
    pub vocab: usize,
    pub tree: DraftTree,
    pub depths: Vec<u32>,
    pub mask: Visibility,
    pub walk: Option<Walk>,
    /// The root token `[1]` of the next build.
    pub root: Vec<u32>,
}

/// One MoE layer's router decisions: per token (experts, weights), and per expert its (token, weight)s.
pub struct CpuRoutes {
    pub per_token: Vec<(Vec<usize>, Vec<f32>)>,
    pub per_expert: Vec<Vec<(usize, f32)>>,
}

impl Backend for CpuBackend {
    type Act = Vec<f32>;
    type Mat = Mat;
    type I4 = I4Stack;
    type Vector = Slab<bf16>;
    type VectorF32 = Slab<f32>;
    type Kv = LatentCache;
    type Routes = CpuRoutes;
    type Ids = Vec<u32>;
    type Rope = RopeTable;
    type Mask = Visibility;
    type Tree = CpuTree;
    type Pos = usize;
    type Graph = ();

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload_bf16(&self, m: Mat) -> Result<Mat> {
        Ok(m)
    }
    fn upload_i4g32(&self, s: I4Stack) -> Result<I4Stack> {
        Ok(s)
    }
    fn upload_vector(&self, v: Slab<bf16>) -> Result<Slab<bf16>> {
        Ok(v)
    }
    fn upload_vector_f32(&self, v: Slab<f32>) -> Result<Slab<f32>> {
        Ok(v)
    }
    fn mat_rows(&self, m: &Mat) -> usize {
        m.rows
    }
    fn checks_weights(&self) -> bool {
        self.check_weights
    }
    fn weight_xxh3(&self, w: WeightRef<'_, Self>) -> Result<Vec<u64>> {
        use kdtree_formats::manifest::xxh3_64;
        Ok(match w {
            WeightRef::Mat(m) => vec![xxh3_64(bytemuck::cast_slice(&m.w[..]))],
            WeightRef::Vector(v) => vec![xxh3_64(bytemuck::cast_slice(&v[..]))],
            WeightRef::VectorF32(v) => vec![xxh3_64(bytemuck::cast_slice(&v[..]))],
            WeightRef::I4(s) => vec![xxh3_64(&s.packed[..]), xxh3_64(bytemuck::cast_slice(&s.scales[..]))],
        })
    }

    fn rope_upload(&self, r: RopeTable) -> RopeTable {
        r
    }
    fn rope_gather(&self, r: &RopeTable, idx: &Vec<u32>, t: usize) -> RopeTable {
        let (mut cos, mut sin) = (Vec::with_capacity(t * r.half), Vec::with_capacity(t * r.half));
        for &i in &idx[..t] {
            let (c, s) = r.row(i as usize);
            cos.extend_from_slice(c);
            sin.extend_from_slice(s);
        }
        RopeTable { half: r.half, cos, sin }
    }
    fn mask_upload(&self, v: &Visibility) -> Visibility {
        v.clone()
    }
    fn ids_from_host(&self, ids: &[u32]) -> Vec<u32> {
        ids.to_vec()
    }
    fn ids_copy(&self, dst: &mut Vec<u32>, at: usize, src: &Vec<u32>, n: usize) {
        dst[at..at + n].copy_from_slice(&src[..n]);
    }
    fn ids_write(&self, dst: &mut Vec<u32>, at: usize, host: &[u32]) -> Result<()> {
        anyhow::ensure!(
            at + host.len() <= dst.len(),
            "ids_write: {} ids at {at} of {}",
            host.len(),
            dst.len()
        );
        dst[at..at + host.len()].copy_from_slice(host);
        Ok(())
    }
    fn ids_to_host(&self, ids: &Vec<u32>) -> Result<Vec<u32>> {
        Ok(ids.clone())
    }
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
    fn pos_new(&self, v: usize) -> usize {
        v
    }
    fn pos_get(&self, p: &usize) -> usize {
        *p
    }
    fn pos_set(&self, p: &mut usize, v: usize) {
        *p = v;
    }
    fn pos_add(&self, p: &mut usize, n: usize) {
        *p += n;
    }

    fn act_from_host(&self, x: Vec<f32>) -> Vec<f32> {
        x
    }
    fn to_host(&self, x: &Vec<f32>) -> Vec<f32> {
        x.clone()
    }
    fn rows(&self, x: &Vec<f32>, cols: usize, from: usize, to: usize) -> Vec<f32> {
        x[from * cols..to * cols].to_vec()
    }
    fn append_rows(&self, acc: &mut Vec<f32>, x: &Vec<f32>) {
        acc.extend_from_slice(x);
    }
    fn truncate(&self, x: &mut Vec<f32>, n: usize) {
        x.truncate(n);
    }
    fn set_rows(&self, dst: &mut Vec<f32>, cols: usize, at: usize, src: &Vec<f32>, n: usize) {
        dst[at * cols..(at + n) * cols].copy_from_slice(&src[..n * cols]);
    }
    fn set_cols(&self, dst: &mut Vec<f32>, dst_cols: usize, at: usize, src: &Vec<f32>, src_cols: usize, t: usize) {
        for i in 0..t {
            dst[i * dst_cols + at..i * dst_cols + at + src_cols]
                .copy_from_slice(&src[i * src_cols..(i + 1) * src_cols]);
        }
    }
    fn zeros(&self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }
    fn reserve_rows(&self, _x: &mut Vec<f32>, _cols: usize, _rows: usize) -> bool {
        false // write_rows_at grows the Vec; nothing is captured on the CPU
    }
    fn write_rows_at(&self, dst: &mut Vec<f32>, cols: usize, at: &usize, src: &Vec<f32>, n: usize) {
        let (from, to) = (at * cols, (at + n) * cols);
        if dst.len() < to {
            dst.resize(to, 0.0);
        }
        dst[from..to].copy_from_slice(&src[..n * cols]);
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

    fn kv_new(&self, layers: usize, width: usize) -> LatentCache {
        LatentCache::new(layers, width)
    }
    fn kv_committed(&self, kv: &LatentCache) -> usize {
        kv.committed
    }
    fn kv_reserve(&self, _kv: &mut LatentCache, _rows: usize) -> Result<()> {
        Ok(())
    }
    fn kv_id(&self, _kv: &LatentCache) -> u64 {
        0
    }
    fn kv_drop_scratch(&self, kv: &mut LatentCache) {
        kv.drop_scratch();
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
    fn kv_set_scratch(&self, kv: &mut LatentCache, t: usize) {
        kv.scratch = t;
    }
    fn kv_compact(&self, kv: &mut LatentCache, path: &[usize]) -> Result<()> {
        kv.commit(path)
    }
    fn kv_commit_rows(&self, kv: &mut LatentCache, n: usize) -> Result<()> {
        kv.commit(&(0..n).collect::<Vec<_>>())
    }
    fn kv_commit_rows_host(&self, _kv: &mut LatentCache, _n: usize) {
        // kv_commit_rows already moved the host state: the CPU has no other copy.
    }
    fn kv_truncate(&self, kv: &mut LatentCache, len: usize) -> Result<()> {
        kv.truncate(len)
    }
    fn kv_reset(&self, kv: &mut LatentCache) {
        kv.reset();
    }
    fn kv_row_bytes(&self, kv: &LatentCache) -> usize {
        kv.rows.len() * kv.width * std::mem::size_of::<f32>()
    }
    fn kv_release(&self, kv: &mut LatentCache) {
        kv.reset();
        kv.rows.iter_mut().for_each(|r| *r = Vec::new());
    }
    fn rope_cat(&self, ropes: &[&RopeTable]) -> RopeTable {
        let half = ropes.first().map_or(0, |r| r.half);
        RopeTable {
            half,
            cos: ropes.iter().flat_map(|r| r.cos.iter().copied()).collect(),
            sin: ropes.iter().flat_map(|r| r.sin.iter().copied()).collect(),
        }
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

    fn tree_new(&self, budget: usize, rows: usize, vocab: usize, k: usize) -> Result<CpuTree> {
        let tree = DraftTree::root_only(0);
        anyhow::ensure!((1..=vocab).contains(&k), "tree_new: top-{k} of a vocabulary of {vocab}");
        Ok(CpuTree {
            budget,
            k,
            rows,
            vocab,
            depths: vec![0],
            mask: tree.visibility.clone(),
            tree,
            walk: None,
            root: vec![0],
        })
    }
    fn tree_build(&self, t: &mut CpuTree, draft: &Vec<f32>, row0: usize) -> Result<()> {
        // build_tree is this with k = min(budget, vocab); the chain takes k = 1.
        t.tree = if t.budget == 0 || t.rows == 0 {
            DraftTree::root_only(t.root[0])
        } else {
            let (from, to) = (row0 * t.vocab, (row0 + t.rows) * t.vocab);
            anyhow::ensure!(
                draft.len() >= to,
                "tree_build: {} draft logits for rows {row0}..{} of {}",
                draft.len(),
                row0 + t.rows,
                t.vocab
            );
            build_tree_from_top_k(
                t.root[0],
                &top_k_log_probs(&draft[from..to], t.rows, t.vocab, t.k),
                t.budget,
            )
        };
        t.depths = t.tree.depths.clone();
        t.mask = t.tree.visibility.clone();
        t.walk = None;
        Ok(())
    }
    fn tree_set_root(&self, t: &mut CpuTree, root: u32) -> Result<()> {
        t.root[0] = root;
        Ok(())
    }
    fn tree_root<'t>(&self, t: &'t CpuTree) -> &'t Vec<u32> {
        &t.root
    }
    fn tree_tokens<'t>(&self, t: &'t CpuTree) -> &'t Vec<u32> {
        &t.tree.tokens
    }
    fn tree_depths<'t>(&self, t: &'t CpuTree) -> &'t Vec<u32> {
        &t.depths
    }
    fn tree_mask<'t>(&self, t: &'t CpuTree) -> &'t Visibility {
        &t.mask
    }
    fn tree_walk(
        &self,
        t: &mut CpuTree,
        logits: &Vec<f32>,
        row0: usize,
        s: &crate::sampling::Sampling,
        kv: &LatentCache,
    ) -> Result<()> {
        let (n, v) = (t.tree.len(), t.vocab);
        anyhow::ensure!(
            logits.len() >= (row0 + n) * v,
            "tree_walk: {} logits for {n} nodes from row {row0} x {v}",
            logits.len()
        );
        t.walk = Some(walk_sampled(
            &t.tree,
            &logits[row0 * v..(row0 + n) * v],
            v,
            s,
            kv.committed,
        ));
        Ok(())
    }
    fn tree_walk_decided(&self, t: &mut CpuTree, decisions: &Vec<u32>, row0: usize) -> Result<()> {
        let n = t.tree.len();
        anyhow::ensure!(
            decisions.len() >= row0 + n,
            "tree_walk_decided: {} decisions for {n} nodes from row {row0}",
            decisions.len()
        );
        t.walk = Some(crate::ddtree::walk(&t.tree, |i| decisions[row0 + i]));
        Ok(())
    }
    fn tree_path_rows(&self, t: &CpuTree, x: &Vec<f32>, row0: usize, cols: usize, rows_out: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows_out * cols];
        if let Some(w) = &t.walk {
            for (i, &p) in w.path.iter().enumerate().take(rows_out) {
                let r = row0 + p;
                out[i * cols..(i + 1) * cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
            }
        }
        out
    }
    fn tree_commit(&self, t: &mut CpuTree, kv: &mut LatentCache, ctx: &mut usize) -> Result<()> {
        let w = t
            .walk
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("tree_commit: no walk since the last build"))?;
        kv.commit(&w.path)?;
        *ctx += w.path.len();
        t.root[0] = *w
            .decisions
            .last()
            .ok_or_else(|| anyhow::anyhow!("tree_commit: an empty walk"))?;
        Ok(())
    }
    fn tree_commit_host(&self, _t: &CpuTree, _kv: &mut LatentCache, _ctx: &mut usize, _n: usize) {
        // tree_commit already moved the host state: the CPU has no other copy.
    }
    fn tree_result(&self, t: &CpuTree) -> Result<crate::ddtree::TreeResult> {
        let walk = t
            .walk
            .clone()
            .ok_or_else(|| anyhow::anyhow!("tree_result: no walk since the last build"))?;
        Ok(crate::ddtree::TreeResult {
            walk,
            log_q: t.tree.log_q[1..].to_vec(),
        })
    }
    fn tree_result_words(&self, _t: &CpuTree) -> usize {
        0 // the walk is on the host already: nothing to stage
    }
    fn tree_result_into(&self, _t: &CpuTree, _stage: &mut Vec<u32>, _at: usize) {}
    fn tree_result_from(&self, t: &CpuTree, _words: &[u32]) -> Result<crate::ddtree::TreeResult> {
        self.tree_result(t)
    }
    fn graph_run(&self, _graph: &mut Option<()>, _key: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        body()
    }
}

#[cfg(test)]
#[path = "backend_tests.rs"]
mod tests;
