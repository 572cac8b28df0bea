//! The CUDA backend's composite ops: several kernels behind one `Backend` op (embedding over vocab shards,
//! the f32 GEMM, cache growth, segmented MLA attention, the routed experts) and the upload checks.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::backend::CudaBackend;
use super::ops::mla_absorb::{absorb_q, apply_uv, AbsorbDims};
use super::ops::mla_attention::{self as seg_op, mla_attention, MlaShape, MlaSplit};
use super::ops::w4a16_gemm::{MoeDims, MoeX};
use super::ops::{copy_rows, embed, fill, gemm_bf16, mla_prefill, moe_align, moe_combine, silu_mul, w4a16_gemm};
use super::tree::DMask;
use super::types::{storage_id, DKv, DMat, DRoutes, DI4};
use super::CudaError;
use crate::backend::{Fill, MlaDims, VocabShards};

type R<T> = std::result::Result<T, CudaError>;

impl CudaBackend {
    /// `x[T, K] · W^T` in f32 (x rounded to bf16 for the GEMM).
    /// Embedding rows `[n, h]` (f32) of the device ids over one or several vocab shards.
    /// The embedding rows of `ids` from the shards `v` holds (other GPUs' rows zero, then the communicator's
    /// sum: [`VocabShards`]).
    pub(super) fn embed_rows(
        &self,
        v: &VocabShards<'_, DMat>,
        h: usize,
        ids: &cudarc::driver::CudaView<'_, i32>,
    ) -> R<CudaSlice<f32>> {
        let whole = v.whole(|m| m.rows);
        let mut e = if whole {
            self.gpu.out::<bf16>(ids.len() * h)?
        } else {
            self.gpu.zeros::<bf16>(ids.len() * h)?
        };
        if let ([one], true) = (v.mats.as_slice(), whole) {
            embed::embed_gather(&self.gpu, ids, &one.view(), &mut e.as_view_mut(), one.rows, h)?;
        } else {
            let views: Vec<_> = v.mats.iter().map(|m| m.view()).collect();
            let parts: Vec<_> = views.iter().zip(&v.mats).map(|(w, m)| (w, m.rows)).collect();
            embed::embed_gather_sharded(&self.gpu, ids, &parts, &mut e.as_view_mut(), h, v.first, v.vocab)?;
        }
        let mut x = self.to_f32(&e)?;
        if !whole {
            self.gpu.comm().all_reduce_sum(&self.gpu, &mut x)?;
        }
        Ok(x)
    }
    pub(super) fn gemm_f32(&self, x: &CudaSlice<f32>, t: usize, w: &DMat) -> R<CudaSlice<f32>> {
        self.gemm_bf16_in(&self.to_bf16(x)?, t, w)
    }
    /// `x[T, K] · W^T` for bf16 rows `x` (one [`Compute::lin_in`] conversion shared by several linears), f32 out.
    pub(super) fn gemm_bf16_in(&self, xb: &CudaSlice<bf16>, t: usize, w: &DMat) -> R<CudaSlice<f32>> {
        let mut y = self.gpu.out::<f32>(t * w.rows)?;
        gemm_bf16::gemm_bf16(
            &self.gpu,
            &xb.as_view(),
            &w.view(),
            &mut y.as_view_mut(),
            t,
            w.cols,
            w.rows,
        )?;
        Ok(y)
    }
    /// The linears `ws` of `xb` side by side, `[T, ΣN]` f32 (`Compute::linear_in_cat`): one GEMM over the matrices
    /// where they follow each other in one buffer (`Resources::stack_rows`), else one GEMM each into its columns.
    pub(super) fn gemm_bf16_cat(&self, xb: &CudaSlice<bf16>, t: usize, ws: &[&DMat]) -> R<CudaSlice<f32>> {
        let Some(first) = ws.first() else {
            return self.gpu.out::<f32>(0);
        };
        if ws.iter().any(|w| w.cols != first.cols) {
            return Err(CudaError::Shape {
                op: "linear_in_cat",
                msg: format!(
                    "matrices of {:?} columns",
                    ws.iter().map(|w| w.cols).collect::<Vec<_>>()
                ),
            });
        }
        let ld: usize = ws.iter().map(|w| w.rows).sum();
        let mut y = self.gpu.out::<f32>(t * ld)?;
        if ws.windows(2).all(|p| p[0].precedes(p[1])) {
            let all = first.w.slice(first.off..first.off + ld * first.cols);
            gemm_bf16::gemm_bf16(&self.gpu, &xb.as_view(), &all, &mut y.as_view_mut(), t, first.cols, ld)?;
            return Ok(y);
        }
        let mut at = 0;
        for w in ws {
            let mut yv = y.slice_mut(at..);
            gemm_bf16::gemm_bf16_ld(&self.gpu, &xb.as_view(), &w.view(), &mut yv, t, w.cols, w.rows, ld)?;
            at += w.rows;
        }
        Ok(y)
    }
    pub(super) fn grow(&self, kv: &mut DKv, rows: usize) -> R<()> {
        if rows <= kv.cap {
            return Ok(());
        }
        self.not_capturing("the latent cache grows (reserve it before a captured round)")?;
        let cap = rows.next_power_of_two().max(256);
        let mut buf = self.gpu.zeros::<bf16>(kv.layers * cap * kv.width)?;
        let keep = kv.committed * kv.width;
        for l in 0..kv.layers {
            if keep > 0 {
                let src = kv.buf.slice(l * kv.cap * kv.width..l * kv.cap * kv.width + keep);
                let mut dst = buf.slice_mut(l * cap * kv.width..l * cap * kv.width + keep);
                self.gpu
                    .stream
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(super::drv("kv grow"))?;
            }
        }
        kv.buf = buf;
        kv.cap = cap;
        kv.id = storage_id();
        Ok(())
    }
    /// The absorbed MLA of one or several segments (each its cache, mask and rows; rows consecutive in `q`):
    /// the per-row parts (bf16 q, the W_UK absorb, q_pe, W_UV, back to f32) once over all rows, the attention
    /// itself per segment over its own cache.
    pub(super) fn mla_segs(
        &self,
        q: &CudaSlice<f32>,
        segs: &[(&DKv, &DMask, usize)],
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
    ) -> R<CudaSlice<f32>> {
        self.to_f32(&self.mla_segs_bf16(q, segs, l, kv_b, d)?)
    }
    /// [`CudaBackend::mla_segs`] as the kernels write it, `[T, Hr·Dv]` bf16 (the o_proj GEMM's input as is: the
    /// f32 copy would convert back to the same bits).
    pub(super) fn mla_segs_bf16(
        &self,
        q: &CudaSlice<f32>,
        segs: &[(&DKv, &DMask, usize)],
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
    ) -> R<CudaSlice<bf16>> {
        let (hr, c, p, dn, dv) = (d.heads, d.kv_lora, d.rope, d.nope, d.v);
        let t: usize = segs.iter().map(|s| s.2).sum();
        // A long causal segment (a prefill's chunk; never a tree) in the expanded form where it is switched on and
        // its widths fit the kernel; never inside a capture (it reads the committed length on the host). The
        // choice is each segment's own, so a prompt gets the same form alone and in a batched prefill.
        let min_rows = self.gpu.options().mla_expanded_min_rows;
        let fits = dv.is_multiple_of(16) && (dn + p).is_multiple_of(16) && dv <= 512 && dv + dn + p <= 576;
        let expand = |m: &DMask, ts: usize| min_rows > 0 && ts >= min_rows && fits && m.causal;
        if segs.iter().any(|s| expand(s.1, s.2)) && self.not_capturing("").is_ok() {
            if let [(kv, mask, ts)] = segs {
                return self.mla_expanded(q, kv, mask, *ts, l, kv_b, d);
            }
            return self.mla_segs_runs(q, segs, l, kv_b, d, expand);
        }
        if self.gpu.batch_invariant() && t <= w4a16_gemm::INVARIANT_MAX_ROWS {
            return self.mla_segs_invariant(q, segs, l, kv_b, d);
        }
        let lw = c + p;
        let ad = AbsorbDims {
            t,
            heads: hr,
            nope: dn,
            v: dv,
            kv_lora: c,
        };
        let qcat = self.mla_qcat(q, t, kv_b, d, false)?;
        let mut olat = self.gpu.out::<bf16>(t * hr * c)?;
        // Each segment's split (by its cache's room), and one workspace for the largest (the segments run in
        // stream order, one after another).
        let shapes: Vec<(MlaShape, MlaSplit)> = segs
            .iter()
            .map(|&(kv, _, ts)| {
                let s = MlaShape {
                    t: ts,
                    heads: hr,
                    kv_lora: c,
                    rope: p,
                    committed: kv.committed,
                };
                // The split depends on the cache's room, not on the committed length (read on the device), so
                // a captured round and an eager forward at any length split alike.
                let room = MlaShape {
                    committed: kv.cap.saturating_sub(ts),
                    ..s
                };
                (
                    s,
                    MlaSplit {
                        splits: MlaSplit::choose(&self.gpu, &room).splits,
                        rows_per_split: 0,
                    },
                )
            })
            .collect();
        if segs.len() > 1 {
            // One launch per MAX_SEGS segments, each node over its own sequence's cache with its own split.
            let max_sp = shapes.iter().map(|(_, sp)| sp.splits).max().unwrap_or(1);
            let (mut po, mut pml) = (
                self.gpu.out::<f32>(t * max_sp * hr * c)?,
                self.gpu.out::<f32>(t * max_sp * hr * 2)?,
            );
            let mut at = 0;
            for (chunk, sh) in segs.chunks(seg_op::MAX_SEGS).zip(shapes.chunks(seg_op::MAX_SEGS)) {
                let rows: usize = chunk.iter().map(|s| s.2).sum();
                let sp = sh.iter().map(|(_, sp)| sp.splits).max().unwrap_or(1);
                let parts: Vec<seg_op::MlaSeg<'_>> = chunk
                    .iter()
                    .zip(sh)
                    .map(|(&(kv, mask, ts), (_, split))| {
                        let base = l * kv.cap * kv.width;
                        seg_op::MlaSeg {
                            lat: kv.buf.slice(base..base + kv.cap * kv.width),
                            mask: mask.bits.as_view(),
                            words: mask.words,
                            pos: kv.pos.as_view(),
                            committed: kv.committed,
                            t: ts,
                            splits: split.splits,
                        }
                    })
                    .collect();
                for (&(kv, mask, ts), _) in chunk.iter().zip(sh) {
                    if mask.rows < ts || kv.committed + ts > kv.cap {
                        return Err(CudaError::Shape {
                            op: "mla_attention",
                            msg: format!(
                                "a mask of {} rows / a cache of {} rows for {} committed + {ts} nodes",
                                mask.rows, kv.cap, kv.committed
                            ),
                        });
                    }
                }
                let qs = qcat.slice(at * hr * lw..(at + rows) * hr * lw);
                let mut os = olat.slice_mut(at * hr * c..(at + rows) * hr * c);
                seg_op::mla_attention_seg(
                    &self.gpu,
                    &qs,
                    &parts,
                    hr,
                    c,
                    p,
                    d.scale,
                    &mut po.slice_mut(..rows * sp * hr * c),
                    &mut pml.slice_mut(..rows * sp * hr * 2),
                    &mut os,
                )?;
                at += rows;
            }
            let mut o = self.gpu.out::<bf16>(t * hr * dv)?;
            apply_uv(&self.gpu, &olat.as_view(), &kv_b.view(), &mut o.as_view_mut(), ad)?;
            return Ok(o);
        }
        let (wo, wml) = shapes
            .iter()
            .map(|(s, sp)| sp.workspace(s))
            .fold((0, 0), |a, w| (a.0.max(w.0), a.1.max(w.1)));
        // Not zero-filled: every split CTA writes the partials of each of its (node, head) rows (an empty split
        // m = -inf, l = 0, o = 0), and the merge reads only those.
        let (mut po, mut pml) = (self.gpu.out::<f32>(wo)?, self.gpu.out::<f32>(wml)?);
        let mut at = 0;
        for (&(kv, mask, ts), (s, split)) in segs.iter().zip(&shapes) {
            if mask.rows < ts {
                return Err(CudaError::Shape {
                    op: "mla_attention",
                    msg: format!("a mask of {} rows for {ts} nodes", mask.rows),
                });
            }
            if kv.committed + ts > kv.cap {
                return Err(CudaError::Shape {
                    op: "mla_attention",
                    msg: format!("{} committed + {ts} rows exceed the cache's {}", kv.committed, kv.cap),
                });
            }
            let (wo, wml) = split.workspace(s);
            let base = l * kv.cap * kv.width;
            let lat = kv.buf.slice(base..base + kv.cap * kv.width);
            let (mview, pview) = (mask.bits.as_view(), kv.pos.as_view());
            let qs = qcat.slice(at * hr * lw..(at + ts) * hr * lw);
            let mut os = olat.slice_mut(at * hr * c..(at + ts) * hr * c);
            mla_attention(
                &self.gpu,
                &qs,
                &lat,
                Some((&mview, mask.words)),
                Some(&pview),
                s,
                split,
                d.scale,
                &mut po.slice_mut(..wo),
                &mut pml.slice_mut(..wml),
                &mut os,
            )?;
            at += ts;
        }
        let mut o = self.gpu.out::<bf16>(t * hr * dv)?;
        apply_uv(&self.gpu, &olat.as_view(), &kv_b.view(), &mut o.as_view_mut(), ad)?;
        Ok(o)
    }
    /// The latent queries `[T, Hr, C+P]` bf16 of the `t` rows of `q` `[T, Hr·(Dn+P)]` f32: q_nope absorbed through
    /// W_UK (cuBLAS, or the one-order kernel when `invariant`), then q_pe (already roped) copied next to it.
    fn mla_qcat(&self, q: &CudaSlice<f32>, t: usize, kv_b: &DMat, d: &MlaDims, invariant: bool) -> R<CudaSlice<bf16>> {
        let (hr, c, p, dn, dv) = (d.heads, d.kv_lora, d.rope, d.nope, d.v);
        let lw = c + p;
        let qb = self.to_bf16(q)?; // [T, Hr·(Dn+P)]
        let ad = AbsorbDims {
            t,
            heads: hr,
            nope: dn,
            v: dv,
            kv_lora: c,
        };
        let mut qcat = self.gpu.out::<bf16>(t * hr * lw)?;
        let (qv, wv) = (qb.as_view(), kv_b.view());
        if invariant {
            super::ops::mla_invariant::absorb_q_inv(&self.gpu, &qv, p, &wv, &mut qcat.as_view_mut(), ad)?;
        } else {
            absorb_q(&self.gpu, &qv, p, &wv, &mut qcat.as_view_mut(), ad)?;
        }
        // q_pe (already roped) next to q_lat: rows (t, h) of width P, from offset Dn (stride Dn+P) to C.
        copy_rows::copy_rows(
            &self.gpu,
            &qb.slice(dn..),
            dn + p,
            &mut qcat.slice_mut(c..),
            lw,
            t * hr,
            p,
        )?;
        Ok(qcat)
    }
    /// [`CudaBackend::mla_segs_bf16`] in the batch-invariant form (`Gpu::batch_invariant`, ops::mla_invariant):
    /// every output's sum in one order that depends on its node's own keys, so that a token gets the same bits in an
    /// AR step and in a tree verify. Segments one after another, each over its own cache.
    fn mla_segs_invariant(
        &self,
        q: &CudaSlice<f32>,
        segs: &[(&DKv, &DMask, usize)],
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
    ) -> R<CudaSlice<bf16>> {
        use super::ops::mla_invariant as inv;
        let (hr, c, p, dn, dv) = (d.heads, d.kv_lora, d.rope, d.nope, d.v);
        let t: usize = segs.iter().map(|s| s.2).sum();
        let lw = c + p;
        let ad = AbsorbDims {
            t,
            heads: hr,
            nope: dn,
            v: dv,
            kv_lora: c,
        };
        let qcat = self.mla_qcat(q, t, kv_b, d, true)?;
        let shape = |kv: &DKv, ts: usize| MlaShape {
            t: ts,
            heads: hr,
            kv_lora: c,
            rope: p,
            committed: kv.committed,
        };
        let (wo, wml) = segs
            .iter()
            .map(|&(kv, _, ts)| inv::inv_workspace(&shape(kv, ts), kv.cap))
            .fold((0, 0), |a, w| (a.0.max(w.0), a.1.max(w.1)));
        let (mut po, mut pml) = (self.gpu.out::<f32>(wo.max(1))?, self.gpu.out::<f32>(wml.max(1))?);
        let mut olat = self.gpu.out::<bf16>(t * hr * c)?;
        let mut at = 0;
        for &(kv, mask, ts) in segs {
            if mask.rows < ts {
                return Err(CudaError::Shape {
                    op: "mla_attention",
                    msg: format!("a mask of {} rows for {ts} nodes", mask.rows),
                });
            }
            let s = shape(kv, ts);
            let (so, sml) = inv::inv_workspace(&s, kv.cap);
            let base = l * kv.cap * kv.width;
            let lat = kv.buf.slice(base..base + kv.cap * kv.width);
            inv::mla_attention_inv(
                &self.gpu,
                &qcat.slice(at * hr * lw..(at + ts) * hr * lw),
                &lat,
                kv.cap,
                Some((&mask.bits.as_view(), mask.words)),
                Some(&kv.pos.as_view()),
                &s,
                d.scale,
                &mut po.slice_mut(..so),
                &mut pml.slice_mut(..sml),
                &mut olat.slice_mut(at * hr * c..(at + ts) * hr * c),
            )?;
            at += ts;
        }
        let mut o = self.gpu.out::<bf16>(t * hr * dv)?;
        inv::apply_uv_inv(&self.gpu, &olat.as_view(), &kv_b.view(), &mut o.as_view_mut(), ad)?;
        Ok(o)
    }
    /// [`CudaBackend::mla_segs_bf16`] of several segments some of which take the expanded form: each of those
    /// alone, each run of consecutive others together (the latent form), their rows copied in and out.
    fn mla_segs_runs(
        &self,
        q: &CudaSlice<f32>,
        segs: &[(&DKv, &DMask, usize)],
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
        expand: impl Fn(&DMask, usize) -> bool,
    ) -> R<CudaSlice<bf16>> {
        let (qw, ow) = (d.heads * (d.nope + d.rope), d.heads * d.v);
        let t: usize = segs.iter().map(|s| s.2).sum();
        let mut out = self.gpu.out::<bf16>(t * ow)?;
        let (mut i, mut r0) = (0, 0);
        while i < segs.len() {
            let mut j = i + 1;
            if !expand(segs[i].1, segs[i].2) {
                while j < segs.len() && !expand(segs[j].1, segs[j].2) {
                    j += 1;
                }
            }
            let rows: usize = segs[i..j].iter().map(|s| s.2).sum();
            let mut qs = self.gpu.out::<f32>(rows * qw)?;
            self.gpu
                .stream
                .memcpy_dtod(&q.slice(r0 * qw..(r0 + rows) * qw), &mut qs)
                .map_err(super::drv("mla rows"))?;
            let o = self.mla_segs_bf16(&qs, &segs[i..j], l, kv_b, d)?;
            self.gpu
                .stream
                .memcpy_dtod(&o, &mut out.slice_mut(r0 * ow..(r0 + rows) * ow))
                .map_err(super::drv("mla rows"))?;
            (i, r0) = (j, r0 + rows);
        }
        Ok(out)
    }
    /// The expanded (multi-head) MLA of one sequence's `t` new rows (a prefill; [`seg_op::mla_attention_heads`]):
    /// kv_b expands each of the layer's `committed + t` latent rows into every head's row `v_h | k_nope_h | k_pe`
    /// (two GEMMs and a copy a head), and the queries `q_nope | q_pe` score against the keys directly: 320
    /// multiply-adds a head and row pair at K2.6's widths where the latent form takes 1088. Output `[t, Hr·Dv]`
    /// bf16, as the latent form's after W_UV.
    #[allow(clippy::too_many_arguments)]
    fn mla_expanded(
        &self,
        q: &CudaSlice<f32>,
        kv: &DKv,
        mask: &DMask,
        t: usize,
        l: usize,
        kv_b: &DMat,
        d: &MlaDims,
    ) -> R<CudaSlice<bf16>> {
        let (hr, c, p, dn, dv) = (d.heads, d.kv_lora, d.rope, d.nope, d.v);
        let (rows, ew) = (kv.committed + t, dv + dn + p);
        if mask.rows < t || rows > kv.cap {
            return Err(CudaError::Shape {
                op: "mla_attention",
                msg: format!(
                    "a mask of {} rows / a cache of {} rows for {} committed + {t} nodes",
                    mask.rows, kv.cap, kv.committed
                ),
            });
        }
        let base = l * kv.cap * kv.width;
        let lat = kv.buf.slice(base..base + rows * kv.width);
        let mut ckv = self.gpu.out::<bf16>(rows * c)?;
        copy_rows::copy_rows(&self.gpu, &lat, kv.width, &mut ckv.as_view_mut(), c, rows, c)?;
        let hs = rows * ew;
        let mut ex = self.gpu.out::<bf16>(hr * hs)?;
        for h in 0..hr {
            // kv_b's rows of head h: Dn of W_UK (keys), then Dv of W_UV (values).
            let w0 = h * (dn + dv) * c;
            let (wk, wv) = (
                kv_b.view().slice(w0..w0 + dn * c),
                kv_b.view().slice(w0 + dn * c..w0 + (dn + dv) * c),
            );
            let ckv = ckv.as_view();
            gemm_bf16::gemm_bf16_ld(
                &self.gpu,
                &ckv,
                &wv,
                &mut ex.slice_mut(h * hs..(h + 1) * hs),
                rows,
                c,
                dv,
                ew,
            )?;
            gemm_bf16::gemm_bf16_ld(
                &self.gpu,
                &ckv,
                &wk,
                &mut ex.slice_mut(h * hs + dv..(h + 1) * hs),
                rows,
                c,
                dn,
                ew,
            )?;
            copy_rows::copy_rows(
                &self.gpu,
                &lat.slice(c..),
                kv.width,
                &mut ex.slice_mut(h * hs + dv + dn..(h + 1) * hs),
                ew,
                rows,
                p,
            )?;
        }
        let qb = self.to_bf16(q)?; // [T, Hr, Dn + P]: each head's q_nope | q_pe (roped)
        let s = MlaShape {
            t,
            heads: hr,
            kv_lora: dv,
            rope: dn + p,
            committed: kv.committed,
        };
        let mut o = self.gpu.out::<bf16>(t * hr * dv)?;
        // A chain (a prefill) through the one-kernel causal form where it is built for these widths.
        if mask.causal && self.gpu.options().mla_prefill_flash && mla_prefill::supported(&self.gpu, dn + p, dv) {
            mla_prefill::mla_prefill(
                &self.gpu,
                &qb.as_view(),
                &ex.as_view(),
                hs,
                &s,
                d.scale,
                &mut o.as_view_mut(),
            )?;
            return Ok(o);
        }
        let split = MlaSplit::choose_heads(&self.gpu, &s);
        let (wo, wml) = split.workspace(&s);
        let (mut po, mut pml) = (self.new_f32(wo)?, self.new_f32(wml)?);
        let mv = mask.bits.as_view();
        seg_op::mla_attention_heads(
            &self.gpu,
            &qb.as_view(),
            &ex.as_view(),
            hs,
            Some((&mv, mask.words)),
            &s,
            &split,
            d.scale,
            &mut po.as_view_mut(),
            &mut pml.as_view_mut(),
            &mut o.as_view_mut(),
        )?;
        Ok(o)
    }
    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts(
        &self,
        xb: &CudaSlice<bf16>,
        t: usize,
        h: usize,
        r: &DRoutes,
        gate: &DI4,
        up: &DI4,
        down: &DI4,
    ) -> R<CudaSlice<f32>> {
        let g = &*self.gpu;
        // This rank's experts: all of them (tensor parallel: each holds a slice of every expert), or
        // first .. first + count (expert parallel: routes to other ranks' experts are skipped here).
        let (pairs, e, mi) = (t * r.k, gate.count, gate.n);
        // The down projection's K: the intermediate slice, or that padded with zero weights to the kernel's K
        // step at upload (tp4 / tp8 of small models, `pad_k`); gate and up then go to a [gate | up] row of the
        // padded width, their padded columns zero (silu(0) * 0 = 0 meets the zero weights).
        let kp = down.k;
        // gate and up in one launch into [gate | up] rows, the SwiGLU inside the down GEMM's x staging.
        let plan_gu = w4a16_gemm::plan_moe(g, pairs, e, 2 * mi, h);
        let plan_one = w4a16_gemm::plan_moe(g, pairs, e, mi, h);
        let plan_d = w4a16_gemm::plan_moe(g, pairs, e, h, kp);
        let tile = plan_gu.tile_rows();
        let mt = moe_align::max_tiles(pairs, e, tile);
        // Not zero-filled: moe_align writes n_tiles, the tiles below it and the local pairs' sorted entries, and the
        // GEMMs read only those (blocks past n_tiles exit first; a tile reads its own count of entries).
        let (mut sorted, mut tiles, mut n_tiles) = (g.out::<i32>(pairs)?, g.out::<i32>(3 * mt)?, g.out::<i32>(1)?);
        moe_align::moe_align_rank(
            g,
            &r.ids.as_view(),
            gate.first,
            e,
            tile,
            &mut sorted.as_view_mut(),
            &mut tiles.as_view_mut(),
            &mut n_tiles.as_view_mut(),
        )?;
        let ws_len = plan_gu
            .workspace_len(pairs, 2 * mi)
            .max(plan_one.workspace_len(pairs, mi))
            .max(plan_d.workspace_len(pairs, h));
        let mut ws = g.out::<f32>(ws_len.max(1))?;
        let (sv, tv, nv) = (sorted.as_view(), tiles.as_view(), n_tiles.as_view());
        let routing = w4a16_gemm::Routing {
            sorted: &sv,
            tiles: &tv,
            max_tiles: mt,
            n_tiles: &nv,
            tile_rows: tile,
        };
        let xv = xb.as_view();
        let gu = if kp == mi {
            let mut gu = g.out::<bf16>(pairs * 2 * mi)?;
            let (gw, uw) = (
                (&gate.packed.as_view(), &gate.scales.as_view()),
                (&up.packed.as_view(), &up.scales.as_view()),
            );
            w4a16_gemm::moe_w4a16(
                g,
                MoeX::Rows {
                    x: &xv,
                    ld: h,
                    row_div: r.k,
                },
                &routing,
                &[gw, uw],
                MoeDims {
                    pairs,
                    n_experts: e,
                    n: mi,
                    k: h,
                },
                &mut ws.as_view_mut(),
                (&mut gu.as_view_mut(), 2 * mi),
            )?;
            gu
        } else {
            let mut gu = g.zeros::<bf16>(pairs * 2 * kp)?;
            for (m, at) in [(gate, 0), (up, kp)] {
                w4a16_gemm::moe_w4a16(
                    g,
                    MoeX::Rows {
                        x: &xv,
                        ld: h,
                        row_div: r.k,
                    },
                    &routing,
                    &[(&m.packed.as_view(), &m.scales.as_view())],
                    MoeDims {
                        pairs,
                        n_experts: e,
                        n: mi,
                        k: h,
                    },
                    &mut ws.as_view_mut(),
                    (&mut gu.slice_mut(at..), 2 * kp),
                )?;
            }
            gu
        };
        // Not zero-filled (1.9 GB at a 16K-token prefill): the down GEMM writes every local pair's row, and the
        // combine skips the pairs of other ranks' experts (expert parallel), the only rows left unwritten.
        let mut y = g.out::<bf16>(pairs * h)?;
        // The large-M form (prefill) reads plain x rows: the SwiGLU goes first, into its own rows (the same
        // bits as the small form's fused staging).
        let act = if plan_d.large {
            let mut a = g.out::<bf16>(pairs * kp)?;
            silu_mul::silu_mul(
                g,
                &gu.as_view(),
                &gu.slice(kp..),
                &mut a.as_view_mut(),
                pairs,
                kp,
                2 * kp,
            )?;
            Some(a)
        } else {
            None
        };
        let (act_v, gu_v) = (act.as_ref().map(|a| a.as_view()), gu.as_view());
        let down_x = match &act_v {
            Some(a) => MoeX::Rows {
                x: a,
                ld: kp,
                row_div: 1,
            },
            None => MoeX::SiluGateUp { gu: &gu_v, ld: 2 * kp },
        };
        w4a16_gemm::moe_w4a16(
            g,
            down_x,
            &routing,
            &[(&down.packed.as_view(), &down.scales.as_view())],
            MoeDims {
                pairs,
                n_experts: e,
                n: h,
                k: kp,
            },
            &mut ws.as_view_mut(),
            (&mut y.as_view_mut(), h),
        )?;
        let mut out = g.out::<f32>(t * h)?;
        moe_combine::moe_combine_rank(
            g,
            &y.as_view(),
            h,
            &r.wts.as_view(),
            &r.ids.as_view(),
            (gate.first, gate.count),
            &mut out.as_view_mut(),
            t,
            r.k,
            h,
        )?;
        Ok(out)
    }
}

impl CudaBackend {
    /// Routed-expert shard shapes the W4A16 kernel takes.
    pub(super) fn i4_shape_ok(&self, count: usize, n: usize, k: usize) -> Result<()> {
        if !n.is_multiple_of(w4a16_gemm::N_STEP) || !k.is_multiple_of(w4a16_gemm::K_STEP) {
            bail!(
                "routed experts of shard shape [{count}, {n}, {k}]: the CUDA W4A16 kernel needs N % {} == 0 and K % \
                 {} == 0 (K is padded to it when a multiple of 32; convert with fewer ranks, e.g. --ranks 1)",
                w4a16_gemm::N_STEP,
                w4a16_gemm::K_STEP
            );
        }
        Ok(())
    }
    /// A new bf16 buffer of `n` elements filled by `f`.
    pub(super) fn filled_bf16(&self, n: usize, f: &Fill) -> R<CudaSlice<bf16>> {
        // SAFETY: every element is written by the fill before any read.
        let mut v = unsafe { self.gpu.stream.alloc::<bf16>(n) }.map_err(super::drv("fill alloc"))?;
        fill::fill_bf16(&self.gpu, &mut v.as_view_mut(), f)?;
        Ok(v)
    }
}
