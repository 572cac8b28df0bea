//! The CUDA backend's compute ops (`backend::Compute`): the model's ops on the device, through the kernel
//! wrappers of cuda/ops and the composite ops of composite.rs.

use super::backend::CudaBackend;
use super::ops::act_f32;
use super::ops::gqa_attention::{gqa_attention, gqa_attention_segs, GqaSeg, GqaShape, GqaSplit, MAX_SEGS as GQA_SEGS};
use super::ops::rope::RopeLayout;
use super::ops::{argmax, gemm_bf16, moe_router, round_state};
use super::tree::DMask;
use super::types::{DKv, DMat, DPos, DRope, DRoutes, DI4};
use super::CudaError;
use crate::backend::{AttnMode, Cols, Compute, MlaDims, PosOf, Resources, Router, VocabShards};
use crate::sampling::Sampling;
use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

impl Compute for CudaBackend {
    fn decide_rows(
        &self,
        logits: &CudaSlice<f32>,
        row0: usize,
        rows: usize,
        vocab: usize,
        s: &Sampling,
        base: PosOf<'_, Self>,
        offset: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let end = row0 + rows;
        if logits.len() < end * vocab || out.len() < end {
            bail!(
                "decide_rows: {} logits / {} outputs for rows {row0}..{end} of {vocab}",
                logits.len(),
                out.len()
            );
        }
        let bv = match base {
            PosOf::Kv(kv) => kv.pos.as_view(),
            PosOf::Pos(p) => p.dev.as_view(),
        };
        let (lv, mut ov) = (logits.slice(row0 * vocab..end * vocab), out.slice_mut(row0..end));
        if s.is_greedy() {
            argmax::argmax(&self.gpu, &lv, rows, vocab, vocab, &mut ov)?;
        } else {
            super::ops::sample_rows::sample_rows(
                &self.gpu,
                &lv,
                rows,
                vocab,
                vocab,
                s,
                offset as u64,
                Some(&bv),
                None,
                &mut ov,
            )?;
        }
        self.check()
    }
    fn rope_at(
        &self,
        inv_freq: &CudaSlice<f32>,
        factor: f64,
        base: PosOf<'_, Self>,
        offsets: Option<&CudaSlice<u32>>,
        t: usize,
    ) -> DRope {
        let half = inv_freq.len();
        self.run("rope_at", || {
            let b = match base {
                PosOf::Kv(kv) => kv.pos.as_view(),
                PosOf::Pos(p) => p.dev.as_view(),
            };
            let (mut cos, mut sin) = (self.new_f32(t * half)?, self.new_f32(t * half)?);
            let ov = offsets.map(|o| o.as_view());
            round_state::rope_at(
                &self.gpu,
                &inv_freq.as_view(),
                factor,
                &b,
                ov.as_ref(),
                t,
                &mut cos.as_view_mut(),
                &mut sin.as_view_mut(),
            )?;
            Ok(DRope {
                cos,
                sin,
                half,
                rows: t,
            })
        })
        .unwrap_or_else(|| self.empty_rope(half))
    }
    fn rope_at_segs(
        &self,
        inv_freq: &CudaSlice<f32>,
        factor: f64,
        segs: &[(PosOf<'_, Self>, Option<&CudaSlice<u32>>, usize)],
    ) -> DRope {
        let half = inv_freq.len();
        self.run("rope_at", || {
            let rows: usize = segs.iter().map(|s| s.2).sum();
            let (mut cos, mut sin) = (self.new_f32(rows * half)?, self.new_f32(rows * half)?);
            let mut at = 0;
            for chunk in segs.chunks(round_state::MAX_SEGS) {
                let n: usize = chunk.iter().map(|s| s.2).sum();
                let parts: Vec<round_state::RopeSeg<'_>> = chunk
                    .iter()
                    .map(|(base, offsets, t)| round_state::RopeSeg {
                        base: match base {
                            PosOf::Kv(kv) => kv.pos.as_view(),
                            PosOf::Pos(p) => p.dev.as_view(),
                        },
                        offsets: offsets.map(|o| o.as_view()),
                        rows: *t,
                    })
                    .collect();
                let span = at * half..(at + n) * half;
                round_state::rope_at_segs(
                    &self.gpu,
                    &inv_freq.as_view(),
                    factor,
                    &parts,
                    &mut cos.slice_mut(span.clone()),
                    &mut sin.slice_mut(span),
                )?;
                at += n;
            }
            Ok(DRope { cos, sin, half, rows })
        })
        .unwrap_or_else(|| self.empty_rope(half))
    }
    fn linear(&self, x: &CudaSlice<f32>, t: usize, w: &DMat) -> CudaSlice<f32> {
        self.run("linear", || self.gemm_f32(x, t, w))
            .unwrap_or_else(|| self.empty())
    }
    fn rms_norm_in(&self, x: &CudaSlice<f32>, w: &CudaSlice<bf16>, eps: f32) -> CudaSlice<bf16> {
        self.run("rms_norm_in", || {
            let d = w.len();
            let mut y = self.gpu.out::<bf16>(x.len())?;
            act_f32::rms_norm_bf16_out(
                &self.gpu,
                &x.as_view(),
                d,
                &w.as_view(),
                &mut y.as_view_mut(),
                d,
                x.len() / d.max(1),
                eps,
            )?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn add_rms_norm_in(
        &self,
        x: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        eps: f32,
    ) -> CudaSlice<bf16> {
        self.run("add_rms_norm_in", || {
            let d = w.len();
            if a.len() != x.len() {
                return Err(CudaError::Shape {
                    op: "add_rms_norm_in",
                    msg: format!("adding {} elements to {}", a.len(), x.len()),
                });
            }
            let mut y = self.gpu.out::<bf16>(x.len())?;
            let rows = x.len() / d.max(1);
            act_f32::add_rms_norm_bf16(
                &self.gpu,
                &mut x.as_view_mut(),
                d,
                (&a.as_view(), d),
                &w.as_view(),
                &mut y.as_view_mut(),
                d,
                rows,
                eps,
            )?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn lin_in(&self, x: &CudaSlice<f32>) -> CudaSlice<bf16> {
        self.run("lin_in", || self.to_bf16(x))
            .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn linear_in(&self, x: &CudaSlice<bf16>, t: usize, w: &DMat) -> CudaSlice<f32> {
        self.run("linear", || self.gemm_bf16_in(x, t, w))
            .unwrap_or_else(|| self.empty())
    }
    fn linear_in_cat(&self, x: &CudaSlice<bf16>, t: usize, ws: &[&DMat]) -> CudaSlice<f32> {
        self.run("linear_in_cat", || self.gemm_bf16_cat(x, t, ws))
            .unwrap_or_else(|| self.empty())
    }
    fn rms_norm_in_cols(
        &self,
        x: &CudaSlice<f32>,
        c: Cols,
        t: usize,
        w: &CudaSlice<bf16>,
        eps: f32,
    ) -> CudaSlice<bf16> {
        self.run("rms_norm_in", || {
            let d = w.len();
            if c.width != d || c.off + d > c.ld {
                return Err(CudaError::Shape {
                    op: "rms_norm_in",
                    msg: format!(
                        "a norm of {d} over columns {}..{} of rows of {}",
                        c.off,
                        c.off + c.width,
                        c.ld
                    ),
                });
            }
            let mut y = self.gpu.out::<bf16>(t * d)?;
            let xv = x.slice(c.off.min(x.len())..);
            act_f32::rms_norm_bf16_out(&self.gpu, &xv, c.ld, &w.as_view(), &mut y.as_view_mut(), d, t, eps)?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn rms_norm(&self, x: &CudaSlice<f32>, w: &CudaSlice<bf16>, eps: f32) -> CudaSlice<f32> {
        self.run("rms_norm", || {
            let d = w.len();
            let mut y = self.gpu.out::<f32>(x.len())?;
            act_f32::rms_norm_f32(
                &self.gpu,
                &x.as_view(),
                d,
                &w.as_view(),
                &mut y.as_view_mut(),
                d,
                x.len() / d.max(1),
                eps,
            )?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn add(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) {
        self.run("add", || {
            act_f32::add_f32(&self.gpu, &mut acc.as_view_mut(), &x.as_view())
        });
    }
    fn silu_mul(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>) -> CudaSlice<f32> {
        self.run("silu_mul", || {
            let mut y = self.gpu.out::<f32>(gate.len())?;
            act_f32::silu_mul_f32(&self.gpu, &gate.as_view(), &up.as_view(), &mut y.as_view_mut())?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn silu_mul_in(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>) -> CudaSlice<bf16> {
        self.run("silu_mul_in", || {
            let mut y = self.gpu.out::<bf16>(gate.len())?;
            act_f32::silu_mul_bf16(&self.gpu, &gate.as_view(), &up.as_view(), &mut y.as_view_mut())?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn silu_mul_in_cols(&self, x: &CudaSlice<f32>, gate: Cols, up: Cols, t: usize) -> CudaSlice<bf16> {
        self.run("silu_mul_in", || {
            if gate.width != up.width || gate.off + gate.width > gate.ld || up.off + up.width > up.ld {
                return Err(CudaError::Shape {
                    op: "silu_mul_in",
                    msg: format!("gate {gate:?} and up {up:?}"),
                });
            }
            let mut y = self.gpu.out::<bf16>(t * gate.width)?;
            let (g, u) = (x.slice(gate.off.min(x.len())..), x.slice(up.off.min(x.len())..));
            act_f32::silu_mul_bf16_rows(
                &self.gpu,
                (&g, gate.ld),
                (&u, up.ld),
                (t, gate.width),
                &mut y.as_view_mut(),
            )?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn all_reduce(&self, partials: Vec<CudaSlice<f32>>) -> CudaSlice<f32> {
        let mut it = partials.into_iter();
        let Some(mut acc) = it.next() else { return self.empty() };
        for p in it {
            self.add(&mut acc, &p);
        }
        // The ranks on this GPU summed in rank order; then the other GPUs' sums (cuda/comm.rs).
        let comm = self.gpu.comm();
        self.run("all_reduce", || comm.all_reduce_sum(&self.gpu, &mut acc));
        acc
    }
    fn embedding(&self, v: &VocabShards<'_, DMat>, h: usize, tokens: &[u32]) -> CudaSlice<f32> {
        self.run("embedding", || {
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            let ids = self.gpu.upload(&ids)?;
            self.embed_rows(v, h, &ids.as_view())
        })
        .unwrap_or_else(|| self.empty())
    }
    fn embedding_ids(&self, v: &VocabShards<'_, DMat>, h: usize, ids: &CudaSlice<u32>, n: usize) -> CudaSlice<f32> {
        self.run("embedding", || {
            if ids.len() < n {
                return Err(CudaError::Shape {
                    op: "embedding",
                    msg: format!("{} ids for {n} rows", ids.len()),
                });
            }
            let iv = ids.slice(..n);
            // SAFETY: the token ids are below the vocabulary (< 2^31), so u32 and i32 hold the same values.
            let iv = unsafe { iv.transmute::<i32>(n) }.expect("n ids");
            self.embed_rows(v, h, &iv)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn lm_head(&self, x: &CudaSlice<f32>, n: usize, _h: usize, v: &VocabShards<'_, DMat>) -> CudaSlice<f32> {
        self.run("lm_head", || {
            let whole = v.whole(|m| m.rows);
            if let ([one], true) = (v.mats.as_slice(), whole) {
                return self.gemm_f32(x, n, one);
            }
            // Vocab-parallel shards: each writes its columns of the merged [n, V] (global vocab order); the other
            // GPUs' columns are zero here and summed in by the communicator.
            let vt = v.vocab;
            let xb = self.to_bf16(x)?;
            let mut y = if whole {
                self.gpu.out::<f32>(n * vt)?
            } else {
                self.gpu.zeros::<f32>(n * vt)?
            };
            let mut col = v.first;
            for m in &v.mats {
                gemm_bf16::gemm_bf16_ld(
                    &self.gpu,
                    &xb.as_view(),
                    &m.view(),
                    &mut y.slice_mut(col..),
                    n,
                    m.cols,
                    m.rows,
                    vt,
                )?;
                col += m.rows;
            }
            if !whole {
                self.gpu.comm().all_reduce_sum(&self.gpu, &mut y)?;
            }
            Ok(y)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn lm_head_argmax_into(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        _h: usize,
        v: &VocabShards<'_, DMat>,
        out: &mut CudaSlice<u32>,
        row0: usize,
    ) -> Result<()> {
        if out.len() < row0 + n {
            bail!("lm_head_argmax: {} outputs for rows {row0}..{}", out.len(), row0 + n);
        }
        let vt = v.vocab;
        if v.whole(|m| m.rows) {
            let logits = self.lm_head(x, n, _h, v);
            self.run("lm_head_argmax", || {
                argmax::argmax(
                    &self.gpu,
                    &logits.as_view(),
                    n,
                    vt,
                    vt,
                    &mut out.slice_mut(row0..row0 + n),
                )
            });
            return self.check();
        }
        let (slots, slot0) = v.slots(|m| m.rows).map_err(anyhow::Error::msg)?;
        self.run("lm_head_argmax", || {
            // The local shards' logits by the same GEMMs as lm_head's (same columns of an [n, V] buffer, so the
            // same bits), each shard's (value, global id) into its slot of the zeroed pairs, the pairs summed over
            // the GPUs (each slot is nonzero on one GPU: exact), then merged in slot (= global vocab) order.
            let xb = self.to_bf16(x)?;
            let mut y = self.gpu.out::<f32>(n * vt)?;
            let mut pairs = self.gpu.zeros::<f32>(n * slots * 2)?;
            let mut col = v.first;
            for (j, m) in v.mats.iter().enumerate() {
                gemm_bf16::gemm_bf16_ld(
                    &self.gpu,
                    &xb.as_view(),
                    &m.view(),
                    &mut y.slice_mut(col..),
                    n,
                    m.cols,
                    m.rows,
                    vt,
                )?;
                argmax::argmax_pairs(
                    &self.gpu,
                    &y.slice(col..),
                    n,
                    m.rows,
                    vt,
                    col,
                    &mut pairs.as_view_mut(),
                    slot0 + j,
                    slots,
                )?;
                col += m.rows;
            }
            self.gpu.comm().all_reduce_sum(&self.gpu, &mut pairs)?;
            argmax::merge_pairs(
                &self.gpu,
                &pairs.as_view(),
                n,
                slots,
                &mut out.slice_mut(row0..row0 + n),
            )
        });
        self.check()
    }
    fn kv_append_latent(
        &self,
        kv: &mut DKv,
        l: usize,
        ckv: &CudaSlice<f32>,
        norm: &CudaSlice<bf16>,
        eps: f32,
        rope: &DRope,
    ) {
        let w = kv.width;
        let c = Cols {
            ld: w,
            off: 0,
            width: w,
        };
        self.kv_append_latent_cols(kv, l, ckv, c, ckv.len() / w.max(1), norm, eps, rope)
    }
    fn kv_append_latent_cols(
        &self,
        kv: &mut DKv,
        l: usize,
        ckv: &CudaSlice<f32>,
        cols: Cols,
        t: usize,
        norm: &CudaSlice<bf16>,
        eps: f32,
        rope: &DRope,
    ) {
        self.run("kv_append_latent", || {
            let (w, c) = (kv.width, norm.len());
            if cols.width != w || cols.off + w > cols.ld {
                return Err(CudaError::Shape {
                    op: "kv_append_latent",
                    msg: format!("latent rows of {w} from {cols:?}"),
                });
            }
            self.grow(kv, kv.committed + t)?;
            let base = l * kv.cap * w;
            let src = ckv.slice(cols.off.min(ckv.len())..);
            if act_f32::kv_latent_rows_fit(w, c) {
                // One launch: the bits of the four below (copy, norm, rope, store).
                return act_f32::kv_latent_rows_bf16(
                    &self.gpu,
                    (&src, cols.ld),
                    (t, w, c),
                    &norm.as_view(),
                    eps,
                    (&rope.cos.as_view(), &rope.sin.as_view()),
                    &mut kv.buf.slice_mut(base..base + kv.cap * w),
                    (&kv.pos.as_view(), kv.committed),
                );
            }
            // [T, C+P] f32: the rows copied out, rms_norm of the c_kv part, then RoPE on k_pe; stored as bf16.
            let mut rows = self.gpu.out::<f32>(t * w)?;
            act_f32::copy_rows_f32(&self.gpu, &src, cols.ld, &mut rows.as_view_mut(), w, t, w)?;
            act_f32::rms_norm_f32(
                &self.gpu,
                &src,
                cols.ld,
                &norm.as_view(),
                &mut rows.as_view_mut(),
                w,
                t,
                eps,
            )?;
            let r = RopeLayout {
                tokens: t,
                heads: 1,
                ld_token: w,
                ld_head: w,
                offset: c,
                dim: w - c,
            };
            act_f32::rope_table_f32(
                &self.gpu,
                &mut rows.as_view_mut(),
                &rope.cos.as_view(),
                &rope.sin.as_view(),
                r,
                false,
            )?;
            // At the committed length read on the device (a captured round replays at any length).
            round_state::store_rows(
                &self.gpu,
                &mut kv.buf.slice_mut(base..base + kv.cap * w),
                w,
                &kv.pos.as_view(),
                kv.committed,
                &rows.as_view(),
                t,
            )
        });
    }
    fn rope_q(&self, q: &mut CudaSlice<f32>, heads: usize, nope: usize, rope: &DRope) {
        self.run("rope_q", || {
            let p = 2 * rope.half;
            let t = rope.rows;
            let r = RopeLayout {
                tokens: t,
                heads,
                ld_token: heads * (nope + p),
                ld_head: nope + p,
                offset: nope,
                dim: p,
            };
            act_f32::rope_table_f32(
                &self.gpu,
                &mut q.as_view_mut(),
                &rope.cos.as_view(),
                &rope.sin.as_view(),
                r,
                false,
            )
        });
    }
    fn mla_attention(
        &self,
        q: &CudaSlice<f32>,
        t: usize,
        kv: &DKv,
        l: usize,
        mask: &DMask,
        kv_b: &DMat,
        d: &MlaDims,
        _mode: AttnMode,
    ) -> CudaSlice<f32> {
        // Both forms compute the same attention; the GPU runs the absorbed one (the naive form would
        // expand every cached latent through kv_b at each step).
        self.run("mla_attention", || self.mla_segs(q, &[(kv, mask, t)], l, kv_b, d))
            .unwrap_or_else(|| self.empty())
    }
    fn mla_attention_segs(
        &self,
        q: &CudaSlice<f32>,
        segs: &[(&DKv, &DMask, usize)],
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
        _mode: AttnMode,
    ) -> CudaSlice<f32> {
        self.run("mla_attention", || self.mla_segs(q, segs, l, kv_b, d))
            .unwrap_or_else(|| self.empty())
    }
    fn mla_attention_in(
        &self,
        q: &CudaSlice<f32>,
        t: usize,
        kv: &DKv,
        l: usize,
        mask: &DMask,
        kv_b: &DMat,
        d: &MlaDims,
        _mode: AttnMode,
    ) -> CudaSlice<bf16> {
        self.run("mla_attention", || self.mla_segs_bf16(q, &[(kv, mask, t)], l, kv_b, d))
            .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn mla_attention_segs_in(
        &self,
        q: &CudaSlice<f32>,
        segs: &[(&DKv, &DMask, usize)],
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
        _mode: AttnMode,
    ) -> CudaSlice<bf16> {
        self.run("mla_attention", || self.mla_segs_bf16(q, segs, l, kv_b, d))
            .unwrap_or_else(|| self.empty_of::<bf16>())
    }
    fn kv_append_latent_segs(
        &self,
        segs: &mut [(&mut DKv, usize)],
        l: usize,
        ckv: &CudaSlice<f32>,
        norm: &CudaSlice<bf16>,
        eps: f32,
        w: usize,
        rope_all: &DRope,
    ) {
        self.run("kv_append_latent", || {
            let c = norm.len();
            let t = ckv.len() / w;
            // [T, C+P] f32 of every segment: rms_norm of the c_kv part, k_pe copied, RoPE at each row's own
            // position (the stacked table), then every segment's rows into its cache at its committed length
            // (read on the device): three launches per layer, and one more per MAX_SEGS segments.
            let mut rows = self.copy(ckv, 0, ckv.len())?;
            act_f32::rms_norm_f32(
                &self.gpu,
                &ckv.as_view(),
                w,
                &norm.as_view(),
                &mut rows.as_view_mut(),
                w,
                t,
                eps,
            )?;
            let r = RopeLayout {
                tokens: t,
                heads: 1,
                ld_token: w,
                ld_head: w,
                offset: c,
                dim: w - c,
            };
            act_f32::rope_table_f32(
                &self.gpu,
                &mut rows.as_view_mut(),
                &rope_all.cos.as_view(),
                &rope_all.sin.as_view(),
                r,
                false,
            )?;
            for (kv, ts) in segs.iter_mut() {
                self.grow(kv, kv.committed + *ts)?;
            }
            let mut at = 0;
            for chunk in segs.chunks_mut(round_state::MAX_SEGS) {
                let rows_n: usize = chunk.iter().map(|s| s.1).sum();
                let mut parts: Vec<round_state::StoreSeg<'_>> = chunk
                    .iter_mut()
                    .map(|(kv, ts)| {
                        let (base, cap, committed) = (l * kv.cap * w, kv.cap, kv.committed);
                        let DKv { buf, pos, .. } = &mut **kv;
                        round_state::StoreSeg {
                            dst: buf.slice_mut(base..base + cap * w),
                            pos: pos.as_view(),
                            committed,
                            n: *ts,
                        }
                    })
                    .collect();
                round_state::store_rows_seg(&self.gpu, &mut parts, w, &rows.slice(at * w..(at + rows_n) * w))?;
                at += rows_n;
            }
            Ok(())
        });
    }
    fn moe_route(&self, logits: &CudaSlice<f32>, t: usize, r: &Router, bias: Option<&CudaSlice<f32>>) -> DRoutes {
        let c = Cols {
            ld: r.n_experts,
            off: 0,
            width: r.n_experts,
        };
        self.moe_route_cols(logits, c, t, r, bias)
    }
    fn moe_route_cols(
        &self,
        logits: &CudaSlice<f32>,
        cols: Cols,
        t: usize,
        r: &Router,
        bias: Option<&CudaSlice<f32>>,
    ) -> DRoutes {
        let res = self.run("moe_route", || {
            if cols.width != r.n_experts || cols.off + cols.width > cols.ld {
                return Err(CudaError::Shape {
                    op: "moe_route",
                    msg: format!("{} experts' logits from {cols:?}", r.n_experts),
                });
            }
            let (mut ids, mut wts) = (self.gpu.out::<i32>(t * r.top_k)?, self.gpu.out::<f32>(t * r.top_k)?);
            let bv = bias.map(|b| b.as_view());
            moe_router::moe_router_ld(
                &self.gpu,
                &logits.slice(cols.off.min(logits.len())..),
                cols.ld,
                bv.as_ref(),
                t,
                *r,
                &mut ids.as_view_mut(),
                &mut wts.as_view_mut(),
            )?;
            Ok((ids, wts))
        });
        let (ids, wts) = res.unwrap_or_else(|| {
            let z = self.empty_of::<i32>();
            (z, self.empty())
        });
        DRoutes {
            ids,
            wts,
            t,
            k: r.top_k,
            experts: r.n_experts,
        }
    }
    fn routes_to_host(&self, routes: &DRoutes) -> (Vec<i32>, Vec<f32>) {
        self.run("routes_to_host", || {
            Ok((self.gpu.download(&routes.ids)?, self.gpu.download(&routes.wts)?))
        })
        .unwrap_or_default()
    }
    fn moe_experts(
        &self,
        x: &CudaSlice<bf16>,
        t: usize,
        h: usize,
        routes: &DRoutes,
        gate: &DI4,
        up: &DI4,
        down: &DI4,
    ) -> CudaSlice<f32> {
        self.run("moe_experts", || {
            // Tensor parallel: every expert, sliced; expert parallel: experts first .. first + count, whole.
            if gate.first + gate.count > routes.experts {
                return Err(CudaError::Shape {
                    op: "moe_experts",
                    msg: format!(
                        "the rank holds experts {}..{} of {}",
                        gate.first,
                        gate.first + gate.count,
                        routes.experts
                    ),
                });
            }
            if routes.t != t || routes.ids.len() != t * routes.k {
                return Err(CudaError::Shape {
                    op: "moe_experts",
                    msg: format!("routes of {} tokens for {t}", routes.t),
                });
            }
            self.experts(x, t, h, routes, gate, up, down)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn head_norm_rope_neox(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        eps: f32,
        heads: usize,
        rope: &DRope,
    ) -> CudaSlice<f32> {
        self.run("head_norm_rope_neox", || {
            let d = w.len();
            let mut y = self.new_f32(x.len())?;
            act_f32::rms_norm_f32(
                &self.gpu,
                &x.as_view(),
                d,
                &w.as_view(),
                &mut y.as_view_mut(),
                d,
                x.len() / d.max(1),
                eps,
            )?;
            let t = x.len() / (heads * d).max(1);
            let r = RopeLayout {
                tokens: t,
                heads,
                ld_token: heads * d,
                ld_head: d,
                offset: 0,
                dim: d,
            };
            act_f32::rope_table_f32(
                &self.gpu,
                &mut y.as_view_mut(),
                &rope.cos.as_view(),
                &rope.sin.as_view(),
                r,
                true,
            )?;
            Ok(y)
        })
        .unwrap_or_else(|| self.empty())
    }
    #[allow(clippy::too_many_arguments)]
    fn gqa_attention(
        &self,
        q: &CudaSlice<f32>,
        b: usize,
        ctx: (&CudaSlice<f32>, &CudaSlice<f32>),
        ctx_len: &DPos,
        block: (&CudaSlice<f32>, &CudaSlice<f32>),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> CudaSlice<f32> {
        self.run("gqa_attention", || {
            let (c, room) = (ctx_len.host, gqa_room(ctx.0, ctx.1, ctx_len.host, kv_heads, head_dim)?);
            let s = GqaShape {
                b,
                ctx: c,
                heads,
                kv_heads,
                head_dim,
            };
            // Split by the caches' room, C read on the device (as the MLA attention).
            let split = GqaSplit {
                splits: GqaSplit::choose(&self.gpu, &GqaShape { ctx: room, ..s }).splits,
                rows_per_split: 0,
            };
            let (wo, wml) = split.workspace(&s);
            // Workspace and output are allocated per call (as the MLA attention's).
            let (mut po, mut pml, mut out) = (
                self.new_f32(wo)?,
                self.new_f32(wml)?,
                self.new_f32(b * heads * head_dim)?,
            );
            let (kc, vc, kb, vb) = (ctx.0.as_view(), ctx.1.as_view(), block.0.as_view(), block.1.as_view());
            let cv = ctx_len.dev.as_view();
            gqa_attention(
                &self.gpu,
                &q.as_view(),
                (&kc, &vc),
                Some(&cv),
                (&kb, &vb),
                &s,
                &split,
                &mut po.as_view_mut(),
                &mut pml.as_view_mut(),
                &mut out.as_view_mut(),
            )?;
            Ok(out)
        })
        .unwrap_or_else(|| self.empty())
    }
    #[allow(clippy::too_many_arguments)]
    fn gqa_attention_segs(
        &self,
        q: &CudaSlice<f32>,
        b: usize,
        ctx: &[(&CudaSlice<f32>, &CudaSlice<f32>, &DPos)],
        block: (&CudaSlice<f32>, &CudaSlice<f32>),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> CudaSlice<f32> {
        self.run("gqa_attention", || {
            let (qw, kw) = (heads * head_dim, kv_heads * head_dim);
            let s = GqaShape {
                b,
                ctx: 0,
                heads,
                kv_heads,
                head_dim,
            };
            let mut out = self.new_f32(ctx.len() * b * qw)?;
            let mut from = 0;
            for chunk in ctx.chunks(GQA_SEGS) {
                let mut segs = Vec::with_capacity(chunk.len());
                for &(kc, vc, len) in chunk {
                    let (c, room) = (len.host, gqa_room(kc, vc, len.host, kv_heads, head_dim)?);
                    // Each sequence split as its own call splits it (by its cache's room), C read on the device.
                    segs.push(GqaSeg {
                        kc: kc.as_view(),
                        vc: vc.as_view(),
                        ctx_dev: len.dev.as_view(),
                        ctx: c,
                        splits: GqaSplit::choose(&self.gpu, &GqaShape { ctx: room, ..s }).splits,
                    });
                }
                let (k, most) = (chunk.len(), segs.iter().map(|g| g.splits).max().unwrap_or(1));
                let (wo, wml) = GqaSplit {
                    splits: most,
                    rows_per_split: 0,
                }
                .workspace(&GqaShape { b: k * b, ..s });
                let (mut po, mut pml) = (self.new_f32(wo)?, self.new_f32(wml)?);
                let (r0, r1) = (from * b, (from + k) * b);
                gqa_attention_segs(
                    &self.gpu,
                    &segs,
                    &q.slice(r0 * qw..r1 * qw),
                    (&block.0.slice(r0 * kw..r1 * kw), &block.1.slice(r0 * kw..r1 * kw)),
                    &s,
                    &mut po.as_view_mut(),
                    &mut pml.as_view_mut(),
                    &mut out.slice_mut(r0 * qw..r1 * qw),
                )?;
                from += k;
            }
            Ok(out)
        })
        .unwrap_or_else(|| self.empty())
    }
}

/// The rows a drafter's context cache (keys `kc`, values `vc`) has room for; an error when they hold fewer than
/// its `c` committed rows of Hk = `kv_heads` x D = `head_dim`, or keys and values differ in size.
fn gqa_room(
    kc: &CudaSlice<f32>,
    vc: &CudaSlice<f32>,
    c: usize,
    kv_heads: usize,
    head_dim: usize,
) -> std::result::Result<usize, CudaError> {
    let room = kc.len().checked_div(kv_heads * head_dim).unwrap_or(0);
    if c > room || vc.len() != kc.len() {
        return Err(CudaError::Shape {
            op: "gqa_attention",
            msg: format!(
                "context keys/values of {} / {} values hold fewer than C={c} rows of Hk={kv_heads} x D={head_dim}",
                kc.len(),
                vc.len()
            ),
        });
    }
    Ok(room)
}
