//! The K2.6 target's weights, rank-first: `Weights::ranks[r]` holds everything rank r computes with, read
//! from rank r's own shard files only (`TensorSource::tensor(name, r)`): its head slice of MLA, its slice
//! of the dense / shared MLPs, its routed experts, its vocab shard of embed_tokens / lm_head, and its own
//! copy of every replicated tensor (norms, q_a, kv_a, router). Each is checked against the TP plan of
//! docs/design/interfaces.md (dtype, shape, recorded split), so a test that loads R = 1, 2, 4, 8 proves
//! the engine reads the plan right, then uploaded through the backend (`Backend::upload_*`; the CPU keeps
//! zero-copy [`Slab`] views of the mmapped shards).
//!
//! Must match: k26-format.md §2.2 (names, shapes), §5.2-§5.3 (splits). Tests: engine/tests/target_plans.rs
//! (every plan, zero-copy), engine/tests/target_model.rs.
//!
//! Dimension letters: H hidden, V vocab, R ranks, Hr = heads/R, E experts, I intermediate widths.

use super::check::{check_upload, check_upload_parts, expected_xxh3, host_verdict, HostChecks};
pub use super::config::{ModelConfig, LATENT_NORM_EPS};
use super::source::{expect, expect_split, Slab, TensorSource};
use crate::backend::{Backend, VocabShards, WeightCheck, WeightRef};
pub use crate::backend::{I4Stack, Mat};
use crate::cpu::ops::Fill;
use crate::cpu::CpuBackend;
use anyhow::{bail, ensure, Context, Result};
use kdtree_formats::{Dtype, TensorRef};
use std::sync::Arc;

/// One rank's slice of a SwiGLU MLP: gate/up `[I/R, H]`, down `[H, I/R]`.
pub struct Mlp<B: Backend> {
    pub gate: B::Mat,
    pub up: B::Mat,
    pub down: B::Mat,
}

/// One rank's MLA weights: replicated q_a (+ norm) and kv_a (+ norm), and heads `head0..head0 + Hr`:
/// q_b (or q_proj) `[Hr·qk, ·]`, kv_b `[Hr·(nope+v), kv_lora]`, o_proj `[H, Hr·v]`.
pub struct Attn<B: Backend> {
    /// q_a_proj `[q_lora, H]` and q_a_layernorm `[q_lora]`; None when q_lora_rank is None (q_proj instead).
    pub q_a: Option<(B::Mat, B::Vector)>,
    /// kv_a_proj_with_mqa `[kv_lora + rope, H]`.
    pub kv_a: B::Mat,
    /// kv_a_layernorm `[kv_lora]`.
    pub kv_a_norm: B::Vector,
    pub q: B::Mat,
    pub kv_b: B::Mat,
    pub o_proj: B::Mat,
    pub head0: usize,
}

/// One rank's MoE weights.
pub struct Moe<B: Backend> {
    /// mlp.gate `[E, H]` (replicated).
    pub router: B::Mat,
    /// e_score_correction_bias `[E]` f32 (noaux_tc only, replicated).
    pub bias: Option<B::VectorF32>,
    /// This rank's slice of the shared experts (None when n_shared_experts = 0).
    pub shared: Option<Mlp<B>>,
    /// Routed experts: gate/up `[E_r, I_r, H]`, down `[E_r, H, I_r]`.
    pub gate: B::I4,
    pub up: B::I4,
    pub down: B::I4,
}

pub enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe(Moe<B>),
}

pub struct Layer<B: Backend> {
    pub input_norm: B::Vector,
    pub post_norm: B::Vector,
    pub attn: Attn<B>,
    pub ffn: Ffn<B>,
}

/// Everything rank r computes with.
pub struct RankWeights<B: Backend> {
    /// embed_tokens `[V/R, H]` (vocab-parallel).
    pub embed: B::Mat,
    /// lm_head `[V/R, H]` (vocab-parallel; embed_tokens when tied).
    pub lm_head: B::Mat,
    /// model.norm `[H]` (replicated).
    pub norm: B::Vector,
    pub layers: Vec<Layer<B>>,
}

/// All target weights, rank-first, on backend `B`.
pub struct Weights<B: Backend = CpuBackend> {
    pub backend: B,
    pub cfg: ModelConfig,
    pub ranks: Vec<RankWeights<B>>,
    /// `cfg.inv_freq` where the ops read it (`Backend::rope_at` of the device round).
    pub rope_inv: B::VectorF32,
    /// Global vocab row of `ranks[0]`'s embed_tokens / lm_head shard (0 unless this is one GPU's group of
    /// ranks of a run over several: [`Weights::load_group`]).
    pub vocab_first: usize,
}

/// Loader context of one rank: the source and helpers that check shape and split, then upload.
struct Ld<'a, B: Backend> {
    b: &'a B,
    owner: &'a Arc<dyn TensorSource>,
    /// Rank count R and this rank.
    r: usize,
    rank: usize,
    /// The host form of the load check ([`WeightCheck::Host`]), None otherwise.
    host: Option<&'a HostChecks>,
}

impl<B: Backend> Ld<'_, B> {
    fn src(&self) -> &dyn TensorSource {
        &**self.owner
    }
    /// The host form of the load check of `name` (before its upload, so the hash runs beside it).
    fn check_host(&self, name: &str) {
        if let Some(h) = self.host {
            h.spawn(self.owner, name, self.rank);
        }
    }
    /// Whether the host form hashes the large uploads (matrices, INT4 stacks) in the upload's own copy
    /// (`Resources::hashes_uploads`) rather than beside it.
    fn host_in_upload(&self) -> bool {
        self.host.is_some() && self.b.hashes_uploads()
    }
    /// A bf16 tensor of this rank with shard `shape`, split as `split` (axis, offset) or replicated.
    fn bf16(&self, name: &str, shape: &[usize], split: Option<(usize, usize)>) -> Result<TensorRef<'_>> {
        let t = expect(self.src(), name, self.rank, Dtype::BF16, shape)?;
        match split {
            Some((a, off)) if self.r > 1 => expect_split(&t, name, self.rank, Some(a), off)?,
            // R = 1: the plan may record the split axis with offset 0 or no split at all.
            Some(_) => ensure!(
                t.split_offset == 0,
                "{name}: single rank but split offset {}",
                t.split_offset
            ),
            None => expect_split(&t, name, self.rank, None, 0)?,
        }
        Ok(t)
    }
    /// The source's fill of `name` (a dummy source), naming the tensor when the backend's fill fails.
    fn fill_of(&self, name: &str) -> Option<Fill> {
        self.src().fill(name, self.rank)
    }
    fn mat(&self, name: &str, rows: usize, cols: usize, split: Option<(usize, usize)>) -> Result<B::Mat> {
        let t = self.bf16(name, &[rows, cols], split)?;
        match self.fill_of(name) {
            Some(f) => self
                .b
                .fill_bf16(rows, cols, &f)
                .with_context(|| format!("filling {name} (rank {})", self.rank)),
            None => {
                // SAFETY: `t` was just returned by `self.owner.tensor(..)` (through `expect`).
                let host = Mat {
                    w: unsafe { Slab::new(self.owner, t.data) },
                    rows,
                    cols,
                };
                let m = if self.host_in_upload() {
                    let (m, got) = self.b.upload_bf16_hashed(host)?;
                    host_verdict(&tensor_at(name, self.rank, &t), got, t.xxh3)?;
                    m
                } else {
                    self.check_host(name);
                    self.b.upload_bf16(host)?
                };
                self.check(name, &t, WeightRef::Mat(&m), 0)?;
                Ok(m)
            }
        }
    }
    /// Replicated vector `[n]`.
    fn vector(&self, name: &str, n: usize) -> Result<B::Vector> {
        let t = self.bf16(name, &[n], None)?;
        match self.fill_of(name) {
            Some(f) => self
                .b
                .fill_vector(n, &f)
                .with_context(|| format!("filling {name} (rank {})", self.rank)),
            None => {
                self.check_host(name);
                // SAFETY: as in `mat`.
                let v = self.b.upload_vector(unsafe { Slab::new(self.owner, t.data) })?;
                self.check(name, &t, WeightRef::Vector(&v), 0)?;
                Ok(v)
            }
        }
    }
    /// The device form of the load check ([`check_upload`]): part `part` of the uploaded `w`'s bytes, hashed where
    /// the ops read them, against the manifest's xxh3-64 of `t` (a source without checksums: the host bytes' own).
    /// A difference names the tensor, the rank and both values.
    fn check(&self, name: &str, t: &TensorRef<'_>, w: WeightRef<'_, B>, part: usize) -> Result<()> {
        if self.b.weight_check() != WeightCheck::Device {
            return Ok(()); // (expected_xxh3 would hash the host bytes of a source without checksums)
        }
        check_upload(self.b, &tensor_at(name, self.rank, t), expected_xxh3(t), w, part)
    }
    /// This rank's SwiGLU slice, intermediate `i` split by rows (gate/up) and columns (down).
    fn mlp(&self, p: &str, h: usize, i: usize) -> Result<Mlp<B>> {
        ensure!(
            i.is_multiple_of(self.r),
            "{p}: intermediate {i} does not divide over {} ranks",
            self.r
        );
        let (ir, k) = (i / self.r, self.rank);
        Ok(Mlp {
            gate: self.mat(&format!("{p}gate_proj.weight"), ir, h, Some((0, k * ir)))?,
            up: self.mat(&format!("{p}up_proj.weight"), ir, h, Some((0, k * ir)))?,
            down: self.mat(&format!("{p}down_proj.weight"), h, ir, Some((1, k * ir)))?,
        })
    }
    /// This rank's routed experts `{stem}.{proj}` of logical `[E, n, k]`; TP or EP read from the manifest.
    fn experts(&self, stem: &str, proj: &str, e: usize, n: usize, k: usize) -> Result<B::I4> {
        let (pname, sname, rank) = (
            format!("{stem}.{proj}.weight_packed"),
            format!("{stem}.{proj}.weight_scale"),
            self.rank,
        );
        let p = self.src().tensor(&pname, rank)?;
        let s = self.src().tensor(&sname, rank)?;
        ensure!(
            p.dtype == Dtype::U8 && s.dtype == Dtype::BF16,
            "{pname}: expected U8 + BF16 scales, found {} + {}",
            p.dtype,
            s.dtype
        );
        ensure!(
            p.logical_shape == [e, n, k],
            "{pname}: logical shape {:?}, expected [{e}, {n}, {k}]",
            p.logical_shape
        );
        ensure!(
            p.shape.len() == 3,
            "{pname} (rank {rank}): shape {:?} is not 3-D",
            p.shape
        );
        let (cnt, nr, kr) = (p.shape[0], p.shape[1], p.shape[2] * 2);
        let (first, want_nr, want_kr) = match p.split_axis {
            None if self.r == 1 => (0, n, k),
            Some(0) => (p.split_offset, n, k),
            Some(1) => (0, n / self.r, k),
            Some(2) => (0, n, k / self.r),
            other => bail!("{pname} (rank {rank}): unexpected split axis {other:?}"),
        };
        let want_cnt = if p.split_axis == Some(0) { e / self.r } else { e };
        ensure!(
            (cnt, nr, kr) == (want_cnt, want_nr, want_kr),
            "{pname} (rank {rank}): shard [{cnt}, {nr}, {kr}/2], expected [{want_cnt}, {want_nr}, {want_kr}/2]"
        );
        match p.split_axis {
            Some(0) => ensure!(
                first == rank * cnt,
                "{pname} (rank {rank}): starts at expert {first}, expected {}",
                rank * cnt
            ),
            Some(1) => expect_split(&p, &pname, rank, Some(1), rank * nr)?,
            Some(2) => expect_split(&p, &pname, rank, Some(2), rank * kr)?,
            _ => {}
        }
        ensure!(
            s.shape == [cnt, nr, kr / 32],
            "{sname} (rank {rank}): shape {:?}, expected [{cnt}, {nr}, {}]",
            s.shape,
            kr / 32
        );
        if let (Some(fp), Some(fs)) = (self.fill_of(&pname), self.fill_of(&sname)) {
            return self
                .b
                .fill_i4g32(first, cnt, nr, kr, &fp, &fs)
                .with_context(|| format!("filling {pname} + weight_scale (rank {rank})"));
        }
        // SAFETY: `p` and `s` were just returned by `self.owner.tensor(..)`.
        let (packed, scales) = unsafe { (Slab::new(self.owner, p.data), Slab::new(self.owner, s.data)) };
        let host = I4Stack {
            packed,
            scales,
            first,
            count: cnt,
            n: nr,
            k: kr,
        };
        let (pw, sw) = (tensor_at(&pname, rank, &p), tensor_at(&sname, rank, &s));
        let w = if self.host_in_upload() {
            let (w, [hp, hs]) = self.b.upload_i4g32_hashed(host)?;
            host_verdict(&pw, hp, p.xxh3)?;
            host_verdict(&sw, hs, s.xxh3)?;
            w
        } else {
            self.check_host(&pname);
            self.check_host(&sname);
            self.b.upload_i4g32(host)?
        };
        // One hash of the stack (packed bytes and scales) for both checks: the packed experts are most of a model.
        check_upload_parts(
            self.b,
            WeightRef::I4(&w),
            &[(0, &pw, expected_xxh3(&p)), (1, &sw, expected_xxh3(&s))],
        )?;
        Ok(w)
    }
}

/// `name` of `rank` for a message about its bytes: "NAME (rank R, FILE)", the shard file named where the source
/// has files.
pub(crate) fn tensor_at(name: &str, rank: usize, t: &TensorRef<'_>) -> String {
    match t.file {
        Some(f) => format!("{name} (rank {rank}, {f})"),
        None => format!("{name} (rank {rank})"),
    }
}

impl Weights<CpuBackend> {
    /// Load the target from `src` on the CPU backend.
    pub fn load(src: Arc<dyn TensorSource>) -> Result<Weights<CpuBackend>> {
        Weights::load_on(CpuBackend::default(), src)
    }
}

impl<B: Backend> Weights<B> {
    /// Load the target from `src` (any rank count of the plan) onto backend `b`, rank by rank. A rank
    /// slice (`TensorSource::slice_rank` = Some(r)) loads rank r only: `ranks` holds that one rank, so every
    /// all-reduce sees one partial (what one GPU of R computes, without the communication), and the model's
    /// vocabulary is that rank's V/R rows of embed_tokens / lm_head as ids 0..V/R (`cfg.vocab` = V/R).
    /// Tensors the source marks with a fill are filled on the backend (`Backend::fill_*`), the rest uploaded.
    pub fn load_on(b: B, src: Arc<dyn TensorSource>) -> Result<Weights<B>> {
        Self::load_held(b, src, None)
    }

    /// Ranks `group` of `src`'s plan only (one GPU's share of a run over several, `crate::tp`): `ranks` holds
    /// them, every all-reduce sums their partials and then goes through the backend's communicator, and the
    /// vocabulary stays global (`cfg.vocab` = V; the group's embed_tokens / lm_head rows start at
    /// [`Weights::vocab_first`], the other GPUs' rows are summed in by the communicator). Only the group's own
    /// shard files are read.
    pub fn load_group(b: B, src: Arc<dyn TensorSource>, group: std::ops::Range<usize>) -> Result<Weights<B>> {
        ensure!(
            src.slice_rank().is_none(),
            "a rank slice cannot be loaded as a group of ranks"
        );
        ensure!(
            !group.is_empty() && group.end <= src.ranks(),
            "ranks {group:?} of a {}-rank plan",
            src.ranks()
        );
        Self::load_held(b, src, Some(group))
    }

    fn load_held(b: B, src: Arc<dyn TensorSource>, group: Option<std::ops::Range<usize>>) -> Result<Weights<B>> {
        let t = src.text_config().clone();
        let r = src.ranks();
        let mut cfg = ModelConfig::from_text(&t, r)?;
        let (v, nh) = (cfg.vocab, cfg.heads);
        ensure!(r >= 1 && nh % r == 0, "{nh} heads do not divide over {r} ranks");
        ensure!(v % r == 0, "vocab {v} does not divide over {r} ranks");
        let held: Vec<usize> = match (src.slice_rank(), &group) {
            (Some(k), _) => {
                ensure!(k < r, "rank slice {k} of a {r}-rank plan");
                vec![k]
            }
            (None, Some(g)) => g.clone().collect(),
            (None, None) => (0..r).collect(),
        };
        let prefix = ["language_model.", ""]
            .into_iter()
            .find(|p| src.tensor(&format!("{p}model.embed_tokens.weight"), held[0]).is_ok())
            .ok_or_else(|| anyhow::anyhow!("no embed_tokens.weight (tried prefixes \"language_model.\" and \"\")"))?;
        let host = (b.weight_check() == WeightCheck::Host).then(HostChecks::new);
        let ranks = held
            .iter()
            .map(|&rank| {
                load_rank(
                    &Ld {
                        b: &b,
                        owner: &src,
                        r,
                        rank,
                        host: host.as_ref(),
                    },
                    &cfg,
                    prefix,
                    t.tie_word_embeddings,
                    t.topk_method.as_deref(),
                )
            })
            .collect::<Result<Vec<_>>>();
        // Every hash answers before the load does, failed or not (no thread outlives a failed load's report).
        let checked = host.map_or(Ok(()), HostChecks::finish);
        let ranks = ranks?;
        checked?;
        if let Some(k) = src.slice_rank() {
            cfg.vocab = v / r;
            cfg.slice_rank = Some(k);
        }
        let rope_inv = b.upload_vector_f32(Slab::Owned(cfg.inv_freq.clone()))?;
        let vocab_first = match (src.slice_rank(), &group) {
            (None, Some(g)) => g.start * (v / r),
            _ => 0,
        };
        Ok(Weights {
            backend: b,
            cfg,
            ranks,
            rope_inv,
            vocab_first,
        })
    }

    /// `embed_tokens` rows of `tokens`: `[n, H]`, each looked up on the rank owning its vocab slice.
    pub fn embed(&self, tokens: &[u32]) -> B::Act {
        self.backend
            .embedding(&self.vocab(|r| &r.embed), self.cfg.hidden, tokens)
    }

    /// The vocab-parallel shards of `which` (embed_tokens or lm_head) this backend holds, placed in the vocab.
    fn vocab<'a>(&'a self, which: impl Fn(&'a RankWeights<B>) -> &'a B::Mat) -> VocabShards<'a, B::Mat> {
        VocabShards {
            mats: self.ranks.iter().map(which).collect(),
            first: self.vocab_first,
            vocab: self.cfg.vocab,
        }
    }

    /// [`Weights::embed`] of `n` ids already where the ops run.
    pub fn embed_ids(&self, ids: &B::Ids, n: usize) -> B::Act {
        self.backend
            .embedding_ids(&self.vocab(|r| &r.embed), self.cfg.hidden, ids, n)
    }

    /// Final RMSNorm (`model.norm`, eps = rms_norm_eps) of `x` `[n, H]`.
    pub fn final_norm(&self, x: &B::Act) -> B::Act {
        self.backend.rms_norm(x, &self.ranks[0].norm, self.cfg.eps)
    }

    /// `lm_head(x)` for `x` `[n, H]` (already normed): `[n, V]` logits, the vocab-parallel rank slices
    /// merged in global id order.
    pub fn lm_head(&self, x: &B::Act, n: usize) -> B::Act {
        self.backend.lm_head(x, n, self.cfg.hidden, &self.vocab(|r| &r.lm_head))
    }

    /// Greedy token of each row of `lm_head(x)` (vocab-parallel argmax, merged in global id order), read back.
    pub fn lm_head_argmax(&self, x: &B::Act, n: usize) -> Result<Vec<u32>> {
        let mut ids = self.backend.ids_from_host(&vec![0; n]);
        self.lm_head_argmax_into(x, n, &mut ids, 0)?;
        self.backend.ids_to_host(&ids)
    }
    /// [`Weights::lm_head_argmax`] into `out[row0..row0 + n]` where the ops run (`Backend::lm_head_argmax_into`).
    pub fn lm_head_argmax_into(&self, x: &B::Act, n: usize, out: &mut B::Ids, row0: usize) -> Result<()> {
        self.backend
            .lm_head_argmax_into(x, n, self.cfg.hidden, &self.vocab(|r| &r.lm_head), out, row0)
    }
    /// Whether this GPU holds only some of the vocab's shards (its lm_head rows merge through the communicator).
    pub fn vocab_split(&self) -> bool {
        !self.vocab(|r| &r.lm_head).whole(|m| self.backend.mat_rows(m))
    }
}

/// Everything rank `ld.rank` needs, from its own shards.
fn load_rank<B: Backend>(
    ld: &Ld<'_, B>,
    cfg: &ModelConfig,
    prefix: &str,
    tied: bool,
    topk_method: Option<&str>,
) -> Result<RankWeights<B>> {
    let (h, r, k) = (cfg.hidden, ld.r, ld.rank);
    let m = format!("{prefix}model.");
    let vr = cfg.vocab / r;
    let embed = ld.mat(&format!("{m}embed_tokens.weight"), vr, h, Some((0, k * vr)))?;
    let head_name = if tied {
        format!("{m}embed_tokens.weight")
    } else {
        format!("{prefix}lm_head.weight")
    };
    let lm_head = ld.mat(&head_name, vr, h, Some((0, k * vr)))?;
    let norm = ld.vector(&format!("{m}norm.weight"), h)?;
    let (hr, qk, kvw) = (cfg.heads / r, cfg.qk_head_dim(), cfg.nope + cfg.v_dim);
    let mut layers = Vec::with_capacity(cfg.layers);
    for l in 0..cfg.layers {
        let p = format!("{m}layers.{l}.");
        let a = format!("{p}self_attn.");
        let (q_a, q) = match cfg.q_lora {
            Some(ql) => (
                Some((
                    ld.mat(&format!("{a}q_a_proj.weight"), ql, h, None)?,
                    ld.vector(&format!("{a}q_a_layernorm.weight"), ql)?,
                )),
                ld.mat(&format!("{a}q_b_proj.weight"), hr * qk, ql, Some((0, k * hr * qk)))?,
            ),
            None => (
                None,
                ld.mat(&format!("{a}q_proj.weight"), hr * qk, h, Some((0, k * hr * qk)))?,
            ),
        };
        let mut attn = Attn {
            q_a,
            kv_a: ld.mat(&format!("{a}kv_a_proj_with_mqa.weight"), cfg.latent_width(), h, None)?,
            kv_a_norm: ld.vector(&format!("{a}kv_a_layernorm.weight"), cfg.kv_lora)?,
            q,
            kv_b: ld.mat(
                &format!("{a}kv_b_proj.weight"),
                hr * kvw,
                cfg.kv_lora,
                Some((0, k * hr * kvw)),
            )?,
            o_proj: ld.mat(
                &format!("{a}o_proj.weight"),
                h,
                hr * cfg.v_dim,
                Some((1, k * hr * cfg.v_dim)),
            )?,
            head0: k * hr,
        };
        let stack = |what: &str, mats: &mut [&mut B::Mat]| {
            ld.b.stack_rows(mats)
                .with_context(|| format!("stacking {p}{what} (rank {k})"))
        };
        if let Attn {
            q_a: Some((q_a, _)),
            kv_a,
            ..
        } = &mut attn
        {
            stack("self_attn q_a_proj | kv_a_proj_with_mqa", &mut [q_a, kv_a])?;
        }
        let mlp = format!("{p}mlp.");
        let ffn = if !cfg.moe_layers[l] {
            let mut d = ld.mlp(&mlp, h, cfg.intermediate)?;
            stack("mlp gate_proj | up_proj", &mut [&mut d.gate, &mut d.up])?;
            Ffn::Dense(d)
        } else {
            let e = cfg.n_experts;
            let bias = if topk_method == Some("noaux_tc") {
                let name = format!("{mlp}gate.e_score_correction_bias");
                let tb = expect(ld.src(), &name, k, Dtype::F32, &[e])?;
                expect_split(&tb, &name, k, None, 0)?;
                match ld.fill_of(&name) {
                    Some(f) => Some(
                        ld.b.fill_vector_f32(e, &f)
                            .with_context(|| format!("filling {name} (rank {k})"))?,
                    ),
                    None => {
                        ld.check_host(&name);
                        // SAFETY: `tb` was just returned by `ld.owner.tensor(..)` (through `expect`).
                        let v = ld.b.upload_vector_f32(unsafe { Slab::new(ld.owner, tb.data) })?;
                        ld.check(&name, &tb, WeightRef::VectorF32(&v), 0)?;
                        Some(v)
                    }
                }
            } else {
                None
            };
            let mut shared = if cfg.n_shared > 0 {
                Some(ld.mlp(&format!("{mlp}shared_experts."), h, cfg.moe_intermediate * cfg.n_shared)?)
            } else {
                None
            };
            let (stem, mi) = (format!("{mlp}experts"), cfg.moe_intermediate);
            let mut router = ld.mat(&format!("{mlp}gate.weight"), e, h, None)?;
            if let Some(sh) = shared.as_mut() {
                stack(
                    "mlp gate | shared_experts gate_proj | up_proj",
                    &mut [&mut router, &mut sh.gate, &mut sh.up],
                )?;
            }
            Ffn::Moe(Moe {
                router,
                bias,
                shared,
                gate: ld.experts(&stem, "gate_proj", e, mi, h)?,
                up: ld.experts(&stem, "up_proj", e, mi, h)?,
                down: ld.experts(&stem, "down_proj", e, h, mi)?,
            })
        };
        layers.push(Layer {
            input_norm: ld.vector(&format!("{p}input_layernorm.weight"), h)?,
            post_norm: ld.vector(&format!("{p}post_attention_layernorm.weight"), h)?,
            attn,
            ffn,
        });
    }
    Ok(RankWeights {
        embed,
        lm_head,
        norm,
        layers,
    })
}
