//! DFlash drafter forward implementing [`api::Drafter`], written once against `backend::Backend`
//! ([`DFlashDrafter<B>`]; `B` = the CPU reference by default).
//!
//! What it computes (ddtree.md §1, z-lab `dflash/model.py`, liranringel/ddtree `model/dflash.py`):
//! * context: `ctx = hidden_norm(fc(concat taps))`; in every draft layer its keys/values are that layer's
//!   `k_norm(k_proj(ctx))` (RoPE at the tokens' absolute positions) and `v_proj(ctx)`. They depend only on
//!   the committed token and its position, so they are computed once per committed token per layer and
//!   cached ([`DFlashDrafter::extend_context`]); the cache never holds block (draft) K/V.
//! * block: `[bonus, mask × (B−1)]` embedded with the target's `embed_tokens`, at positions
//!   `start..start+B`; each layer is pre-norm Qwen3: non-causal GQA attention of the block queries over
//!   `[K_ctx ; K_block]` (q_norm/k_norm per head, then NeoX rotate_half RoPE over the full head_dim,
//!   scale head_dim^-0.5), then SwiGLU MLP; final `norm`; the target's `lm_head`; rows 1..B−1 returned.
//! * RoPE/YaRN from the drafter config: inverse frequencies per transformers `_compute_yarn_parameters`
//!   (cpu::ops::yarn_inv_freq) and cos/sin amplitude = the transformers default
//!   `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` (cpu::ops::yarn_attention_factor),
//!   which is 1.0 for the Kimi drafters (mscale = mscale_all_dim = 1); with both keys absent the formats
//!   defaults (1, 0) give `1 + 0.1 ln(factor)`, transformers' plain-YaRN default. vllm-ascend forces
//!   `1 + 0.1 ln 64 ≈ 1.416` for Kimi-K2.5-DFlash and reports higher acceptance (ddtree.md §1.9); not applied here.
//!
//! Tensor-parallel shards: the drafter's own weights are *logical* (gathered) tensors (weights.rs), so
//! the forward is the same for every R and never sums per-rank partials; the target tables it borrows
//! (embed_tokens, lm_head) stay per rank (vocab-parallel, merged in global vocab order).
//! Activations are f32, weights bf16, every reduction in the fixed order of cpu::ops (the block attention
//! is cpu/ops/gqa_attention.rs).
//! On the CUDA backend the same code drafts on the GPU (block attention: kernels/cuda/gqa_attention.cu).
//! Tests: engine/tests/ddtree_drafter.rs (chunking invariance, non-causality, naive from-scratch reference);
//! engine/tests/cuda_drafter.rs (the CUDA drafter against this CPU one).
//!
//! Dimension letters: H hidden, C committed context rows, B block, Hq query heads, Hk kv heads, D head_dim,
//! I intermediate, V vocab, n_tap number of tapped target layers.

mod api;
mod tables;
mod weights;

pub use tables::{DenseTables, TargetTables};
pub use weights::{slice_config, DraftLayer, DrafterDims, DrafterWeights};

use crate::api::Drafter;
use crate::backend::WeightCheck;
use crate::backend::{Backend, PosOf, RopeSeg, WeightRef};
use crate::cpu::{ops, CpuBackend};
use crate::model::check::{check_host_bytes, check_upload, expected_xxh3};
use crate::model::source::Slab;
use crate::model::weights::{tensor_at, Mat};
use anyhow::{bail, ensure, Context, Result};
use half::bf16;
use kdtree_formats::config::DrafterConfig;
use std::sync::Arc;

/// One draft layer's weights on the backend (names as [`DraftLayer`]).
struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    q_proj: B::Mat,
    k_proj: B::Mat,
    v_proj: B::Mat,
    o_proj: B::Mat,
    q_norm: B::Vector,
    k_norm: B::Vector,
    post_attention_layernorm: B::Vector,
    gate_proj: B::Mat,
    up_proj: B::Mat,
    down_proj: B::Mat,
}

/// Cached context K/V of one layer: row caches (`Backend::reserve_rows`) whose first `ctx_pos` rows are the
/// committed context; rows after it are scratch (a device round writes a padded block there).
struct LayerCache<B: Backend> {
    k: B::Act, // [>= C, Hk*D] after k_norm and RoPE
    v: B::Act, // [>= C, Hk*D]
}

/// A drafter's stash: taps `[STASH_ROWS, n_taps·H]` of committed tokens whose context rows are not written
/// yet (feed steps, [`DFlashDrafter::stash_rows`]); its first `n` rows follow the written context. The
/// committed context is the written rows and then these ([`Drafter::context_len`]); a draft or a context
/// write writes them first ([`DFlashDrafter::flush`]), as one forward of their rows.
struct Stash<B: Backend> {
    taps: B::Act,
    /// The count where the ops read it (a captured step advances it).
    pos: B::Pos,
    /// Its host copy.
    n: usize,
    /// Identifies the stash's storage (a captured feed step stays valid while it does not change).
    id: u64,
}

/// A drafter's uploaded weights (shared between sessions).
struct Params<B: Backend> {
    fc: B::Mat,             // [H, n_tap*H]
    hidden_norm: B::Vector, // [H]
    norm: B::Vector,        // [H]
    layers: Vec<Layer<B>>,
    inv_freq: B::VectorF32, // [D/2], where the ops read it
}

/// Rows of a drafter's stash (feed steps between two flushes; a full stash is flushed).
pub const STASH_ROWS: usize = 64;

/// Rows of one forward of [`DFlashDrafter::flush_batch`]: within the rows where the GPU's batch-invariant
/// kernels keep one reduction order (`cuda::ops::w4a16_gemm::INVARIANT_MAX_ROWS`), so with them on a batch's
/// flush writes what each session's own flush writes.
pub const FLUSH_ROWS: usize = 2048;

/// Distinct drafters (a captured round is keyed by the drafter it drafted with).
static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A DFlash drafter session on backend `B`.
pub struct DFlashDrafter<B: Backend = CpuBackend> {
    b: B,
    dims: DrafterDims,
    /// The uploaded weights, shared by every session forked from this one ([`DFlashDrafter::fork`]).
    p: Arc<Params<B>>,
    tables: Arc<dyn TargetTables<B>>,
    attention_factor: f64,
    cache: Vec<LayerCache<B>>,
    /// Context rows written (K/V cached), where the ops read it and on the host.
    ctx_pos: B::Pos,
    /// Taps of committed tokens whose context rows are not written yet (feed steps), made on first use.
    stash: Option<Stash<B>>,
    /// `[bonus, mask × (B−1)]` of the device round (slot 0 copied from the tree's root).
    block_ids: B::Ids,
    /// This drafter, and a count of its caches' moves (both key a captured round).
    uid: u64,
    moves: u64,
}

impl DFlashDrafter<CpuBackend> {
    /// Load the drafter of a converted model (`drafter.*` tensors, gathered over ranks) with the target's
    /// tables, on the CPU. Errors when the model has no drafter.
    pub fn load(src: &dyn crate::model::TensorSource, tables: Arc<dyn TargetTables>) -> Result<Self> {
        Self::load_on(CpuBackend::default(), src, tables)
    }
    /// A CPU drafter from host weights.
    pub fn new(cfg: &DrafterConfig, w: DrafterWeights, tables: Arc<dyn TargetTables>) -> Result<Self> {
        Self::new_on(CpuBackend::default(), cfg, w, tables)
    }
}

impl<B: Backend> DFlashDrafter<B> {
    /// [`DFlashDrafter::load`] on backend `b`. A rank slice (`TensorSource::slice_rank`) loads that rank's
    /// own shards as a drafter of [`weights::slice_config`]'s dims ([`DFlashDrafter::load_slice`]).
    pub fn load_on(b: B, src: &dyn crate::model::TensorSource, tables: Arc<dyn TargetTables<B>>) -> Result<Self> {
        let cfg = src
            .drafter_config()
            .ok_or_else(|| anyhow::anyhow!("model has no drafter (no drafter config)"))?
            .clone();
        if let Some(rank) = src.slice_rank() {
            return Self::load_slice(b, src, &cfg, rank, tables);
        }
        let dims = DrafterDims::from_config(&cfg)?;
        let check = b.weight_check() != WeightCheck::Off; // the gathered shards are host bytes: both forms
        let w = DrafterWeights::load_with(&dims, |name, shape| {
            if check {
                crate::model::source::check_shards(src, name)?;
            }
            let (v, logical) = crate::model::source::gather_bf16(src, name)?;
            ensure!(
                logical == shape,
                "{name}: logical shape {logical:?}, expected {shape:?}"
            );
            Ok(v)
        })?;
        Self::new_on(b, &cfg, w, tables)
    }

    /// Rank `rank` of a rank slice: the rank's own `drafter.*` shards (heads, kv heads and intermediate
    /// split by the plan, fc and norms replicated), each filled on the backend when the source says so
    /// (dummy weights: no host copy) or uploaded, as the drafter of `weights::slice_config(cfg, R)`:
    /// what one GPU of R computes, without the all-reduces.
    pub fn load_slice(
        b: B,
        src: &dyn crate::model::TensorSource,
        cfg: &DrafterConfig,
        rank: usize,
        tables: Arc<dyn TargetTables<B>>,
    ) -> Result<Self> {
        use crate::model::source::{expect, pod_vec};
        let scfg = weights::slice_config(cfg, src.ranks())?;
        let dims = DrafterDims::from_config(&scfg)?;
        let get = |name: &str, shape: &[usize]| -> Result<(kdtree_formats::TensorRef<'_>, Option<ops::Fill>)> {
            Ok((
                expect(src, name, rank, kdtree_formats::Dtype::BF16, shape)?,
                src.fill(name, rank),
            ))
        };
        // The load check: the shard's bytes (`Host`), or the upload's where the ops read them (`Device`), against
        // the manifest's xxh3.
        let check = |name: &str, t: &kdtree_formats::TensorRef<'_>, w: WeightRef<'_, B>| match b.weight_check() {
            WeightCheck::Off => Ok(()),
            WeightCheck::Host => check_host_bytes(&tensor_at(name, rank, t), t),
            WeightCheck::Device => check_upload(&b, &tensor_at(name, rank, t), expected_xxh3(t), w, 0),
        };
        let mat = |name: String, rows: usize, cols: usize| -> Result<B::Mat> {
            match get(&name, &[rows, cols])? {
                (_, Some(f)) => b
                    .fill_bf16(rows, cols, &f)
                    .with_context(|| format!("filling {name} (rank {rank})")),
                (t, None) => {
                    let m = b.upload_bf16(Mat {
                        w: Slab::Owned(pod_vec(t.data)),
                        rows,
                        cols,
                    })?;
                    check(&name, &t, WeightRef::Mat(&m))?;
                    Ok(m)
                }
            }
        };
        let vector = |name: String, n: usize| -> Result<B::Vector> {
            match get(&name, &[n])? {
                (_, Some(f)) => b
                    .fill_vector(n, &f)
                    .with_context(|| format!("filling {name} (rank {rank})")),
                (t, None) => {
                    let v = b.upload_vector(Slab::Owned(pod_vec(t.data)))?;
                    check(&name, &t, WeightRef::Vector(&v))?;
                    Ok(v)
                }
            }
        };
        let (h, qd, kd, i, hd) = (
            dims.hidden,
            dims.heads * dims.head_dim,
            dims.kv_heads * dims.head_dim,
            dims.intermediate,
            dims.head_dim,
        );
        let mut layers = Vec::with_capacity(dims.layers);
        for l in 0..dims.layers {
            let p = format!("drafter.layers.{l}.");
            layers.push(Layer {
                input_layernorm: vector(format!("{p}input_layernorm.weight"), h)?,
                q_proj: mat(format!("{p}self_attn.q_proj.weight"), qd, h)?,
                k_proj: mat(format!("{p}self_attn.k_proj.weight"), kd, h)?,
                v_proj: mat(format!("{p}self_attn.v_proj.weight"), kd, h)?,
                o_proj: mat(format!("{p}self_attn.o_proj.weight"), h, qd)?,
                q_norm: vector(format!("{p}self_attn.q_norm.weight"), hd)?,
                k_norm: vector(format!("{p}self_attn.k_norm.weight"), hd)?,
                post_attention_layernorm: vector(format!("{p}post_attention_layernorm.weight"), h)?,
                gate_proj: mat(format!("{p}mlp.gate_proj.weight"), i, h)?,
                up_proj: mat(format!("{p}mlp.up_proj.weight"), i, h)?,
                down_proj: mat(format!("{p}mlp.down_proj.weight"), h, i)?,
            });
        }
        let fc = mat("drafter.fc.weight".into(), h, dims.n_taps * h)?;
        let (hidden_norm, norm) = (
            vector("drafter.hidden_norm.weight".into(), h)?,
            vector("drafter.norm.weight".into(), h)?,
        );
        Self::assemble(b, &scfg, dims, (fc, hidden_norm, norm), layers, tables)
    }

    /// Upload host weights `w` to `b` and start an empty session.
    pub fn new_on(b: B, cfg: &DrafterConfig, w: DrafterWeights, tables: Arc<dyn TargetTables<B>>) -> Result<Self> {
        let dims = DrafterDims::from_config(cfg)?;
        ensure!(
            w.layers.len() == dims.layers,
            "drafter: {} layers loaded, config says {}",
            w.layers.len(),
            dims.layers
        );
        let (h, qd, kd, i) = (
            dims.hidden,
            dims.heads * dims.head_dim,
            dims.kv_heads * dims.head_dim,
            dims.intermediate,
        );
        // With the load check on, every upload's bytes where the ops read them are compared with the host
        // bytes they came from (`load_on` checked those against the manifest, shard by shard).
        let hash = |v: &[bf16]| {
            (b.weight_check() == WeightCheck::Device).then(|| {
                (
                    kdtree_formats::manifest::xxh3_64(bytemuck::cast_slice(v)),
                    "the xxh3 of the host bytes",
                )
            })
        };
        let mat = |what: String, v: Vec<bf16>, rows: usize, cols: usize| -> Result<B::Mat> {
            let host = hash(&v);
            let m = b.upload_bf16(Mat {
                w: Slab::Owned(v),
                rows,
                cols,
            })?;
            if let Some(want) = host {
                check_upload(&b, &format!("drafter {what}"), want, WeightRef::Mat(&m), 0)?;
            }
            Ok(m)
        };
        let vector = |what: String, v: Vec<bf16>| -> Result<B::Vector> {
            let host = hash(&v);
            let x = b.upload_vector(Slab::Owned(v))?;
            if let Some(want) = host {
                check_upload(&b, &format!("drafter {what}"), want, WeightRef::Vector(&x), 0)?;
            }
            Ok(x)
        };
        let mut layers = Vec::with_capacity(dims.layers);
        for (j, l) in w.layers.into_iter().enumerate() {
            let p = format!("layers.{j}.");
            layers.push(Layer {
                input_layernorm: vector(format!("{p}input_layernorm"), l.input_layernorm)?,
                q_proj: mat(format!("{p}q_proj"), l.q_proj, qd, h)?,
                k_proj: mat(format!("{p}k_proj"), l.k_proj, kd, h)?,
                v_proj: mat(format!("{p}v_proj"), l.v_proj, kd, h)?,
                o_proj: mat(format!("{p}o_proj"), l.o_proj, h, qd)?,
                q_norm: vector(format!("{p}q_norm"), l.q_norm)?,
                k_norm: vector(format!("{p}k_norm"), l.k_norm)?,
                post_attention_layernorm: vector(format!("{p}post_attention_layernorm"), l.post_attention_layernorm)?,
                gate_proj: mat(format!("{p}gate_proj"), l.gate_proj, i, h)?,
                up_proj: mat(format!("{p}up_proj"), l.up_proj, i, h)?,
                down_proj: mat(format!("{p}down_proj"), l.down_proj, h, i)?,
            });
        }
        let (fc, hidden_norm, norm) = (
            mat("fc".into(), w.fc, h, dims.n_taps * h)?,
            vector("hidden_norm".into(), w.hidden_norm)?,
            vector("norm".into(), w.norm)?,
        );
        Self::assemble(b, cfg, dims, (fc, hidden_norm, norm), layers, tables)
    }

    /// A session over uploaded weights: (fc, hidden_norm, norm) and the layers, checked against the tables.
    fn assemble(
        b: B,
        cfg: &DrafterConfig,
        dims: DrafterDims,
        top: (B::Mat, B::Vector, B::Vector),
        layers: Vec<Layer<B>>,
        tables: Arc<dyn TargetTables<B>>,
    ) -> Result<Self> {
        ensure!(
            tables.hidden_size() == dims.hidden,
            "drafter hidden {} != target hidden {}",
            dims.hidden,
            tables.hidden_size()
        );
        ensure!(
            tables.vocab_size() == dims.vocab,
            "drafter vocab {} != target vocab {}",
            dims.vocab,
            tables.vocab_size()
        );
        let (fc, hidden_norm, norm) = top;
        let inv_freq = b.upload_vector_f32(Slab::Owned(ops::yarn_inv_freq(
            dims.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling.as_ref(),
        )))?;
        let attention_factor = ops::yarn_attention_factor(cfg.rope_scaling.as_ref());
        let p = Arc::new(Params {
            fc,
            hidden_norm,
            norm,
            layers,
            inv_freq,
        });
        Ok(Self::session(b, dims, p, tables, attention_factor))
    }

    /// An empty session over shared weights.
    fn session(
        b: B,
        dims: DrafterDims,
        p: Arc<Params<B>>,
        tables: Arc<dyn TargetTables<B>>,
        attention_factor: f64,
    ) -> Self {
        let cache = (0..dims.layers)
            .map(|_| LayerCache {
                k: b.act_from_host(Vec::new()),
                v: b.act_from_host(Vec::new()),
            })
            .collect();
        let mut ids = vec![dims.mask_token_id; dims.block];
        ids[0] = 0;
        let (ctx_pos, block_ids) = (b.pos_new(0), b.ids_from_host(&ids));
        let uid = NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        DFlashDrafter {
            b,
            dims,
            p,
            tables,
            attention_factor,
            cache,
            ctx_pos,
            stash: None,
            block_ids,
            uid,
            moves: 0,
        }
    }

    /// A new, empty session over the same weights (no copy): one per sequence of a batch.
    pub fn fork(&self) -> Self {
        Self::session(
            self.b.clone(),
            self.dims.clone(),
            self.p.clone(),
            self.tables.clone(),
            self.attention_factor,
        )
    }
    pub fn dims(&self) -> &DrafterDims {
        &self.dims
    }
    pub fn rope_attention_factor(&self) -> f64 {
        self.attention_factor
    }

    /// [`Drafter::extend_context`] from taps `[n, n_taps·H]` already where the ops run (after the stash's
    /// rows). Up to a block of rows is padded to the block (zero taps), the device round's fixed shape, so
    /// both compute the same.
    pub fn extend_context_act(&mut self, taps: &B::Act, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.flush()?;
        self.write_rows(taps, n)
    }

    /// Context rows from taps `[n, n_taps·H]` after the written ones (the stash empty), padded as
    /// [`DFlashDrafter::extend_context_act`] says; outside a captured step.
    fn write_rows(&mut self, taps: &B::Act, n: usize) -> Result<()> {
        let rows = n.max(self.dims.block);
        let tw = self.dims.n_taps * self.dims.hidden;
        let padded;
        let taps = if rows > n {
            let mut p = self.b.zeros(rows * tw);
            self.b.set_cols(&mut p, tw, 0, taps, tw, n);
            padded = p;
            &padded
        } else {
            taps
        };
        self.reserve_context(rows);
        self.write_context(taps, rows);
        self.b.pos_add(&mut self.ctx_pos, n);
        self.b.check()
    }

    /// Taps of committed tokens held in the stash (their context rows not written yet).
    pub fn stashed(&self) -> usize {
        self.stash.as_ref().map_or(0, |s| s.n)
    }

    /// Write the stash's rows into the context in one forward ([`DFlashDrafter::extend_context_act`]'s), the
    /// stash then empty; outside a captured step. Nothing when it is empty.
    pub fn flush(&mut self) -> Result<()> {
        let tw = self.dims.n_taps * self.dims.hidden;
        let taps = match self.stash.as_mut() {
            Some(s) if s.n > 0 => {
                let taps = self.b.rows(&s.taps, tw, 0, s.n);
                self.b.pos_set(&mut s.pos, 0);
                (taps, std::mem::take(&mut s.n))
            }
            _ => return Ok(()),
        };
        self.write_rows(&taps.0, taps.1)
    }

    /// [`DFlashDrafter::flush`] of several sessions of one drafter's weights (a batch's round after feed
    /// rounds): every stash's rows in forwards of up to [`FLUSH_ROWS`] rows, each stash padded to a block as
    /// alone, instead of one forward per session. Sessions with an empty stash are left as they are.
    pub fn flush_batch(ds: &mut [&mut DFlashDrafter<B>]) -> Result<()> {
        let mut full: Vec<&mut DFlashDrafter<B>> =
            ds.iter_mut().map(|d| &mut **d).filter(|d| d.stashed() > 0).collect();
        if full.len() < 2 {
            for d in full {
                d.flush()?;
            }
            return Ok(());
        }
        let (b, bl, tw) = (
            full[0].b.clone(),
            full[0].dims.block,
            full[0].dims.n_taps * full[0].dims.hidden,
        );
        // Chunks of sessions whose padded rows fit one forward (a session's own rows always do: the stash
        // holds at most STASH_ROWS).
        let mut at = 0;
        while at < full.len() {
            let (mut end, mut rows) = (at, 0);
            while end < full.len() && (end == at || rows + full[end].stashed().max(bl) <= FLUSH_ROWS) {
                rows += full[end].stashed().max(bl);
                end += 1;
            }
            let chunk = &mut full[at..end];
            let n: Vec<usize> = chunk.iter().map(|d| d.stashed()).collect();
            let padded: Vec<usize> = n.iter().map(|&k| k.max(bl)).collect();
            let mut x = b.zeros(rows * tw);
            let mut to = 0;
            for (d, (&k, &r)) in chunk.iter_mut().zip(n.iter().zip(&padded)) {
                let s = d.stash.as_mut().context("a stash with rows")?;
                b.set_rows(&mut x, tw, to, &b.rows(&s.taps, tw, 0, k), k);
                b.pos_set(&mut s.pos, 0);
                s.n = 0;
                to += r;
            }
            for (d, &r) in chunk.iter_mut().zip(&padded) {
                d.reserve_context(r);
            }
            Self::write_context_segs(chunk, &x, &padded)?;
            for (d, &k) in chunk.iter_mut().zip(&n) {
                b.pos_add(&mut d.ctx_pos, k);
            }
            at = end;
        }
        b.check()
    }

    /// Before a captured step that stashes one row (outside it): the stash's storage, and room for the row
    /// (a full stash is flushed first).
    pub fn stash_room(&mut self) -> Result<()> {
        let tw = self.dims.n_taps * self.dims.hidden;
        if self.stashed() >= STASH_ROWS {
            self.flush()?;
        }
        let b = &self.b;
        let s = self.stash.get_or_insert_with(|| Stash {
            taps: b.act_from_host(Vec::new()),
            pos: b.pos_new(0),
            n: 0,
            id: 0,
        });
        if b.reserve_rows(&mut s.taps, tw, STASH_ROWS) || s.id == 0 {
            s.id = NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Identifies the stash a captured feed step writes (its storage and counter; 0 before
    /// [`DFlashDrafter::stash_room`]): the step does not read the context caches, so their moves do not
    /// invalidate it.
    pub fn stash_key(&self) -> u64 {
        self.stash.as_ref().map_or(0, |s| s.id)
    }

    /// Inside a captured step (after each one's [`DFlashDrafter::stash_room`]): row s of `taps`
    /// `[ds.len(), n_taps·H]` (the taps of the token sequence s's step commits) into drafter s's stash, the
    /// counts advanced where the ops run, in one launch; [`DFlashDrafter::stash_follow`] moves each host copy
    /// after the step ran.
    pub fn stash_rows(ds: &mut [&mut DFlashDrafter<B>], taps: &B::Act) -> Result<()> {
        let Some(d0) = ds.first() else { return Ok(()) };
        let (b, tw) = (d0.b.clone(), d0.dims.n_taps * d0.dims.hidden);
        let mut dsts = Vec::with_capacity(ds.len());
        for d in ds.iter_mut() {
            ensure!(
                d.dims.n_taps * d.dims.hidden == tw,
                "stash_rows: drafters of different tap widths"
            );
            let s = d.stash.as_mut().context("stash_rows before stash_room")?;
            dsts.push((&mut s.taps, &mut s.pos));
        }
        b.stash_rows(&mut dsts, tw, taps)
    }

    /// After a step that ran [`DFlashDrafter::stash_rows`]: the host copy of the stash's count.
    pub fn stash_follow(&mut self) {
        if let Some(s) = self.stash.as_mut() {
            self.b.pos_add_host(&mut s.pos, 1);
            s.n += 1;
        }
    }

    /// Keep the first `n` stashed rows (n <= stashed).
    pub(crate) fn stash_keep(&mut self, n: usize) {
        if let Some(s) = self.stash.as_mut().filter(|s| s.n != n) {
            self.b.pos_set(&mut s.pos, n);
            s.n = n;
        }
    }

    /// Room for `rows` context rows after the written ones (outside a captured round).
    pub fn reserve_context(&mut self, rows: usize) {
        let (b, kw) = (&self.b, self.dims.kv_heads * self.dims.head_dim);
        let need = b.pos_get(&self.ctx_pos) + rows;
        for c in &mut self.cache {
            let moved = b.reserve_rows(&mut c.k, kw, need) | b.reserve_rows(&mut c.v, kw, need);
            self.moves += moved as u64;
        }
    }

    /// Context K/V of taps `[rows, n_taps·H]` at positions `ctx_pos..ctx_pos + rows`, written after the
    /// committed rows (room reserved); the committed length is not advanced.
    pub fn write_context(&mut self, taps: &B::Act, rows: usize) {
        let DrafterDims {
            kv_heads,
            head_dim,
            eps,
            ..
        } = self.dims;
        let b = &self.b;
        let ctx = b.rms_norm(&b.linear(taps, rows, &self.p.fc), &self.p.hidden_norm, eps); // [rows, H]
        let rope = b.rope_at(
            &self.p.inv_freq,
            self.attention_factor,
            PosOf::Pos(&self.ctx_pos),
            None,
            rows,
        );
        for (lw, c) in self.p.layers.iter().zip(self.cache.iter_mut()) {
            // k: [rows, Hk*D]
            let k = b.head_norm_rope_neox(&b.linear(&ctx, rows, &lw.k_proj), &lw.k_norm, eps, kv_heads, &rope);
            let v = b.linear(&ctx, rows, &lw.v_proj); // [rows, Hk*D]
            b.write_rows_at(&mut c.k, kv_heads * head_dim, &self.ctx_pos, &k, rows);
            b.write_rows_at(&mut c.v, kv_heads * head_dim, &self.ctx_pos, &v, rows);
        }
    }

    /// [`Drafter::draft`] leaving the logits `[B−1, V]` where the ops run (the stash written first).
    pub fn draft_act(&mut self, bonus: u32, start: usize) -> Result<B::Act> {
        self.flush()?;
        let DrafterDims {
            block: bl,
            mask_token_id,
            ..
        } = self.dims;
        if start != self.context_len() {
            bail!(
                "draft: block starts at {start} but the drafter context holds {} positions",
                self.context_len()
            );
        }
        let mut ids = vec![mask_token_id; bl];
        ids[0] = bonus;
        let ids = self.b.ids_from_host(&ids);
        self.draft_ids(&ids)
    }

    /// The device round's draft: the block's bonus is the root token `root` `[1]` where the ops read it (the
    /// stash flushed before the round).
    pub fn draft_from_root(&mut self, root: &B::Ids) -> Result<B::Act> {
        ensure!(
            self.stashed() == 0,
            "draft: {} stashed context rows not flushed",
            self.stashed()
        );
        self.b.ids_copy(&mut self.block_ids, 0, root, 1);
        self.draft_ids(&self.block_ids)
    }

    /// The block of `ids` `[B]` at positions `ctx_pos..ctx_pos + B`: logits `[B−1, V]` of block rows 1..B−1.
    fn draft_ids(&self, ids: &B::Ids) -> Result<B::Act> {
        let DrafterDims {
            hidden: h,
            heads,
            kv_heads,
            head_dim,
            block: bl,
            eps,
            ..
        } = self.dims;
        let b = &self.b;
        let rope = b.rope_at(
            &self.p.inv_freq,
            self.attention_factor,
            PosOf::Pos(&self.ctx_pos),
            None,
            bl,
        );
        let mut x = self.tables.embed_ids(ids, bl); // [B, H]
        for (lw, c) in self.p.layers.iter().zip(&self.cache) {
            // hn: [B, H], q: [B, Hq*D], kb: [B, Hk*D]
            let hn = b.rms_norm(&x, &lw.input_layernorm, eps);
            let q = b.head_norm_rope_neox(&b.linear(&hn, bl, &lw.q_proj), &lw.q_norm, eps, heads, &rope);
            let kb = b.head_norm_rope_neox(&b.linear(&hn, bl, &lw.k_proj), &lw.k_norm, eps, kv_heads, &rope);
            let vb = b.linear(&hn, bl, &lw.v_proj); // [B, Hk*D]
            let att = b.gqa_attention(
                &q,
                bl,
                (&c.k, &c.v),
                &self.ctx_pos,
                (&kb, &vb),
                heads,
                kv_heads,
                head_dim,
            ); // [B, Hq*D]
            b.add(&mut x, &b.linear(&att, bl, &lw.o_proj));
            let hn = b.rms_norm(&x, &lw.post_attention_layernorm, eps);
            let g = b.linear(&hn, bl, &lw.gate_proj); // [B, I]
            let u = b.linear(&hn, bl, &lw.up_proj); // [B, I]
            b.add(&mut x, &b.linear_in(&b.silu_mul_in(&g, &u), bl, &lw.down_proj));
        }
        let xn = b.rms_norm(&b.rows(&x, h, 1, bl), &self.p.norm, eps); // [B-1, H]: block positions 1..B-1
        let logits = self.tables.lm_head(&xn, bl - 1);
        b.check()?;
        Ok(logits)
    }

    /// The drafts of several sessions of this drafter's weights (a batch) in one forward: session s drafts
    /// the block `[roots[s], mask × (B−1)]` at its own positions over its own context; every projection, the
    /// norms and lm_head run over all N·B rows at once, the block attention per session. `ids`: room for N·B
    /// ids. Returns logits `[N·(B−1), V]`, session s's rows from s·(B−1) (what [`DFlashDrafter::draft_from_root`]
    /// gives each alone, up to the GEMMs' summation order on a device).
    pub fn draft_batch(ds: &mut [&mut DFlashDrafter<B>], roots: &[&B::Ids], ids: &mut B::Ids) -> Result<B::Act> {
        let Some(d0) = ds.first() else {
            bail!("draft_batch: no sessions")
        };
        ensure!(
            roots.len() == ds.len(),
            "draft_batch: {} roots for {} sessions",
            roots.len(),
            ds.len()
        );
        ensure!(
            ds.iter().all(|d| Arc::ptr_eq(&d.p, &d0.p)),
            "draft_batch: sessions of different drafters"
        );
        let (b, p, dims, factor, tables) = (
            d0.b.clone(),
            d0.p.clone(),
            d0.dims.clone(),
            d0.attention_factor,
            d0.tables.clone(),
        );
        let DrafterDims {
            hidden: h,
            heads,
            kv_heads,
            head_dim,
            block: bl,
            eps,
            ..
        } = dims;
        let n = ds.len();
        ensure!(
            ds.iter().all(|d| d.stashed() == 0),
            "draft_batch: stashed context rows not flushed"
        );
        // Every block [root, mask × (B−1)] and every block's positions (from its context length), one launch each.
        b.ids_blocks(ids, roots, bl, dims.mask_token_id);
        let at: Vec<RopeSeg<'_, B>> = ds.iter().map(|d| (PosOf::Pos(&d.ctx_pos), None, bl)).collect();
        let rope = b.rope_at_segs(&p.inv_freq, factor, &at);
        drop(at);
        let rows = n * bl;
        let mut x = tables.embed_ids(ids, rows); // [N·B, H]
        for (l, lw) in p.layers.iter().enumerate() {
            let hn = b.rms_norm(&x, &lw.input_layernorm, eps);
            // q: [N·B, Hq*D]
            let q = b.head_norm_rope_neox(&b.linear(&hn, rows, &lw.q_proj), &lw.q_norm, eps, heads, &rope);
            // kb: [N·B, Hk*D]
            let kb = b.head_norm_rope_neox(&b.linear(&hn, rows, &lw.k_proj), &lw.k_norm, eps, kv_heads, &rope);
            let vb = b.linear(&hn, rows, &lw.v_proj);
            // Each block over its own context, every sequence in one call.
            let ctx: Vec<(&B::Act, &B::Act, &B::Pos)> =
                ds.iter().map(|d| (&d.cache[l].k, &d.cache[l].v, &d.ctx_pos)).collect();
            let att = b.gqa_attention_segs(&q, bl, &ctx, (&kb, &vb), heads, kv_heads, head_dim);
            b.add(&mut x, &b.linear(&att, rows, &lw.o_proj));
            let hn = b.rms_norm(&x, &lw.post_attention_layernorm, eps);
            let g = b.linear(&hn, rows, &lw.gate_proj);
            let u = b.linear(&hn, rows, &lw.up_proj);
            b.add(&mut x, &b.linear_in(&b.silu_mul_in(&g, &u), rows, &lw.down_proj));
        }
        // Block positions 1..B−1 of every session, stacked: x as [N, B·H] without each row's first H columns.
        let tail = b.cols(&x, bl * h, h, (bl - 1) * h, n);
        let logits = tables.lm_head(&b.rms_norm(&tail, &p.norm, eps), n * (bl - 1));
        b.check()?;
        Ok(logits)
    }

    /// [`DFlashDrafter::write_context`] of several sessions of this drafter's weights in one forward: session
    /// s's `rows` taps are rows `[s·rows, (s+1)·rows)` of `taps`, written after its committed context.
    pub fn write_context_batch(ds: &mut [&mut DFlashDrafter<B>], taps: &B::Act, rows: usize) -> Result<()> {
        let rows = vec![rows; ds.len()];
        Self::write_context_segs(ds, taps, &rows)
    }

    /// [`DFlashDrafter::write_context`] of several sessions in one forward, session s's `rows[s]` taps the next
    /// rows of `taps` (in session order); the committed lengths are not advanced.
    fn write_context_segs(ds: &mut [&mut DFlashDrafter<B>], taps: &B::Act, rows: &[usize]) -> Result<()> {
        let Some(d0) = ds.first() else { return Ok(()) };
        ensure!(
            ds.iter().all(|d| Arc::ptr_eq(&d.p, &d0.p)),
            "write_context_batch: sessions of different drafters"
        );
        ensure!(
            rows.len() == ds.len(),
            "write_context_batch: {} row counts for {} sessions",
            rows.len(),
            ds.len()
        );
        let (b, p, dims, factor) = (d0.b.clone(), d0.p.clone(), d0.dims.clone(), d0.attention_factor);
        let DrafterDims {
            kv_heads,
            head_dim,
            eps,
            ..
        } = dims;
        let (all, kw): (usize, usize) = (rows.iter().sum(), kv_heads * head_dim);
        ensure!(
            ds.iter().all(|d| d.stashed() == 0),
            "write_context_batch: stashed context rows not flushed"
        );
        let ctx = b.rms_norm(&b.linear(taps, all, &p.fc), &p.hidden_norm, eps); // [Σ rows, H]
        let at: Vec<RopeSeg<'_, B>> = ds
            .iter()
            .zip(rows)
            .map(|(d, &n)| (PosOf::Pos(&d.ctx_pos), None, n))
            .collect();
        let rope = b.rope_at_segs(&p.inv_freq, factor, &at);
        drop(at);
        for (l, lw) in p.layers.iter().enumerate() {
            let k = b.head_norm_rope_neox(&b.linear(&ctx, all, &lw.k_proj), &lw.k_norm, eps, kv_heads, &rope);
            let v = b.linear(&ctx, all, &lw.v_proj);
            // Every session's rows at its own context length, keys then values: one call each.
            let (mut ks, mut vs): (Vec<_>, Vec<_>) = ds
                .iter_mut()
                .zip(rows)
                .map(|(d, &n)| {
                    let DFlashDrafter { cache, ctx_pos, .. } = &mut **d;
                    let c = &mut cache[l];
                    ((&mut c.k, &*ctx_pos, n), (&mut c.v, &*ctx_pos, n))
                })
                .unzip();
            b.write_rows_at_segs(&mut ks, kw, &k);
            b.write_rows_at_segs(&mut vs, kw, &v);
        }
        b.check()
    }

    /// [`DFlashDrafter::extend_context_act`] of several sessions (a batch's prompts) in one forward: session s's
    /// `n[s]` taps are the next rows of `taps` (in session order), each padded to a block as alone.
    pub fn extend_context_batch(ds: &mut [&mut DFlashDrafter<B>], taps: &B::Act, n: &[usize]) -> Result<()> {
        let Some(d0) = ds.first() else { return Ok(()) };
        let (b, bl, tw) = (d0.b.clone(), d0.dims.block, d0.dims.n_taps * d0.dims.hidden);
        ensure!(
            n.len() == ds.len(),
            "extend_context_batch: {} lengths for {} sessions",
            n.len(),
            ds.len()
        );
        for d in ds.iter_mut() {
            d.flush()?;
        }
        // Each session's rows padded to a block with zero taps (as `write_rows`), when any is shorter.
        let rows: Vec<usize> = n.iter().map(|&k| if k == 0 { 0 } else { k.max(bl) }).collect();
        let padded;
        let taps = if rows == n {
            taps
        } else {
            let mut x = b.zeros(rows.iter().sum::<usize>() * tw);
            let (mut from, mut to) = (0, 0);
            for (&k, &r) in n.iter().zip(&rows) {
                b.set_rows(&mut x, tw, to, &b.rows(taps, tw, from, from + k), k);
                (from, to) = (from + k, to + r);
            }
            padded = x;
            &padded
        };
        for (d, &r) in ds.iter_mut().zip(&rows) {
            d.reserve_context(r);
        }
        Self::write_context_segs(ds, taps, &rows)?;
        for (d, &k) in ds.iter_mut().zip(n) {
            if k > 0 {
                b.pos_add(&mut d.ctx_pos, k);
            }
        }
        b.check()
    }

    /// The committed context length where the ops read it (the device round's commit advances it).
    pub fn context_pos_mut(&mut self) -> &mut B::Pos {
        &mut self.ctx_pos
    }

    /// Identifies this drafter and its caches' storage: a captured round that drafted with it stays valid
    /// while this does not change.
    pub fn capture_key(&self) -> (u64, u64) {
        (self.uid, self.moves)
    }
}
