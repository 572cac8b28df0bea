//! The op-level backend seam: the model-level ops that the target (MLA, MoE, dense MLP, embedding,
//! lm_head) and the DFlash drafter are written once against, and the typed error for backends a build
//! lacks. The CPU reference implements [`Backend`] in engine/src/cpu/backend.rs with the cpu/ops files;
//! a CUDA backend implements the same set with device buffers (idea: candle-core's `BackendStorage`).
//!
//! Contracts every implementation keeps: activations are row-major `[rows, cols]` f32 (the caller passes
//! the row count); reductions across tensor-parallel ranks happen only in [`Compute::all_reduce`], in
//! rank order 0..R; logits of vocab-parallel shards are merged in global vocab order. `upload_*` runs
//! once per weight at load (a GPU backend copies, and may repack INT4 for its kernels, there); the ops
//! never see host weight bytes. Only `to_host` / `routes_to_host` (probes, logits) move data to the host.
//! Tests: the CPU backend is the model's reference (engine/tests/target_*.rs, ddtree_drafter.rs);
//! `cuda_without_the_feature_is_a_typed_error` in engine/tests/target_plans.rs.
//!
//! Letters: T rows (tokens / tree nodes), H hidden, V vocab, R ranks, E experts.

mod types;
mod visibility;

pub use types::{
    pod_vec, rope_cos_sin, AttnMode, Fill, I4Stack, MappedView, Mat, MlaDims, RopeTable, Router, Slab, VocabShards,
};
pub use visibility::Visibility;

/// Columns `off .. off + width` of every row of an activation `[T, ld]`: one linear's part of
/// [`Compute::linear_in_cat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cols {
    pub ld: usize,
    pub off: usize,
    pub width: usize,
}

impl Cols {
    /// The blocks of widths `ws` side by side, in order.
    pub fn split(ws: &[usize]) -> Vec<Cols> {
        let ld = ws.iter().sum();
        let mut off = 0;
        ws.iter()
            .map(|&width| {
                off += width;
                Cols {
                    ld,
                    off: off - width,
                    width,
                }
            })
            .collect()
    }
}

use anyhow::{ensure, Result};
use half::bf16;

/// Why a backend cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// `--device cuda` on a build without the `cuda` feature.
    #[error("this kdtree build has no CUDA backend: rebuild with --features cuda")]
    NoCuda,
}

/// An uploaded weight, for [`Resources::weight_xxh3`].
pub enum WeightRef<'a, B: Resources> {
    Mat(&'a B::Mat),
    Vector(&'a B::Vector),
    VectorF32(&'a B::VectorF32),
    I4(&'a B::I4),
}

/// Where a forward's positions start: the target's committed rows or another position counter (the
/// drafter's context). A device backend reads it where the ops run, so a captured round replays at any
/// position.
pub enum PosOf<'a, B: Resources> {
    Kv(&'a B::Kv),
    Pos(&'a B::Pos),
}

/// One segment of a batch's RoPE table ([`Compute::rope_at_segs`]): its positions' base, its offsets (None: row
/// i at base + i) and its rows.
pub type RopeSeg<'a, B> = (PosOf<'a, B>, Option<&'a <B as Resources>::Ids>, usize);

/// Resources: the associated types, uploads and dummy fills of weights, ids / masks / RoPE rows / position
/// counters, activations as buffers (copies, rows, host reads) and the latent cache's bookkeeping.
/// `Act` is an activation tensor, `Mat` / `I4` / `Vector` / `VectorF32` uploaded weights, `Kv` the MLA latent
/// cache of all layers, `Routes` one MoE layer's router decisions.
pub trait Resources: Clone + Send + Sync + 'static {
    type Act: Send + Sync;
    /// An activation in the form the linear ops read ([`Compute::lin_in`]: bf16 rows on the CUDA backend, the f32
    /// rows themselves on the CPU), so that the linears of one input (and its routed experts) share one conversion.
    type LinIn: Send + Sync;
    /// A bf16 matrix `[rows, cols]` (torch Linear `[out, in]`).
    type Mat: Send + Sync;
    /// An INT4 group-32 expert stack of one rank (`[count, n, k]`, global experts `first..first+count`).
    type I4: Send + Sync;
    /// A bf16 vector (norm weights).
    type Vector: Send + Sync;
    /// An f32 vector (e_score_correction_bias).
    type VectorF32: Send + Sync;
    type Kv: Send;
    type Routes;
    /// Small index vectors (token ids, node depths) where the ops read them (host `Vec` on the CPU).
    type Ids: Send + Sync;
    /// The cos/sin rows of one forward's positions ([`RopeTable`] on the CPU, uploaded once per forward on
    /// a device).
    type Rope: Send + Sync;
    /// An ancestor bitmask ([`Visibility`] on the CPU).
    type Mask: Send + Sync;
    /// One sequence's draft-tree workspace for a fixed (budget, draft rows, vocab): top-K, tree, mask,
    /// decisions and walk, all where the ops run (the device round, [`TreeOps::tree_build`]).
    type Tree: Send;
    /// A position counter where the ops read it, with its host copy (the drafter's context length; the
    /// target's committed length lives in `Kv`). `usize` on the CPU.
    type Pos: Send + Sync;
    /// A captured DDTree round (a CUDA graph; nothing on the CPU), see [`TreeOps::graph_run`].
    type Graph: Send;
    /// Short name for logs and summaries ("cpu", "cuda").
    fn name(&self) -> &'static str;
    /// Waits until every op queued so far has run (a device stream; nothing on the CPU, whose ops run as they
    /// are called): for host timings of queued work.
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    /// The first error of an op since the last call (ops are infallible on the CPU; a device backend
    /// records a failed launch and reports it here). The model calls it at the end of every forward.
    fn check(&self) -> Result<()> {
        Ok(())
    }

    // ---- upload (once per weight, at load) ----
    fn upload_bf16(&self, m: Mat) -> Result<Self::Mat>;
    fn upload_i4g32(&self, s: I4Stack) -> Result<Self::I4>;
    fn upload_vector(&self, v: Slab<bf16>) -> Result<Self::Vector>;
    fn upload_vector_f32(&self, v: Slab<f32>) -> Result<Self::VectorF32>;
    /// Whether [`Resources::upload_bf16_hashed`] and [`Resources::upload_i4g32_hashed`] hash the host bytes as
    /// they copy them (a GPU: in its staging buffers, cuda/load.rs), so that the host load check reads no shard
    /// byte twice: the loader then uses them for [`WeightCheck::Host`]; otherwise it hashes the shard bytes itself,
    /// beside the upload (`weights::HostChecks`).
    fn hashes_uploads(&self) -> bool {
        false
    }
    /// [`Resources::upload_bf16`] and the xxh3-64 of `m`'s host bytes.
    fn upload_bf16_hashed(&self, m: Mat) -> Result<(Self::Mat, u64)> {
        let h = crate::xxh3::xxh3_64_par(bytemuck::cast_slice(&m.w[..]));
        Ok((self.upload_bf16(m)?, h))
    }
    /// [`Resources::upload_i4g32`] and the xxh3-64 of the stack's host bytes, `[packed, scales]`.
    fn upload_i4g32_hashed(&self, s: I4Stack) -> Result<(Self::I4, [u64; 2])> {
        let h = s.xxh3();
        Ok((self.upload_i4g32(s)?, h))
    }
    /// Rows of a bf16 matrix (its output width).
    fn mat_rows(&self, m: &Self::Mat) -> usize;
    /// `mats` (one input width) moved next to each other by rows, so that [`Compute::linear_in_cat`] runs them
    /// as one GEMM over the input they share; each keeps its shape and values. At load, after the checks. The
    /// default leaves them where they are (the CPU reads them from the mapped shards).
    fn stack_rows(&self, _mats: &mut [&mut Self::Mat]) -> Result<()> {
        Ok(())
    }
    /// How the loader checks every weight against its checksum (`weights::Ld`; `kdtree-run --check-weights`;
    /// the GPU suite: [`WeightCheck::Device`] always).
    fn weight_check(&self) -> WeightCheck {
        WeightCheck::Off
    }
    /// xxh3-64 of an uploaded weight's bytes where the ops read them, in the converter's layout (the manifest's
    /// per-tensor checksum): one value for a matrix or vector, `[packed, scales]` for an INT4 stack. A device
    /// backend hashes its own copy (a GPU: kernels/cuda/xxh3.cu) and leaves out any padding it added.
    fn weight_xxh3(&self, w: WeightRef<'_, Self>) -> Result<Vec<u64>>;

    // ---- dummy weights (`--load-format dummy`; [`Fill`] says what element i is) ----
    // The CPU backend fills on the host and uploads (cpu/ops/fill.rs, the spec); a device backend fills its
    // buffers in place, so no weight byte exists on the host.
    /// A bf16 matrix `[rows, cols]` filled by `f`.
    fn fill_bf16(&self, rows: usize, cols: usize, f: &Fill) -> Result<Self::Mat>;
    /// A bf16 vector `[n]` filled by `f`.
    fn fill_vector(&self, n: usize, f: &Fill) -> Result<Self::Vector>;
    /// An f32 vector `[n]` filled by `f`.
    fn fill_vector_f32(&self, n: usize, f: &Fill) -> Result<Self::VectorF32>;
    /// An INT4 group-32 stack (global experts `first..first + count`, `[count, n, k]`): packed bytes
    /// `[count, n, k/2]` filled by `packed`, bf16 scales `[count, n, k/32]` by `scales`.
    #[allow(clippy::too_many_arguments)]
    fn fill_i4g32(
        &self,
        first: usize,
        count: usize,
        n: usize,
        k: usize,
        packed: &Fill,
        scales: &Fill,
    ) -> Result<Self::I4>;

    // ---- positions, masks, ids ----
    /// The table where the ops read it.
    fn rope_upload(&self, r: RopeTable) -> Self::Rope;
    /// Row i = row `idx[i]` of `r`, for i < t (a tree's positions from its node depths on the device).
    fn rope_gather(&self, r: &RopeTable, idx: &Self::Ids, t: usize) -> Self::Rope;
    fn mask_upload(&self, v: &Visibility) -> Self::Mask;
    fn ids_from_host(&self, ids: &[u32]) -> Self::Ids;
    /// `dst[at..at + n] = src[..n]` where the ops run.
    fn ids_copy(&self, dst: &mut Self::Ids, at: usize, src: &Self::Ids, n: usize);
    /// `dst` from index 0 = each source's first `n` ids in turn (a batch's trees' nodes into one buffer). The
    /// default copies each; a device backend does it in one launch.
    fn ids_gather(&self, dst: &mut Self::Ids, srcs: &[(&Self::Ids, usize)]) {
        let mut at = 0;
        for &(src, n) in srcs {
            self.ids_copy(dst, at, src, n);
            at += n;
        }
    }
    /// `dst[at..at + host.len()] = host` (a copy into the existing buffer: a captured graph keeps reading it).
    fn ids_write(&self, dst: &mut Self::Ids, at: usize, host: &[u32]) -> Result<()>;
    /// The ids on the host (a read back).
    fn ids_to_host(&self, ids: &Self::Ids) -> Result<Vec<u32>>;

    // ---- position counters ----
    fn pos_new(&self, v: usize) -> Self::Pos;
    /// The host copy.
    fn pos_get(&self, p: &Self::Pos) -> usize;
    fn pos_set(&self, p: &mut Self::Pos, v: usize);
    /// `+= n` (where the ops run and on the host).
    fn pos_add(&self, p: &mut Self::Pos, n: usize);
    /// `+= n` on the host copy only: it follows a count that a captured step advanced where the ops run
    /// ([`Resources::stash_rows`]; the pair of `kv_commit_rows` / `kv_commit_rows_host`).
    fn pos_add_host(&self, p: &mut Self::Pos, n: usize);

    // ---- activations ----
    fn act_from_host(&self, x: Vec<f32>) -> Self::Act;
    fn to_host(&self, x: &Self::Act) -> Vec<f32>;
    /// Rows `[from, to)` of `x` `[T, cols]`.
    fn rows(&self, x: &Self::Act, cols: usize, from: usize, to: usize) -> Self::Act;
    /// Append the rows of `x` to `acc` (same width).
    fn append_rows(&self, acc: &mut Self::Act, x: &Self::Act);
    /// Keep the first `n` values of `x`.
    fn truncate(&self, x: &mut Self::Act, n: usize);
    /// Rows `[at, at + n)` of `dst` `[>= at + n, cols]` = `src` `[n, cols]` (a batch's per-sequence results
    /// into one activation).
    fn set_rows(&self, dst: &mut Self::Act, cols: usize, at: usize, src: &Self::Act, n: usize);
    /// Columns `[at, at + src_cols)` of `dst` `[t, dst_cols]` = `src` `[t, src_cols]`.
    fn set_cols(&self, dst: &mut Self::Act, dst_cols: usize, at: usize, src: &Self::Act, src_cols: usize, t: usize);
    /// A zero activation of `n` values.
    fn zeros(&self, n: usize) -> Self::Act;
    /// Room for `rows` rows of `cols` in `x`, keeping its values (a row cache). True when `x` moved (a
    /// captured round that used it must be captured again).
    fn reserve_rows(&self, x: &mut Self::Act, cols: usize, rows: usize) -> bool;
    /// Rows `[at, at + n)` of the row cache `dst` (room reserved) = `src` `[n, cols]`, `at` read where the
    /// ops run.
    fn write_rows_at(&self, dst: &mut Self::Act, cols: usize, at: &Self::Pos, src: &Self::Act, n: usize);
    /// [`Resources::write_rows_at`] of a batch: segment s's `n_s` rows of `src` (consecutive, in segment order)
    /// into its row cache `dst_s` (room reserved) at its count `at_s` (read where the ops run). The default
    /// writes each segment alone; a device backend does it in one launch.
    fn write_rows_at_segs(&self, dsts: &mut [(&mut Self::Act, &Self::Pos, usize)], cols: usize, src: &Self::Act) {
        let mut row = 0;
        for (dst, at, n) in dsts.iter_mut() {
            let rows = self.rows(src, cols, row, row + *n);
            self.write_rows_at(dst, cols, at, &rows, *n);
            row += *n;
        }
    }
    /// Columns `[from, from + width)` of each of the `t` rows of `x` `[t, ld]`: `[t, width]` (a batch's draft
    /// blocks without their first rows: `x` `[N, B·H]`, from H, width (B−1)·H).
    fn cols(&self, x: &Self::Act, ld: usize, from: usize, width: usize, t: usize) -> Self::Act;
    /// A batch's draft blocks: `dst[s·block] = roots[s][0]` (read where the ops run) and the block's other
    /// `block − 1` ids `fill`, for each s (room for `roots.len()` blocks).
    fn ids_blocks(&self, dst: &mut Self::Ids, roots: &[&Self::Ids], block: usize, fill: u32);
    /// [`Resources::kv_commit_rows`] of each cache of a batch (one launch on a device; the host copies follow
    /// in [`Resources::kv_commit_rows_host`]).
    fn kv_commit_rows_segs(&self, kvs: &mut [&mut Self::Kv], n: usize) -> Result<()> {
        kvs.iter_mut().try_for_each(|kv| self.kv_commit_rows(kv, n))
    }
    /// For each s: row s of `src` `[dsts.len(), cols]` into row `pos_s` of the row cache `dst_s` (room
    /// reserved), then `pos_s += 1` where the ops run (one launch for a batch's feed step; the host copies
    /// follow in [`Resources::pos_add_host`]).
    fn stash_rows(&self, dsts: &mut [(&mut Self::Act, &mut Self::Pos)], cols: usize, src: &Self::Act) -> Result<()>;

    // ---- MLA ----
    fn kv_new(&self, layers: usize, width: usize) -> Self::Kv;
    /// Committed rows of the cache.
    fn kv_committed(&self, kv: &Self::Kv) -> usize;
    /// Room for `rows` rows (committed + scratch) without growing inside a forward.
    fn kv_reserve(&self, kv: &mut Self::Kv, rows: usize) -> Result<()>;
    /// Changes whenever the cache's storage moves (a captured round is keyed by it; 0 on the CPU).
    fn kv_id(&self, kv: &Self::Kv) -> u64;
    /// Start of a forward: drop any scratch rows.
    fn kv_drop_scratch(&self, kv: &mut Self::Kv);
    /// Mark the last forward's `t` rows as scratch (after every layer appended them).
    fn kv_set_scratch(&self, kv: &mut Self::Kv, t: usize);
    /// Keep scratch rows `path` (root-to-node, in order) as the next committed rows; drop the rest.
    fn kv_compact(&self, kv: &mut Self::Kv, path: &[usize]) -> Result<()>;
    /// The first `n` scratch rows become committed where the ops run (no row moves: a chain's prefix; the
    /// device AR step). The host copy follows in [`Resources::kv_commit_rows_host`].
    fn kv_commit_rows(&self, kv: &mut Self::Kv, n: usize) -> Result<()>;
    fn kv_commit_rows_host(&self, kv: &mut Self::Kv, n: usize);
    /// Keep committed rows `[0, len)`.
    fn kv_truncate(&self, kv: &mut Self::Kv, len: usize) -> Result<()>;
    fn kv_reset(&self, kv: &mut Self::Kv);
    /// Bytes one cache row takes (all layers).
    fn kv_row_bytes(&self, kv: &Self::Kv) -> usize;
    /// Drop everything and give the cache's storage back (a batch's admission control frees an idle slot).
    fn kv_release(&self, kv: &mut Self::Kv);
    /// Free memory where the ops run, in bytes (None: the host, not measured).
    fn mem_free(&self) -> Option<usize> {
        None
    }
    /// The captured graphs' counters where the ops run (None: no graphs, the host).
    fn graph_stats(&self) -> Option<crate::api::GraphStats> {
        None
    }
    /// Several tables stacked in row order (a batch's segments: one RoPE op over all their rows).
    fn rope_cat(&self, ropes: &[&Self::Rope]) -> Self::Rope;
}

/// Compute: the model's ops (dense, vocabulary, MLA, MoE, the drafter's) and the target's decisions.
pub trait Compute: Resources {
    /// The target's decision for each of `rows` rows `[row0, row0 + rows)` of `logits` `[>= row0 + rows, vocab]`
    /// into `out[row0..row0 + rows]`: greedy, or `sampling::sample` of row `row0 + i` at position
    /// `base + offset + i` (`base` read where the ops run). A batch decides each sequence's rows in place.
    #[allow(clippy::too_many_arguments)]
    fn decide_rows(
        &self,
        logits: &Self::Act,
        row0: usize,
        rows: usize,
        vocab: usize,
        s: &crate::sampling::Sampling,
        base: PosOf<'_, Self>,
        offset: usize,
        out: &mut Self::Ids,
    ) -> Result<()>;
    /// cos/sin of positions `base + offsets[i]` (or `base + i`) for i < t, as [`RopeTable::new`] computes them,
    /// with the base read where the ops run.
    fn rope_at(
        &self,
        inv_freq: &Self::VectorF32,
        factor: f64,
        base: PosOf<'_, Self>,
        offsets: Option<&Self::Ids>,
        t: usize,
    ) -> Self::Rope;
    /// [`Compute::rope_at`] of a batch's segments (base, offsets, rows), stacked in segment order (one table
    /// for one RoPE op over all their rows). The default computes each and stacks them
    /// ([`Resources::rope_cat`]); a device backend does it in one launch.
    fn rope_at_segs(&self, inv_freq: &Self::VectorF32, factor: f64, segs: &[RopeSeg<'_, Self>]) -> Self::Rope {
        let ropes: Vec<Self::Rope> = segs
            .iter()
            .map(|(base, offsets, t)| {
                let base = match base {
                    PosOf::Kv(k) => PosOf::Kv(*k),
                    PosOf::Pos(p) => PosOf::Pos(*p),
                };
                self.rope_at(inv_freq, factor, base, *offsets, *t)
            })
            .collect();
        self.rope_cat(&ropes.iter().collect::<Vec<_>>())
    }

    // ---- dense ops ----
    /// `x[T, K] · W[N, K]^T` → `[T, N]`.
    fn linear(&self, x: &Self::Act, t: usize, w: &Self::Mat) -> Self::Act;
    /// `x` made ready for the linear ops once ([`Compute::linear_in`], [`Compute::moe_experts`]).
    fn lin_in(&self, x: &Self::Act) -> Self::LinIn;
    /// [`Compute::linear`] of an input already made ready ([`Compute::lin_in`]): the same values.
    fn linear_in(&self, x: &Self::LinIn, t: usize, w: &Self::Mat) -> Self::Act;
    /// The linears `ws` of one input side by side, `[T, ΣN]`: row i is row i of each output in `ws`'s order (each
    /// a [`Cols`] block for the ops that read them). One GEMM where the matrices were stacked
    /// ([`Resources::stack_rows`]); the default runs each and copies it into its columns.
    fn linear_in_cat(&self, x: &Self::LinIn, t: usize, ws: &[&Self::Mat]) -> Self::Act {
        if let [w] = ws {
            return self.linear_in(x, t, w);
        }
        let ld: usize = ws.iter().map(|w| self.mat_rows(w)).sum();
        let (mut y, mut at) = (self.zeros(t * ld), 0);
        for w in ws {
            let n = self.mat_rows(w);
            self.set_cols(&mut y, ld, at, &self.linear_in(x, t, w), n, t);
            at += n;
        }
        y
    }
    /// RMSNorm of every `[D]` row of `x` (D = the weight's length).
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> Self::Act;
    /// [`Compute::lin_in`] of [`Compute::rms_norm`]: the same values in one op (a norm whose output only feeds
    /// linears).
    fn rms_norm_in(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> Self::LinIn;
    /// [`Compute::rms_norm_in`] of the `c` block of `t` rows of `x` (a part of [`Compute::linear_in_cat`]'s output).
    fn rms_norm_in_cols(&self, x: &Self::Act, c: Cols, t: usize, w: &Self::Vector, eps: f32) -> Self::LinIn {
        self.rms_norm_in(&self.cols(x, c.ld, c.off, c.width, t), w, eps)
    }
    /// `x += a`, then [`Compute::rms_norm_in`] of the sum: the same values as the three ops, in one (a decoder
    /// layer's residual add and the next norm).
    fn add_rms_norm_in(&self, x: &mut Self::Act, a: &Self::Act, w: &Self::Vector, eps: f32) -> Self::LinIn;
    /// `acc += x`.
    fn add(&self, acc: &mut Self::Act, x: &Self::Act);
    /// `silu(gate) ⊙ up`.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;
    /// [`Compute::lin_in`] of [`Compute::silu_mul`]: the same values in one op (a SwiGLU whose output only feeds
    /// the down projection).
    fn silu_mul_in(&self, gate: &Self::Act, up: &Self::Act) -> Self::LinIn;
    /// [`Compute::silu_mul_in`] of the `gate` and `up` blocks of `t` rows of `x` (a SwiGLU's [gate | up] linear).
    fn silu_mul_in_cols(&self, x: &Self::Act, gate: Cols, up: Cols, t: usize) -> Self::LinIn {
        let g = self.cols(x, gate.ld, gate.off, gate.width, t);
        self.silu_mul_in(&g, &self.cols(x, up.ld, up.off, up.width, t))
    }
    /// Sum of rank partials in rank order 0..R (the tensor-parallel all-reduce).
    fn all_reduce(&self, partials: Vec<Self::Act>) -> Self::Act;

    // ---- vocabulary ----
    /// `embed_tokens` rows `[n, H]` of the vocab-parallel shards `v` holds; rows of ids another GPU holds are
    /// zero here until the GPU's communicator sums them in (see [`VocabShards`]).
    fn embedding(&self, v: &VocabShards<'_, Self::Mat>, h: usize, tokens: &[u32]) -> Self::Act;
    /// [`Compute::embedding`] of `n` ids already where the ops run.
    fn embedding_ids(&self, v: &VocabShards<'_, Self::Mat>, h: usize, ids: &Self::Ids, n: usize) -> Self::Act;
    /// lm_head `[n, V]` over vocab-parallel shards, merged in global vocab order (other GPUs' columns summed in
    /// by the communicator).
    fn lm_head(&self, x: &Self::Act, n: usize, h: usize, v: &VocabShards<'_, Self::Mat>) -> Self::Act;
    /// Greedy token of each row of lm_head(x) into `out[row0..row0 + n]`, where the ops run: when every shard is
    /// here, the argmax of the merged logits; otherwise each shard's argmax as a (value, global id) pair, the
    /// pairs of every GPU gathered through the communicator (`n x R` pairs instead of `n x V` logits) and merged
    /// in global vocab order (lowest global id wins ties, NaN never wins): the same token either way.
    fn lm_head_argmax_into(
        &self,
        x: &Self::Act,
        n: usize,
        h: usize,
        v: &VocabShards<'_, Self::Mat>,
        out: &mut Self::Ids,
        row0: usize,
    ) -> Result<()>;
    /// New latent rows `[T, C + P]` = `rms_norm(c_kv) | rope_interleaved(k_pe)` from `kv_a` output `ckv`,
    /// appended to layer `l` as scratch.
    fn kv_append_latent(
        &self,
        kv: &mut Self::Kv,
        l: usize,
        ckv: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        rope: &Self::Rope,
    );
    /// [`Compute::kv_append_latent`] of the `c` block of `t` rows of `ckv` (the kv_a part of a stacked linear).
    #[allow(clippy::too_many_arguments)]
    fn kv_append_latent_cols(
        &self,
        kv: &mut Self::Kv,
        l: usize,
        ckv: &Self::Act,
        c: Cols,
        t: usize,
        norm: &Self::Vector,
        eps: f32,
        rope: &Self::Rope,
    ) {
        self.kv_append_latent(kv, l, &self.cols(ckv, c.ld, c.off, c.width, t), norm, eps, rope)
    }
    /// Interleaved RoPE on the `q_pe` part (after `nope` dims) of every head of `q` `[T, heads·(nope+P)]`.
    fn rope_q(&self, q: &mut Self::Act, heads: usize, nope: usize, rope: &Self::Rope);
    /// MLA attention of one rank's roped queries `[T, Hr·(Dn+P)]` over layer `l` of the cache (committed
    /// prefix + scratch) with the ancestor mask of the T nodes; `kv_b` `[Hr·(Dn+Dv), C]`. Returns `[T, Hr·Dv]`.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        q: &Self::Act,
        t: usize,
        kv: &Self::Kv,
        l: usize,
        mask: &Self::Mask,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::Act;
    /// [`Compute::mla_attention`] of a batch: segment s = (its cache, its mask, its t_s rows), the segments'
    /// rows consecutive in `q` `[T, Hr·(Dn+P)]` (roped); `[T, Hr·Dv]`, each segment over its own cache. The
    /// default copies each segment's rows out and back; a device backend runs the per-row parts once.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_segs(
        &self,
        q: &Self::Act,
        segs: &[(&Self::Kv, &Self::Mask, usize)],
        l: usize,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::Act {
        let (qk, t) = (d.heads * (d.nope + d.rope), segs.iter().map(|s| s.2).sum::<usize>());
        let (mut out, mut at) = (self.zeros(t * d.heads * d.v), 0);
        for &(kv, mask, ts) in segs {
            let q_s = self.rows(q, qk, at, at + ts);
            let o = self.mla_attention(&q_s, ts, kv, l, mask, kv_b, d, mode);
            self.set_rows(&mut out, d.heads * d.v, at, &o, ts);
            at += ts;
        }
        out
    }
    /// [`Compute::mla_attention`] made ready for the o_proj linear ([`Compute::lin_in`]): the same values; a
    /// backend whose attention writes the linears' form hands it over without a round trip.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_in(
        &self,
        q: &Self::Act,
        t: usize,
        kv: &Self::Kv,
        l: usize,
        mask: &Self::Mask,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::LinIn {
        self.lin_in(&self.mla_attention(q, t, kv, l, mask, kv_b, d, mode))
    }
    /// [`Compute::mla_attention_segs`] made ready for the o_proj linear ([`Compute::lin_in`]): the same values; a
    /// backend whose attention writes the linears' form hands it over without a round trip.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_segs_in(
        &self,
        q: &Self::Act,
        segs: &[(&Self::Kv, &Self::Mask, usize)],
        l: usize,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::LinIn {
        self.lin_in(&self.mla_attention_segs(q, segs, l, kv_b, d, mode))
    }
    /// [`Compute::kv_append_latent`] of a batch: segment s's `t_s` rows of `ckv` (consecutive, in order) into its
    /// cache, roped with its rows of `rope_all` (the segments' tables stacked in the same order:
    /// [`Compute::rope_at_segs`] or [`Resources::rope_cat`]).
    #[allow(clippy::too_many_arguments)]
    fn kv_append_latent_segs(
        &self,
        segs: &mut [(&mut Self::Kv, usize)],
        l: usize,
        ckv: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        width: usize,
        rope_all: &Self::Rope,
    );

    // ---- MoE ----
    /// Router decisions of every row of `logits` `[T, E]`.
    fn moe_route(&self, logits: &Self::Act, t: usize, r: &Router, bias: Option<&Self::VectorF32>) -> Self::Routes;
    /// [`Compute::moe_route`] of the `c` block of `t` rows of `logits` (the router's part of a stacked linear).
    fn moe_route_cols(
        &self,
        logits: &Self::Act,
        c: Cols,
        t: usize,
        r: &Router,
        bias: Option<&Self::VectorF32>,
    ) -> Self::Routes {
        self.moe_route(&self.cols(logits, c.ld, c.off, c.width, t), t, r, bias)
    }
    /// (ids `[T, k]` in selection order, weights `[T, k]`) for probes.
    fn routes_to_host(&self, routes: &Self::Routes) -> (Vec<i32>, Vec<f32>);
    /// One rank's routed-expert partial `[T, H]` (experts it holds, ascending id per token).
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        x: &Self::LinIn,
        t: usize,
        h: usize,
        routes: &Self::Routes,
        gate: &Self::I4,
        up: &Self::I4,
        down: &Self::I4,
    ) -> Self::Act;

    // ---- drafter ----
    /// Per-head RMSNorm (weight `[D]`) then NeoX RoPE of `x` `[T, heads·D]`, row i at rope row i.
    fn head_norm_rope_neox(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        heads: usize,
        rope: &Self::Rope,
    ) -> Self::Act;
    /// Non-causal GQA of `q` `[B, Hq·D]` over `[context ; block]` keys/values: the first `ctx_len` rows of the
    /// row caches `ctx` (`[>= C, Hk·D]`), then `block` (`[B, Hk·D]`).
    #[allow(clippy::too_many_arguments)]
    fn gqa_attention(
        &self,
        q: &Self::Act,
        b: usize,
        ctx: (&Self::Act, &Self::Act),
        ctx_len: &Self::Pos,
        block: (&Self::Act, &Self::Act),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self::Act;
    /// [`Compute::gqa_attention`] of a batch's blocks of `b` rows each: sequence s's queries are rows
    /// `[s·b, (s+1)·b)` of `q` (and of the block keys/values `block`, and of the output), over its own context
    /// `ctx[s]` = (keys, values, committed length). The default runs each sequence alone; a device backend
    /// runs them in one launch, each sequence's values those of its own call.
    #[allow(clippy::too_many_arguments)]
    fn gqa_attention_segs(
        &self,
        q: &Self::Act,
        b: usize,
        ctx: &[(&Self::Act, &Self::Act, &Self::Pos)],
        block: (&Self::Act, &Self::Act),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self::Act {
        let (qw, kw, n) = (heads * head_dim, kv_heads * head_dim, ctx.len());
        let mut att = self.zeros(n * b * qw);
        for (s, &(kc, vc, len)) in ctx.iter().enumerate() {
            let (r0, r1) = (s * b, (s + 1) * b);
            let (qs, ks, vs) = (
                self.rows(q, qw, r0, r1),
                self.rows(block.0, kw, r0, r1),
                self.rows(block.1, kw, r0, r1),
            );
            let a = self.gqa_attention(&qs, b, (kc, vc), len, (&ks, &vs), heads, kv_heads, head_dim);
            self.set_rows(&mut att, qw, r0, &a, b);
        }
        att
    }
}

/// The DDTree round's tree (build, walk, commit, its one read back) and the captured round.
pub trait TreeOps: Resources {
    // ---- the DDTree round's tree (ddtree/; the device kernels are cuda/tree.rs) ----
    /// A tree workspace for `budget` nodes (root excluded), `rows` draft rows, `vocab`, and the top-`k` of each
    /// draft row (`min(budget, vocab)` for DDTree; 1 for the chain: one path of `rows` nodes).
    fn tree_new(&self, budget: usize, rows: usize, vocab: usize, k: usize) -> Result<Self::Tree>;
    /// Top-K log-probs of `draft`'s rows `[row0, row0 + rows)` (`[.., vocab]`: a batch's drafts stacked), the tree
    /// of the root token ([`TreeOps::tree_root`]) and its ancestor mask (`ddtree::build_tree`). The tree has
    /// `budget + 1` nodes when [`crate::ddtree::tree_is_full`] holds.
    fn tree_build(&self, tree: &mut Self::Tree, draft: &Self::Act, row0: usize) -> Result<()>;
    /// [`TreeOps::tree_build`] of a batch's trees (each from `rows` draft rows): tree s from rows
    /// `[s·rows, (s+1)·rows)` of `draft`. The default builds each alone; a device backend builds trees of one
    /// shape together (one top-K, every tree at once), each as its own build leaves it.
    fn tree_build_batch(&self, trees: &mut [&mut Self::Tree], draft: &Self::Act, rows: usize) -> Result<()> {
        trees
            .iter_mut()
            .enumerate()
            .try_for_each(|(s, t)| self.tree_build(t, draft, s * rows))
    }
    /// [`TreeOps::tree_walk_decided`] of a batch's trees: tree s's decisions at rows `[row0[s], ..)` of
    /// `decisions`. The default walks each alone; a device backend walks them together.
    fn tree_walk_decided_batch(
        &self,
        trees: &mut [&mut Self::Tree],
        decisions: &Self::Ids,
        row0: &[usize],
    ) -> Result<()> {
        ensure!(
            trees.len() == row0.len(),
            "{} trees, {} first rows",
            trees.len(),
            row0.len()
        );
        trees
            .iter_mut()
            .zip(row0)
            .try_for_each(|(t, &r)| self.tree_walk_decided(t, decisions, r))
    }
    /// [`TreeOps::tree_path_rows`] of a batch's trees into one activation `[trees.len()·rows_out, cols]`: tree
    /// s's rows from `[s·rows_out, ..)`, over its rows of `x` from `row0[s]`. The default gathers each alone.
    fn tree_path_rows_batch(
        &self,
        trees: &[&Self::Tree],
        x: &Self::Act,
        row0: &[usize],
        cols: usize,
        rows_out: usize,
    ) -> Self::Act {
        let mut acc = self.zeros(trees.len() * rows_out * cols);
        for (s, (t, &r)) in trees.iter().zip(row0).enumerate() {
            self.set_rows(
                &mut acc,
                cols,
                s * rows_out,
                &self.tree_path_rows(t, x, r, cols, rows_out),
                rows_out,
            );
        }
        acc
    }
    /// [`TreeOps::tree_result_into`] of a batch's trees: tree s's words at `at[s]` of `stage`. The default copies
    /// each alone.
    fn tree_result_into_batch(&self, trees: &[&Self::Tree], stage: &mut Self::Ids, at: &[usize]) {
        for (t, &a) in trees.iter().zip(at) {
            self.tree_result_into(t, stage, a);
        }
    }
    /// A feed round's tree (a tree of budget 0): the root token alone, no draft read.
    fn tree_root_only(&self, tree: &mut Self::Tree) -> Result<()>;
    /// Sets the root token (the next round's is the last walk's bonus, set by [`TreeOps::tree_commit`]).
    fn tree_set_root(&self, tree: &mut Self::Tree, root: u32) -> Result<()>;
    /// The root token `[1]` where the ops read it.
    fn tree_root<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Ids;
    /// Node tokens / depths `[budget + 1]` and the mask of the last build.
    fn tree_tokens<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Ids;
    fn tree_depths<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Ids;
    fn tree_mask<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Mask;
    /// The target's decision at every node from rows `[row0, row0 + budget + 1)` of `logits` `[.., vocab]`
    /// (greedy, or sampled with the uniform of position `start + depth + 1`, `start` = the committed rows of
    /// `kv`), then the walk (`ddtree::walk_sampled`). `row0` is the tree's first row in a batched verify.
    fn tree_walk(
        &self,
        tree: &mut Self::Tree,
        logits: &Self::Act,
        row0: usize,
        s: &crate::sampling::Sampling,
        kv: &Self::Kv,
    ) -> Result<()>;
    /// The walk over decisions already made: `decisions[row0 + i]` is node i's (a batch decides every
    /// tree's greedy rows in one argmax).
    fn tree_walk_decided(&self, tree: &mut Self::Tree, decisions: &Self::Ids, row0: usize) -> Result<()>;
    /// `[rows_out, cols]`: row i = row `row0 + path[i]` of `x` (`[.., cols]`, the tree's nodes from `row0`)
    /// for i < the walk's length, zeros after (the accepted nodes' taps for the drafter, padded to a fixed
    /// shape).
    fn tree_path_rows(&self, tree: &Self::Tree, x: &Self::Act, row0: usize, cols: usize, rows_out: usize) -> Self::Act;
    /// The round's commit where the ops run: `kv` keeps the walked path's scratch rows (`kv_compact`), `kv`'s
    /// committed length and `ctx` advance by the walk's length, and the root becomes the walk's bonus. The
    /// host copies follow in [`TreeOps::tree_commit_host`], once the walk has been read.
    fn tree_commit(&self, tree: &mut Self::Tree, kv: &mut Self::Kv, ctx: &mut Self::Pos) -> Result<()>;
    /// [`TreeOps::tree_commit`] of a batch's sequences (tree, cache, drafter context length). The default
    /// commits each alone; a device backend commits them together.
    #[allow(clippy::type_complexity)]
    fn tree_commit_batch(&self, items: &mut [(&mut Self::Tree, &mut Self::Kv, &mut Self::Pos)]) -> Result<()> {
        items
            .iter_mut()
            .try_for_each(|(t, kv, ctx)| self.tree_commit(t, kv, ctx))
    }
    /// The host side of [`TreeOps::tree_commit`] for a walk of `n` nodes.
    fn tree_commit_host(&self, tree: &Self::Tree, kv: &mut Self::Kv, ctx: &mut Self::Pos, n: usize);
    /// The last walk and the last build's popped-node scores (`log_q` of nodes 1..=budget, pop order): the
    /// round's one read back to the host (one copy on a device).
    fn tree_result(&self, tree: &Self::Tree) -> Result<crate::ddtree::TreeResult>;
    /// Words of the tree's result buffer: a batch copies every tree's result into one buffer
    /// ([`TreeOps::tree_result_into`]) and reads that once ([`TreeOps::tree_result_from`]).
    fn tree_result_words(&self, tree: &Self::Tree) -> usize;
    /// `stage[at..at + tree_result_words]` = the tree's result buffer, where the ops run.
    fn tree_result_into(&self, tree: &Self::Tree, stage: &mut Self::Ids, at: usize);
    /// [`TreeOps::tree_result`] from `words` (the staged copy, read back with the batch's one read).
    fn tree_result_from(&self, tree: &Self::Tree, words: &[u32]) -> Result<crate::ddtree::TreeResult>;

    // ---- one captured round ----
    /// Runs `body` (a whole DDTree round of ops, no host reads): on a device, captured once into `graph` for
    /// `key` and replayed while the key stays (a new key captures again); on the CPU, just run. A failed
    /// body leaves no graph.
    fn graph_run(&self, graph: &mut Option<Self::Graph>, key: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()>;
}

/// The model-level ops: every backend is [`Resources`] + [`Compute`] + [`TreeOps`] (split by job; the model and
/// the round take `B: Backend`, and a backend implements the three parts in separate files).
pub trait Backend: Resources + Compute + TreeOps {}

impl<T: Resources + Compute + TreeOps> Backend for T {}

/// The load check: how the loader compares every weight a run loads with the manifest's xxh3-64 of its shard
/// bytes. A difference fails the load naming the tensor, its rank and shard file, and both hashes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightCheck {
    /// No check (a library's default; `kdtree-run --no-check-weights`).
    #[default]
    Off,
    /// The shard bytes on the host, hashed on rayon's threads while the loader uploads them: a damaged or
    /// changed shard file (`kdtree-run`'s default). On the CPU backend these are the bytes the ops read.
    Host,
    /// The bytes where the ops read them, hashed after each upload (a GPU: on the device,
    /// kernels/cuda/xxh3.cu): also an upload that went wrong, at the device hash's speed (~15 GB/s on an H200).
    Device,
}
