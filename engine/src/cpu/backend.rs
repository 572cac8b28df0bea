//! [`CpuBackend`]: the reference implementation of `backend::Backend` with the cpu/ops files.
//!
//! Activations are host `Vec<f32>`; uploads are identity moves, so weights stay zero-copy `Slab` views of
//! the mmapped shards; the latent cache is `cpu::cache::LatentCache`. Every op is the cpu/ops function
//! named in its body, with the same arguments in the same order, so the model's results are those of the
//! ops (bit for bit: golden/regen.sh --check). Tests: engine/tests/target_*.rs, ddtree_drafter.rs.

use super::cache::LatentCache;
use super::ops;
use crate::backend::{Fill, I4Stack, Mat, Resources, RopeTable, Slab, Visibility, WeightCheck, WeightRef};
use crate::ddtree::{DraftTree, Walk};
use anyhow::Result;
use half::bf16;

/// The CPU reference backend (rayon, f32 accumulation, fixed reduction order). `comm`: this rank's group
/// when the ranks of a run are threads of their own (`crate::tp`), None when one backend holds them all.
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    pub comm: Option<super::comm::HostRank>,
    /// Check every weight's bytes against the manifest's checksum at load ([`Resources::weight_check`]): on
    /// the CPU the weights are the mmapped shard bytes, so this finds a damaged shard file (`Host` hashes them
    /// on rayon's threads, `Device` one after another as each is read).
    pub check_weights: WeightCheck,
}

impl CpuBackend {
    /// The backend of rank `c.rank` of a group of rank threads.
    pub fn with_comm(c: super::comm::HostRank) -> CpuBackend {
        CpuBackend {
            comm: Some(c),
            check_weights: WeightCheck::Off,
        }
    }
    /// `x` summed over the group (identity without one). A failed group (a rank died) is a panic here, which
    /// the rank thread turns into that rank's error (ops are infallible on the CPU).
    pub(super) fn group_sum(&self, x: Vec<f32>) -> Vec<f32> {
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

impl CpuTree {
    /// A new build's tree, with its depths and mask; no walk yet.
    pub(crate) fn set(&mut self, tree: DraftTree) {
        self.depths = tree.depths.clone();
        self.mask = tree.visibility.clone();
        self.tree = tree;
        self.walk = None;
    }
}

/// One MoE layer's router decisions: per token (experts, weights), and per expert its (token, weight)s.
pub struct CpuRoutes {
    pub per_token: Vec<(Vec<usize>, Vec<f32>)>,
    pub per_expert: Vec<Vec<(usize, f32)>>,
}

impl Resources for CpuBackend {
    type Act = Vec<f32>;
    type LinIn = Vec<f32>;
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
    fn weight_check(&self) -> WeightCheck {
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
    fn pos_add_host(&self, _p: &mut usize, _n: usize) {
        // stash_rows already moved it: the CPU has no other copy.
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
    fn cols(&self, x: &Vec<f32>, ld: usize, from: usize, width: usize, t: usize) -> Vec<f32> {
        (0..t)
            .flat_map(|i| x[i * ld + from..i * ld + from + width].iter().copied())
            .collect()
    }
    fn ids_blocks(&self, dst: &mut Vec<u32>, roots: &[&Vec<u32>], block: usize, fill: u32) {
        for (s, root) in roots.iter().enumerate() {
            let b = &mut dst[s * block..(s + 1) * block];
            b.fill(fill);
            b[0] = root[0];
        }
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
    fn stash_rows(&self, dsts: &mut [(&mut Vec<f32>, &mut usize)], cols: usize, src: &Vec<f32>) -> Result<()> {
        anyhow::ensure!(
            src.len() >= dsts.len() * cols,
            "stash_rows: {} values for {} rows",
            src.len(),
            dsts.len()
        );
        for (s, (dst, pos)) in dsts.iter_mut().enumerate() {
            self.write_rows_at(dst, cols, pos, &src[s * cols..(s + 1) * cols].to_vec(), 1);
            **pos += 1;
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

    // ---- dummy weights: filled on the host (cpu/ops/fill.rs, the spec), then uploaded ----
    fn fill_bf16(&self, rows: usize, cols: usize, f: &Fill) -> Result<Mat> {
        self.upload_bf16(Mat {
            w: Slab::Owned(ops::fill_bf16(rows * cols, f)?),
            rows,
            cols,
        })
    }
    fn fill_vector(&self, n: usize, f: &Fill) -> Result<Slab<bf16>> {
        self.upload_vector(Slab::Owned(ops::fill_bf16(n, f)?))
    }
    fn fill_vector_f32(&self, n: usize, f: &Fill) -> Result<Slab<f32>> {
        self.upload_vector_f32(Slab::Owned(ops::fill_f32(n, f)?))
    }
    fn fill_i4g32(
        &self,
        first: usize,
        count: usize,
        n: usize,
        k: usize,
        packed: &Fill,
        scales: &Fill,
    ) -> Result<I4Stack> {
        let p = ops::fill_u8(count * n * k / 2, packed)?;
        let s = ops::fill_bf16(count * n * k / 32, scales)?;
        self.upload_i4g32(I4Stack {
            packed: Slab::Owned(p),
            scales: Slab::Owned(s),
            first,
            count,
            n,
            k,
        })
    }
}

#[cfg(test)]
#[path = "backend_tests.rs"]
mod tests;
