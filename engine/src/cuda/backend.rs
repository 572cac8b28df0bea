//! [`CudaBackend`]: `backend::Backend` on one GPU with the kernels of kernels/cuda (through the wrappers
//! in cuda/ops), so `TargetModel<CudaBackend>` is the CPU reference's model code running on the device.
//!
//! Precision: activations and the residual stream are f32 device buffers like the CPU reference's; they are
//! rounded to bf16 where a bf16 GEMM (cuBLAS, W4A16) or the MLA kernel reads them; the latent KV cache is
//! bf16 (576 per token per layer). Router and lm_head logits come out of cuBLAS in f32.
//! Errors: the trait's ops are infallible (the CPU cannot fail), so a failed launch here is recorded (the
//! first one wins) and reported by [`Backend::check`], which the model calls at the end of every forward;
//! a failed op leaves an empty activation, and nothing panics.
//! Ranks: a model converted for R ranks runs as R ranks on this one GPU, one after the other on its stream:
//! each rank's own shards, its partial sums reduced on the device in rank order (`all_reduce`), vocab shards
//! merged in global order (`embedding`, `lm_head`), expert-parallel ranks skipping the other ranks' experts.
//! NCCL across GPUs is issue 11. Checked at load, with a clear error: routed-expert shapes the W4A16 kernel
//! takes (N % 32, K % 128).
//! The DFlash drafter's ops (per-head norm + NeoX RoPE, the non-causal block attention) run on the device
//! too, so `DFlashDrafter<CudaBackend>` drafts on the GPU over the target's embed_tokens / lm_head.
//! The device round's types: `Ids` / `Rope` / `Mask` are device buffers (a forward uploads its RoPE rows
//! and mask once, not per layer), `Tree` is `cuda::tree::DeviceTree` (top-K, build, mask, decisions, walk
//! on the GPU; the walk is the round's one read back).
//! Tests: engine/tests/cuda_target.rs, cuda_drafter.rs, cuda_ddtree.rs, cuda_round.rs.

use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::ops::act_f32;
use super::ops::gqa_attention::{gqa_attention, GqaShape, GqaSplit};
use super::ops::mla_absorb::{absorb_q, apply_uv, AbsorbDims};
use super::ops::mla_attention::{self as seg_op, mla_attention, MlaShape, MlaSplit};
use super::ops::rope::RopeLayout;
use super::ops::{
    argmax, copy_rows, embed, fill, gather_rows, gemm_bf16, kv_compact, moe_align, moe_combine, moe_router,
    round_state, w4a16_gemm,
};
use super::tree::{DMask, DeviceTree};
use super::types::{pad_k, storage_id, DGraph, DKv, DMat, DPos, DRope, DRoutes, DI4};
use super::{CudaError, Gpu};
use crate::backend::{Backend, PosOf, RopeTable, VocabShards, WeightRef};
use crate::cpu::ops::{Fill, MlaDims, Router};
use crate::ddtree::{TreeResult, Visibility};
use crate::model::source::Slab;
use crate::model::weights::{I4Stack, Mat};
use crate::model::AttnMode;
use crate::sampling::Sampling;

type R<T> = std::result::Result<T, CudaError>;

/// The CUDA backend: the GPU and the first error of a failed op (see the module comment).
/// Device rounds are captured into CUDA graphs unless the GPU's switch is off ([`Gpu::set_graphs`],
/// `KDTREE_CUDA_GRAPHS=0`); then the same ops run eagerly.
#[derive(Clone)]
pub struct CudaBackend {
    pub(super) gpu: Arc<Gpu>,
    pub(super) err: Arc<Mutex<Option<String>>>,
}

impl CudaBackend {
    pub fn new(gpu: Arc<Gpu>) -> CudaBackend {
        CudaBackend {
            gpu,
            err: Arc::new(Mutex::new(None)),
        }
    }
    /// [`Gpu::set_graphs`].
    pub fn set_graphs(&self, on: bool) {
        self.gpu.set_graphs(on);
    }
    pub fn graphs(&self) -> bool {
        self.gpu.graphs()
    }
    /// An error when the stream is capturing a graph: storage that outlives the graph must not move inside it.
    pub(super) fn not_capturing(&self, what: &str) -> R<()> {
        use cudarc::driver::sys::CUstreamCaptureStatus as S;
        match self.gpu.stream.capture_status().map_err(super::drv("capture status"))? {
            S::CU_STREAM_CAPTURE_STATUS_NONE => Ok(()),
            _ => Err(CudaError::Shape {
                op: "graph capture",
                msg: what.to_string(),
            }),
        }
    }
    /// Writes `v` into a device counter (a host-side change of a length).
    pub(super) fn set_dev(&self, dev: &mut CudaSlice<i32>, v: usize) -> R<()> {
        let v = i32::try_from(v).map_err(|_| CudaError::Shape {
            op: "position",
            msg: format!("{v} exceeds i32"),
        })?;
        super::GpuStats::bump(&self.gpu.stats.uploads);
        self.gpu.drain()?;
        self.gpu
            .stream
            .memcpy_htod(&[v], dev)
            .map_err(super::drv("position upload"))
    }
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    /// Run `f`; on error keep the first message and return None.
    pub(super) fn run<T>(&self, op: &str, f: impl FnOnce() -> R<T>) -> Option<T> {
        match f() {
            Ok(v) => Some(v),
            Err(e) => {
                let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
                g.get_or_insert_with(|| format!("cuda backend, {op}: {e}"));
                None
            }
        }
    }
    /// A zero-length buffer for a failed op's result (its error is already recorded). Never panics: when
    /// even a zero-length allocation fails (an invalidated graph capture fails every call until it ends),
    /// a null slice stands in.
    pub(super) fn empty_of<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self) -> CudaSlice<T> {
        self.gpu.stream.alloc_zeros::<T>(0).unwrap_or_else(|_| {
            // SAFETY: a null pointer of length 0: nothing reads or writes through it.
            unsafe { self.gpu.stream.upgrade_device_ptr::<T>(0, 0) }
        })
    }
    pub(super) fn empty(&self) -> CudaSlice<f32> {
        self.empty_of::<f32>()
    }
    pub(super) fn new_f32(&self, n: usize) -> R<CudaSlice<f32>> {
        self.gpu.zeros::<f32>(n)
    }
    pub(super) fn to_bf16(&self, x: &CudaSlice<f32>) -> R<CudaSlice<bf16>> {
        let mut y = self.gpu.out::<bf16>(x.len())?;
        act_f32::f32_to_bf16(&self.gpu, &x.as_view(), &mut y.as_view_mut())?;
        Ok(y)
    }
    pub(super) fn to_f32(&self, x: &CudaSlice<bf16>) -> R<CudaSlice<f32>> {
        let mut y = self.gpu.out::<f32>(x.len())?;
        act_f32::bf16_to_f32(&self.gpu, &x.as_view(), &mut y.as_view_mut())?;
        Ok(y)
    }
    pub(super) fn empty_u32(&self) -> CudaSlice<u32> {
        self.empty_of::<u32>()
    }
    pub(super) fn empty_rope(&self, half: usize) -> DRope {
        let z = || self.empty_of::<f32>();
        DRope {
            cos: z(),
            sin: z(),
            half,
            rows: 0,
        }
    }
    pub(super) fn copy(&self, src: &CudaSlice<f32>, from: usize, to: usize) -> R<CudaSlice<f32>> {
        let mut y = self.new_f32(to - from)?;
        if to > from {
            self.gpu
                .stream
                .memcpy_dtod(&src.slice(from..to), &mut y)
                .map_err(super::drv("copy"))?;
        }
        Ok(y)
    }
}

impl Backend for CudaBackend {
    type Act = CudaSlice<f32>;
    type Mat = DMat;
    type I4 = DI4;
    type Vector = CudaSlice<bf16>;
    type VectorF32 = CudaSlice<f32>;
    type Kv = DKv;
    type Routes = DRoutes;
    type Ids = CudaSlice<u32>;
    type Rope = DRope;
    type Mask = DMask;
    type Tree = DeviceTree;
    type Pos = DPos;
    type Graph = DGraph;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn check(&self) -> Result<()> {
        let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
        match g.take() {
            Some(e) => bail!("{e}"),
            None => Ok(()),
        }
    }

    fn upload_bf16(&self, m: Mat) -> Result<DMat> {
        Ok(DMat {
            w: self.gpu.upload(&m.w[..])?,
            rows: m.rows,
            cols: m.cols,
        })
    }
    fn upload_i4g32(&self, s: I4Stack) -> Result<DI4> {
        if !s.k.is_multiple_of(w4a16_gemm::K_STEP) && s.k.is_multiple_of(32) {
            // A rank's slice narrower than the kernel's K step (the down projection of tp4 / tp8 small models):
            // zero weights (zero scales) to the next step; `experts` widens the [gate | up] rows to match.
            let (packed, scales, kp) = pad_k(&s.packed, &s.scales, s.count * s.n, s.k, w4a16_gemm::K_STEP);
            self.i4_shape_ok(s.count, s.n, kp)?;
            return Ok(DI4 {
                packed: self.gpu.upload(&packed)?,
                scales: self.gpu.upload(&scales)?,
                first: s.first,
                count: s.count,
                n: s.n,
                k: kp,
                k_src: s.k,
            });
        }
        self.i4_shape_ok(s.count, s.n, s.k)?;
        Ok(DI4 {
            packed: self.gpu.upload(&s.packed[..])?,
            scales: self.gpu.upload(&s.scales[..])?,
            first: s.first,
            count: s.count,
            n: s.n,
            k: s.k,
            k_src: s.k,
        })
    }
    fn upload_vector(&self, v: Slab<bf16>) -> Result<CudaSlice<bf16>> {
        Ok(self.gpu.upload(&v[..])?)
    }
    fn upload_vector_f32(&self, v: Slab<f32>) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.upload(&v[..])?)
    }
    fn mat_rows(&self, m: &DMat) -> usize {
        m.rows
    }
    fn checks_weights(&self) -> bool {
        self.gpu.check_weights()
    }
    fn weight_xxh3(&self, w: WeightRef<'_, Self>) -> Result<Vec<u64>> {
        use super::ops::xxh3::xxh3_of;
        let g = &*self.gpu;
        Ok(match w {
            WeightRef::Mat(m) => vec![xxh3_of(g, &m.w)?],
            WeightRef::Vector(v) => vec![xxh3_of(g, v)?],
            WeightRef::VectorF32(v) => vec![xxh3_of(g, v)?],
            WeightRef::I4(s) if s.k == s.k_src => vec![xxh3_of(g, &s.packed)?, xxh3_of(g, &s.scales)?],
            WeightRef::I4(s) => {
                // Padded at upload (tp4 / tp8 of a small model): the device rows, read back, without the padding.
                let (rows, k, kp) = (s.count * s.n, s.k_src, s.k);
                let (p, sc) = (g.download(&s.packed)?, g.download(&s.scales)?);
                let p: Vec<u8> = (0..rows)
                    .flat_map(|r| p[r * kp / 2..r * kp / 2 + k / 2].iter().copied())
                    .collect();
                let sc: Vec<bf16> = (0..rows)
                    .flat_map(|r| sc[r * kp / 32..r * kp / 32 + k / 32].iter().copied())
                    .collect();
                use kdtree_formats::manifest::xxh3_64;
                vec![xxh3_64(&p), xxh3_64(bytemuck::cast_slice(&sc))]
            }
        })
    }
    // Dummy weights: allocated and filled in place (cuda/ops/fill.rs), no host bytes.
    fn fill_bf16(&self, rows: usize, cols: usize, f: &Fill) -> Result<DMat> {
        Ok(DMat {
            w: self.filled_bf16(rows * cols, f)?,
            rows,
            cols,
        })
    }
    fn fill_vector(&self, n: usize, f: &Fill) -> Result<CudaSlice<bf16>> {
        Ok(self.filled_bf16(n, f)?)
    }
    fn fill_vector_f32(&self, n: usize, f: &Fill) -> Result<CudaSlice<f32>> {
        // SAFETY: every element is written by the fill before any read.
        let mut v = unsafe { self.gpu.stream.alloc::<f32>(n) }.map_err(super::drv("fill alloc"))?;
        fill::fill_f32(&self.gpu, &mut v.as_view_mut(), f)?;
        Ok(v)
    }
    fn fill_i4g32(&self, first: usize, count: usize, n: usize, k: usize, packed: &Fill, scales: &Fill) -> Result<DI4> {
        self.i4_shape_ok(count, n, k)?;
        // SAFETY: every byte is written by the fill before any read.
        let mut p = unsafe { self.gpu.stream.alloc::<u8>(count * n * k / 2) }.map_err(super::drv("fill alloc"))?;
        fill::fill_u8(&self.gpu, &mut p.as_view_mut(), packed)?;
        Ok(DI4 {
            packed: p,
            scales: self.filled_bf16(count * n * k / 32, scales)?,
            first,
            count,
            n,
            k,
            k_src: k,
        })
    }

    fn rope_upload(&self, r: RopeTable) -> DRope {
        let rows = r.cos.len() / r.half.max(1);
        self.run("rope_upload", || {
            Ok(DRope {
                cos: self.gpu.upload(&r.cos)?,
                sin: self.gpu.upload(&r.sin)?,
                half: r.half,
                rows,
            })
        })
        .unwrap_or_else(|| self.empty_rope(r.half))
    }
    fn rope_gather(&self, r: &RopeTable, idx: &CudaSlice<u32>, t: usize) -> DRope {
        self.run("rope_gather", || {
            let (half, n) = (r.half, r.cos.len() / r.half.max(1));
            let (tc, ts) = (self.gpu.upload(&r.cos)?, self.gpu.upload(&r.sin)?);
            let (mut cos, mut sin) = (self.gpu.out::<f32>(t * half)?, self.gpu.out::<f32>(t * half)?);
            let iv = idx.as_view();
            gather_rows::gather_rows(
                &self.gpu,
                &tc.as_view(),
                half,
                n,
                &iv,
                &mut cos.as_view_mut(),
                half,
                t,
                half,
            )?;
            gather_rows::gather_rows(
                &self.gpu,
                &ts.as_view(),
                half,
                n,
                &iv,
                &mut sin.as_view_mut(),
                half,
                t,
                half,
            )?;
            Ok(DRope {
                cos,
                sin,
                half,
                rows: t,
            })
        })
        .unwrap_or_else(|| self.empty_rope(r.half))
    }
    fn mask_upload(&self, v: &Visibility) -> DMask {
        let bits = self
            .run("mask_upload", || self.gpu.upload(&v.bits))
            .unwrap_or_else(|| self.empty_of::<u64>());
        DMask {
            bits,
            rows: v.rows,
            words: v.words,
        }
    }
    fn ids_from_host(&self, ids: &[u32]) -> CudaSlice<u32> {
        self.run("ids_from_host", || self.gpu.upload(ids))
            .unwrap_or_else(|| self.empty_u32())
    }
    fn ids_copy(&self, dst: &mut CudaSlice<u32>, at: usize, src: &CudaSlice<u32>, n: usize) {
        self.run("ids_copy", || {
            if at + n > dst.len() || n > src.len() {
                return Err(CudaError::Shape {
                    op: "ids_copy",
                    msg: format!("{n} ids at {at} of {} from {}", dst.len(), src.len()),
                });
            }
            self.gpu
                .stream
                .memcpy_dtod(&src.slice(..n), &mut dst.slice_mut(at..at + n))
                .map_err(super::drv("ids_copy"))
        });
    }
    fn ids_write(&self, dst: &mut CudaSlice<u32>, at: usize, host: &[u32]) -> Result<()> {
        if at + host.len() > dst.len() {
            bail!("ids_write: {} ids at {at} of {}", host.len(), dst.len());
        }
        super::GpuStats::bump(&self.gpu.stats.uploads);
        self.gpu.drain()?;
        self.gpu
            .stream
            .memcpy_htod(host, &mut dst.slice_mut(at..at + host.len()))
            .map_err(super::drv("ids_write"))?;
        Ok(())
    }
    fn ids_to_host(&self, ids: &CudaSlice<u32>) -> Result<Vec<u32>> {
        Ok(self.gpu.download(ids)?)
    }
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
    fn pos_new(&self, v: usize) -> DPos {
        let mut dev = self
            .run("pos_new", || self.gpu.zeros::<i32>(1))
            .unwrap_or_else(|| self.empty_of::<i32>());
        if v != 0 {
            self.run("pos_new", || self.set_dev(&mut dev, v));
        }
        DPos { host: v, dev }
    }
    fn pos_get(&self, p: &DPos) -> usize {
        p.host
    }
    fn pos_set(&self, p: &mut DPos, v: usize) {
        if p.host != v {
            self.run("pos_set", || self.set_dev(&mut p.dev, v));
            p.host = v;
        }
    }
    fn pos_add(&self, p: &mut DPos, n: usize) {
        if n > 0 {
            self.run("pos_add", || {
                round_state::pos_add(&self.gpu, &mut p.dev.as_view_mut(), n)
            });
            p.host += n;
        }
    }

    fn act_from_host(&self, x: Vec<f32>) -> CudaSlice<f32> {
        if x.is_empty() {
            return self.empty(); // (the drafter's empty context cache) no copy of nothing
        }
        self.run("upload", || self.gpu.upload(&x))
            .unwrap_or_else(|| self.empty())
    }
    fn to_host(&self, x: &CudaSlice<f32>) -> Vec<f32> {
        self.run("download", || self.gpu.download(x)).unwrap_or_default()
    }
    fn rows(&self, x: &CudaSlice<f32>, cols: usize, from: usize, to: usize) -> CudaSlice<f32> {
        self.run("rows", || self.copy(x, from * cols, to * cols))
            .unwrap_or_else(|| self.empty())
    }
    fn append_rows(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) {
        let n = acc.len();
        if let Some(y) = self.run("append_rows", || {
            let mut y = self.new_f32(n + x.len())?;
            let s = &self.gpu.stream;
            if n > 0 {
                s.memcpy_dtod(acc, &mut y.slice_mut(..n))
                    .map_err(super::drv("append_rows"))?;
            }
            if !x.is_empty() {
                s.memcpy_dtod(x, &mut y.slice_mut(n..))
                    .map_err(super::drv("append_rows"))?;
            }
            Ok(y)
        }) {
            *acc = y;
        }
    }
    fn truncate(&self, x: &mut CudaSlice<f32>, n: usize) {
        if n < x.len() {
            if let Some(y) = self.run("truncate", || self.copy(x, 0, n)) {
                *x = y;
            }
        }
    }
    fn set_rows(&self, dst: &mut CudaSlice<f32>, cols: usize, at: usize, src: &CudaSlice<f32>, n: usize) {
        self.run("set_rows", || {
            if (at + n) * cols > dst.len() || n * cols > src.len() {
                return Err(CudaError::Shape {
                    op: "set_rows",
                    msg: format!(
                        "rows {at}..{} of {cols} into {} values from {}",
                        at + n,
                        dst.len(),
                        src.len()
                    ),
                });
            }
            if n > 0 {
                self.gpu
                    .stream
                    .memcpy_dtod(&src.slice(..n * cols), &mut dst.slice_mut(at * cols..(at + n) * cols))
                    .map_err(super::drv("set_rows"))?;
            }
            Ok(())
        });
    }
    fn set_cols(
        &self,
        dst: &mut CudaSlice<f32>,
        dst_cols: usize,
        at: usize,
        src: &CudaSlice<f32>,
        src_cols: usize,
        t: usize,
    ) {
        self.run("set_cols", || {
            let mut d = dst.slice_mut(at..);
            act_f32::copy_rows_f32(&self.gpu, &src.as_view(), src_cols, &mut d, dst_cols, t, src_cols)
        });
    }
    fn zeros(&self, n: usize) -> CudaSlice<f32> {
        self.run("zeros", || self.new_f32(n)).unwrap_or_else(|| self.empty())
    }
    fn reserve_rows(&self, x: &mut CudaSlice<f32>, cols: usize, rows: usize) -> bool {
        if rows * cols <= x.len() {
            return false;
        }
        // Doubling from 256 rows: a move only when the context outgrows it.
        let cap = rows.next_power_of_two().max(256) * cols;
        match self.run("reserve_rows", || {
            self.not_capturing("a row cache grows (reserve it before a captured round)")?;
            let mut y = self.new_f32(cap)?;
            if !x.is_empty() {
                self.gpu
                    .stream
                    .memcpy_dtod(&*x, &mut y.slice_mut(..x.len()))
                    .map_err(super::drv("reserve_rows"))?;
            }
            Ok(y)
        }) {
            Some(y) => {
                *x = y;
                true
            }
            None => false,
        }
    }
    fn write_rows_at(&self, dst: &mut CudaSlice<f32>, cols: usize, at: &DPos, src: &CudaSlice<f32>, n: usize) {
        self.run("write_rows_at", || {
            round_state::store_rows_f32(
                &self.gpu,
                &mut dst.as_view_mut(),
                cols,
                &at.dev.as_view(),
                at.host,
                &src.as_view(),
                n,
            )
        });
    }

    fn linear(&self, x: &CudaSlice<f32>, t: usize, w: &DMat) -> CudaSlice<f32> {
        self.run("linear", || self.gemm_f32(x, t, w))
            .unwrap_or_else(|| self.empty())
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
                    &m.w.as_view(),
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
                    &m.w.as_view(),
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

    fn kv_new(&self, layers: usize, width: usize) -> DKv {
        let buf = self
            .run("kv_new", || self.gpu.zeros::<bf16>(0))
            .unwrap_or_else(|| self.empty_of::<bf16>());
        let pos = self
            .run("kv_new", || self.gpu.zeros::<i32>(1))
            .unwrap_or_else(|| self.empty_of::<i32>());
        DKv {
            buf,
            layers,
            width,
            cap: 0,
            committed: 0,
            scratch: 0,
            pos,
            id: storage_id(),
        }
    }
    fn kv_committed(&self, kv: &DKv) -> usize {
        kv.committed
    }
    fn kv_reserve(&self, kv: &mut DKv, rows: usize) -> Result<()> {
        self.grow(kv, rows)?;
        Ok(())
    }
    fn kv_id(&self, kv: &DKv) -> u64 {
        kv.id
    }
    fn kv_drop_scratch(&self, kv: &mut DKv) {
        kv.scratch = 0;
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
        self.run("kv_append_latent", || {
            let (w, c) = (kv.width, norm.len());
            let t = ckv.len() / w;
            self.grow(kv, kv.committed + t)?;
            // [T, C+P] f32: rms_norm of the c_kv part, k_pe copied, then RoPE on it; stored as bf16.
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
                &rope.cos.as_view(),
                &rope.sin.as_view(),
                r,
                false,
            )?;
            // At the committed length read on the device (a captured round replays at any length).
            let base = l * kv.cap * w;
            round_state::store_rows_bf16(
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
    fn kv_set_scratch(&self, kv: &mut DKv, t: usize) {
        kv.scratch = t;
    }
    fn kv_compact(&self, kv: &mut DKv, path: &[usize]) -> Result<()> {
        for (i, &p) in path.iter().enumerate() {
            if p >= kv.scratch || p < i || (i > 0 && p <= path[i - 1]) {
                bail!(
                    "kv_compact: path[{i}] = {p} is not a strictly increasing node index below {} scratch rows",
                    kv.scratch
                );
            }
        }
        let ids: Vec<i32> = path.iter().map(|&p| p as i32).collect();
        let dpath = self.gpu.upload(&ids)?;
        kv_compact::kv_compact(
            &self.gpu,
            &mut kv.buf.as_view_mut(),
            kv.layers,
            kv.cap,
            kv.width,
            kv.committed,
            &dpath.as_view(),
            path.len(),
        )?;
        round_state::pos_add(&self.gpu, &mut kv.pos.as_view_mut(), path.len())?;
        kv.committed += path.len();
        kv.scratch = 0;
        self.check()
    }
    fn kv_commit_rows(&self, kv: &mut DKv, n: usize) -> Result<()> {
        if n > kv.scratch {
            bail!("kv_commit_rows: {n} rows of {} scratch rows", kv.scratch);
        }
        round_state::pos_add(&self.gpu, &mut kv.pos.as_view_mut(), n)?;
        self.check()
    }
    fn kv_commit_rows_host(&self, kv: &mut DKv, n: usize) {
        kv.committed += n;
        kv.scratch = 0;
    }
    fn kv_truncate(&self, kv: &mut DKv, len: usize) -> Result<()> {
        if len > kv.committed {
            bail!("truncate to {len}: only {} rows are committed", kv.committed);
        }
        if len != kv.committed {
            self.set_dev(&mut kv.pos, len)?;
        }
        kv.committed = len;
        kv.scratch = 0;
        Ok(())
    }
    fn kv_reset(&self, kv: &mut DKv) {
        if kv.committed != 0 {
            self.run("kv_reset", || self.set_dev(&mut kv.pos, 0));
        }
        kv.committed = 0;
        kv.scratch = 0;
    }
    fn kv_row_bytes(&self, kv: &DKv) -> usize {
        kv.layers * kv.width * std::mem::size_of::<bf16>()
    }
    fn kv_release(&self, kv: &mut DKv) {
        self.kv_reset(kv);
        if kv.cap > 0 {
            kv.buf = self
                .run("kv_release", || self.gpu.zeros::<bf16>(0))
                .unwrap_or_else(|| self.empty_of::<bf16>());
            kv.cap = 0;
            kv.id = storage_id();
        }
    }
    fn mem_free(&self) -> Option<usize> {
        self.gpu.mem_info().ok().map(|(free, _)| free)
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
    fn kv_append_latent_segs(
        &self,
        segs: &mut [(&mut DKv, &DRope, usize)],
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
            for (kv, _, ts) in segs.iter_mut() {
                self.grow(kv, kv.committed + *ts)?;
            }
            let mut at = 0;
            for chunk in segs.chunks_mut(round_state::MAX_SEGS) {
                let rows_n: usize = chunk.iter().map(|s| s.2).sum();
                let mut parts: Vec<round_state::StoreSeg<'_>> = chunk
                    .iter_mut()
                    .map(|(kv, _, ts)| {
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
                round_state::store_rows_seg_bf16(&self.gpu, &mut parts, w, &rows.slice(at * w..(at + rows_n) * w))?;
                at += rows_n;
            }
            Ok(())
        });
    }
    fn rope_cat(&self, ropes: &[&DRope]) -> DRope {
        let half = ropes.first().map_or(0, |r| r.half);
        self.run("rope_cat", || {
            let rows: usize = ropes.iter().map(|r| r.rows).sum();
            let (mut cos, mut sin) = (self.new_f32(rows * half)?, self.new_f32(rows * half)?);
            let mut at = 0;
            for r in ropes {
                let n = r.rows * half;
                if n > 0 {
                    self.gpu
                        .stream
                        .memcpy_dtod(&r.cos.slice(..n), &mut cos.slice_mut(at..at + n))
                        .map_err(super::drv("rope_cat"))?;
                    self.gpu
                        .stream
                        .memcpy_dtod(&r.sin.slice(..n), &mut sin.slice_mut(at..at + n))
                        .map_err(super::drv("rope_cat"))?;
                }
                at += n;
            }
            Ok(DRope { cos, sin, half, rows })
        })
        .unwrap_or_else(|| self.empty_rope(half))
    }

    fn moe_route(&self, logits: &CudaSlice<f32>, t: usize, r: &Router, bias: Option<&CudaSlice<f32>>) -> DRoutes {
        let res = self.run("moe_route", || {
            let (mut ids, mut wts) = (self.gpu.out::<i32>(t * r.top_k)?, self.gpu.out::<f32>(t * r.top_k)?);
            let c = *r;
            let bv = bias.map(|b| b.as_view());
            moe_router::moe_router(
                &self.gpu,
                &logits.as_view(),
                bv.as_ref(),
                t,
                c,
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
        x: &CudaSlice<f32>,
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
            let kw = kv_heads * head_dim;
            let (c, room) = (ctx_len.host, ctx.0.len().checked_div(kw).unwrap_or(0));
            if c > room || ctx.1.len() != ctx.0.len() {
                return Err(CudaError::Shape { op: "gqa_attention", msg: format!("context keys/values of {} / {} values hold fewer than C={c} rows of Hk={kv_heads} x D={head_dim}", ctx.0.len(), ctx.1.len()) });
            }
            let s = GqaShape { b, ctx: c, heads, kv_heads, head_dim };
            // Split by the caches' room, C read on the device (as the MLA attention).
            let split = GqaSplit { splits: GqaSplit::choose(&self.gpu, &GqaShape { ctx: room, ..s }).splits, rows_per_split: 0 };
            let (wo, wml) = split.workspace(&s);
            // Workspace and output are allocated per call (as the MLA attention's).
            let (mut po, mut pml, mut out) = (self.new_f32(wo)?, self.new_f32(wml)?, self.new_f32(b * heads * head_dim)?);
            let (kc, vc, kb, vb) = (ctx.0.as_view(), ctx.1.as_view(), block.0.as_view(), block.1.as_view());
            let cv = ctx_len.dev.as_view();
            gqa_attention(&self.gpu, &q.as_view(), (&kc, &vc), Some(&cv), (&kb, &vb), &s, &split, &mut po.as_view_mut(), &mut pml.as_view_mut(), &mut out.as_view_mut())?;
            Ok(out)
        })
        .unwrap_or_else(|| self.empty())
    }

    fn tree_new(&self, budget: usize, rows: usize, vocab: usize, k: usize) -> Result<DeviceTree> {
        Ok(DeviceTree::with_k(&self.gpu, budget, rows, vocab, k)?)
    }
    fn tree_build(&self, tree: &mut DeviceTree, draft: &CudaSlice<f32>, row0: usize) -> Result<()> {
        let (from, to) = (row0 * tree.vocab, (row0 + tree.rows) * tree.vocab);
        if draft.len() < to {
            bail!(
                "tree_build: {} draft logits for rows {row0}..{} of {}",
                draft.len(),
                row0 + tree.rows,
                tree.vocab
            );
        }
        tree.build(&self.gpu, &draft.slice(from..to), tree.vocab)?;
        self.check()
    }
    fn tree_set_root(&self, tree: &mut DeviceTree, root: u32) -> Result<()> {
        Ok(tree.set_bonus(&self.gpu, root)?)
    }
    fn tree_root<'t>(&self, tree: &'t DeviceTree) -> &'t CudaSlice<u32> {
        &tree.bonus
    }
    fn tree_tokens<'t>(&self, tree: &'t DeviceTree) -> &'t CudaSlice<u32> {
        &tree.tokens
    }
    fn tree_depths<'t>(&self, tree: &'t DeviceTree) -> &'t CudaSlice<u32> {
        &tree.depths
    }
    fn tree_mask<'t>(&self, tree: &'t DeviceTree) -> &'t DMask {
        &tree.mask
    }
    fn tree_walk(
        &self,
        tree: &mut DeviceTree,
        logits: &CudaSlice<f32>,
        row0: usize,
        s: &Sampling,
        kv: &DKv,
    ) -> Result<()> {
        let (n, v) = (tree.budget + 1, tree.vocab);
        if logits.len() < (row0 + n) * v {
            bail!("tree_walk: {} logits for {n} nodes from row {row0} x {v}", logits.len());
        }
        tree.walk_sampled(
            &self.gpu,
            &logits.slice(row0 * v..(row0 + n) * v),
            v,
            s,
            0,
            Some(&kv.pos.as_view()),
        )?;
        self.check()
    }
    fn tree_walk_decided(&self, tree: &mut DeviceTree, decisions: &CudaSlice<u32>, row0: usize) -> Result<()> {
        let n = tree.budget + 1;
        if decisions.len() < row0 + n {
            bail!(
                "tree_walk_decided: {} decisions for {n} nodes from row {row0}",
                decisions.len()
            );
        }
        self.gpu
            .stream
            .memcpy_dtod(&decisions.slice(row0..row0 + n), &mut tree.decisions)
            .map_err(super::drv("tree_walk_decided"))?;
        tree.walk(&self.gpu)?;
        self.check()
    }
    fn tree_path_rows(
        &self,
        tree: &DeviceTree,
        x: &CudaSlice<f32>,
        row0: usize,
        cols: usize,
        rows_out: usize,
    ) -> CudaSlice<f32> {
        self.run("tree_path_rows", || {
            let mut out = self.new_f32(rows_out * cols)?;
            let nodes = (x.len().checked_div(cols).unwrap_or(0))
                .saturating_sub(row0)
                .min(tree.budget + 1);
            let x = x.slice((row0 * cols).min(x.len())..);
            let wv = tree.walk_out.slice(..1 + rows_out.min(tree.rows + 1));
            if rows_out > tree.rows + 1 {
                return Err(CudaError::Shape {
                    op: "tree_path_rows",
                    msg: format!("{rows_out} rows for walks of up to {}", tree.rows + 1),
                });
            }
            round_state::path_rows(&self.gpu, &x, nodes, cols, &wv, rows_out, &mut out.as_view_mut())?;
            Ok(out)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn tree_commit(&self, tree: &mut DeviceTree, kv: &mut DKv, ctx: &mut DPos) -> Result<()> {
        let m = tree.rows + 1;
        if kv.committed + m > kv.cap || kv.scratch < tree.budget + 1 {
            bail!(
                "tree_commit: {} committed + a path of up to {m} in a cache of {} rows ({} scratch rows)",
                kv.committed,
                kv.cap,
                kv.scratch
            );
        }
        let (n, rest) = tree.walk_out.split_at(1);
        let path = rest.slice(..m);
        kv_compact::kv_compact_dev(
            &self.gpu,
            &mut kv.buf.as_view_mut(),
            kv.layers,
            kv.cap,
            kv.width,
            kv.committed,
            &kv.pos.as_view(),
            &path,
            &n,
        )?;
        round_state::round_advance(
            &self.gpu,
            &tree.walk_out.as_view(),
            m,
            &mut kv.pos.as_view_mut(),
            Some(&mut ctx.dev.as_view_mut()),
            &mut tree.bonus.as_view_mut(),
        )?;
        self.check()
    }
    fn tree_commit_host(&self, _tree: &DeviceTree, kv: &mut DKv, ctx: &mut DPos, n: usize) {
        kv.committed += n;
        kv.scratch = 0;
        ctx.host += n;
    }
    fn tree_result(&self, tree: &DeviceTree) -> Result<TreeResult> {
        Ok(tree.result_to_host(&self.gpu)?)
    }
    fn tree_result_words(&self, tree: &DeviceTree) -> usize {
        tree.walk_out.len()
    }
    fn tree_result_into(&self, tree: &DeviceTree, stage: &mut CudaSlice<u32>, at: usize) {
        self.run("tree_result_into", || {
            let n = tree.walk_out.len();
            if at + n > stage.len() {
                return Err(CudaError::Shape {
                    op: "tree_result_into",
                    msg: format!("{n} words at {at} of a stage of {}", stage.len()),
                });
            }
            let mut dst = stage.slice_mut(at..at + n);
            // SAFETY: i32 and u32 have the same size and every bit pattern is valid for both.
            let mut dst = unsafe { dst.transmute_mut::<i32>(n) }.expect("the stage slice holds n words");
            self.gpu
                .stream
                .memcpy_dtod(&tree.walk_out, &mut dst)
                .map_err(super::drv("tree_result_into"))
        });
    }
    fn tree_result_from(&self, tree: &DeviceTree, words: &[u32]) -> Result<TreeResult> {
        let w: Vec<i32> = words.iter().map(|&x| x as i32).collect();
        Ok(tree.result_from(&w)?)
    }
    fn graph_run(&self, graph: &mut Option<DGraph>, key: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        if !self.graphs() {
            *graph = None;
            return body();
        }
        if let Some(g) = graph.as_ref().filter(|g| g.key == key) {
            super::GpuStats::bump(&self.gpu.stats.graph_launches);
            g.graph.launch().map_err(super::drv("graph launch"))?;
            return Ok(());
        }
        *graph = None;
        let s = &self.gpu.stream;
        let before = self.gpu.stats.snapshot();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(super::drv("begin graph capture"))?;
        let r = body();
        // Always end the capture (a failed body must not leave the stream capturing). cudarc's end_capture
        // first returns any error a drop recorded in the context (an invalidated capture fails the frees
        // too) without ending it: clear that first.
        let _ = self.gpu.ctx.check_err();
        let g = s.end_capture(CUgraphInstantiate_flags(0));
        let captured = match (r, self.check(), g) {
            (Ok(()), Ok(()), Ok(Some(g))) => Ok(g),
            (r, c, g) => Err(r
                .err()
                .or(c.err())
                .map(|e| format!("{e:#}"))
                .or(g.err().map(|e| format!("end capture: {e}")))
                .unwrap_or_else(|| "the capture recorded nothing".into())),
        };
        // Every rank of the run captures the same round here: none launches its graph (whose collectives wait for
        // the others) before all have captured and instantiated theirs (comm::LaunchGate).
        let gated = self.gpu.comm().gate();
        let g = match captured {
            Ok(g) => g,
            Err(why) => {
                // Nothing ran (a capture only records): run the same ops eagerly, and say so once.
                let _ = self.gpu.ctx.check_err(); // drops inside the failed capture may have recorded its error
                super::GpuStats::bump(&self.gpu.stats.capture_failures);
                self.gpu.note_capture_failure(&why);
                self.gpu.set_graphs(false); // not again on this GPU: every later round runs eagerly
                return body();
            }
        };
        let after = self.gpu.stats.snapshot();
        if let Ok(c) = super::GraphCensus::of(&g) {
            self.gpu.set_last_graph(c);
        }
        gated?;
        super::GpuStats::bump(&self.gpu.stats.graph_launches);
        g.launch().map_err(super::drv("graph launch"))?;
        *graph = Some(DGraph {
            key,
            graph: g,
            kernels: after[0] - before[0],
            blas_calls: after[1] - before[1],
        });
        Ok(())
    }
}
