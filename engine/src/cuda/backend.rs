//! [`CudaBackend`]: `backend::Backend` on one GPU with the kernels of kernels/cuda (through the wrappers
//! in cuda/ops), so `TargetModel<CudaBackend>` is the CPU reference's model code running on the device.
//!
//! Precision: activations and the residual stream are f32 device buffers like the CPU reference's; they are
//! rounded to bf16 where a bf16 GEMM (cuBLAS, W4A16) or the MLA kernel reads them; the latent KV cache is
//! bf16 (576 per token per layer). Router and lm_head logits come out of cuBLAS in f32.
//! Errors: the trait's ops are infallible (the CPU cannot fail), so a failed launch here is recorded (the
//! first one wins) and reported by [`Resources::check`], which the model calls at the end of every forward;
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
use super::ops::{fill, gather_rows, kv_compact, round_state, w4a16_gemm};
use super::tree::{DMask, DeviceTree};
use super::types::{pad_k, storage_id, DGraph, DKv, DMat, DPos, DRope, DRoutes, DI4};
use super::{CudaError, Gpu};
use crate::backend::{Fill, I4Stack, Mat, Resources, RopeTable, Slab, Visibility, WeightCheck, WeightRef};

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
        let probe = self.gpu.profile.as_ref().map(|p| (p, p.begin(&self.gpu.stream, op)));
        let r = f();
        if let Some((p, probe)) = probe {
            p.end(&self.gpu.stream, probe);
        }
        match r {
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
        let mut y = self.gpu.out::<f32>(to - from)?; // the copy writes every element
        if to > from {
            self.gpu
                .stream
                .memcpy_dtod(&src.slice(from..to), &mut y)
                .map_err(super::drv("copy"))?;
        }
        Ok(y)
    }
}

impl Resources for CudaBackend {
    type Act = CudaSlice<f32>;
    type LinIn = CudaSlice<bf16>;
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
    fn sync(&self) -> Result<()> {
        Ok(self.gpu.sync()?)
    }
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
        Ok(DMat::new(self.gpu.upload(&m.w[..])?, m.rows, m.cols))
    }
    fn hashes_uploads(&self) -> bool {
        self.gpu.weight_check() == WeightCheck::Host
    }
    fn upload_bf16_hashed(&self, m: Mat) -> Result<(DMat, u64)> {
        let (w, h) = self.gpu.upload_hashed(&m.w[..])?;
        Ok((DMat::new(w, m.rows, m.cols), h))
    }
    fn upload_i4g32_hashed(&self, s: I4Stack) -> Result<(DI4, [u64; 2])> {
        if !s.k.is_multiple_of(w4a16_gemm::K_STEP) {
            // Padded on the host (small models only): the shard's own bytes hashed, then the padded copy uploaded.
            let h = s.xxh3();
            return Ok((self.upload_i4g32(s)?, h));
        }
        self.i4_shape_ok(s.count, s.n, s.k)?;
        let (packed, hp) = self.gpu.upload_hashed(&s.packed[..])?;
        let (scales, hs) = self.gpu.upload_hashed(&s.scales[..])?;
        Ok((
            DI4 {
                packed,
                scales,
                first: s.first,
                count: s.count,
                n: s.n,
                k: s.k,
                k_src: s.k,
            },
            [hp, hs],
        ))
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
    fn stack_rows(&self, mats: &mut [&mut DMat]) -> Result<()> {
        let Some(cols) = mats.first().map(|m| m.cols) else {
            return Ok(());
        };
        if let Some(m) = mats.iter().find(|m| m.cols != cols) {
            bail!("stacking matrices of {cols} and {} columns", m.cols);
        }
        let total: usize = mats.iter().map(|m| m.rows * m.cols).sum();
        let mut buf = self.gpu.out::<bf16>(total)?; // every element copied in below
        let mut at = 0;
        for m in mats.iter() {
            let n = m.rows * m.cols;
            self.gpu
                .stream
                .memcpy_dtod(&m.view(), &mut buf.slice_mut(at..at + n))
                .map_err(super::drv("stack_rows"))?;
            at += n;
        }
        let buf = Arc::new(buf);
        let mut at = 0;
        for m in mats.iter_mut() {
            (m.w, m.off) = (buf.clone(), at);
            at += m.rows * m.cols;
        }
        Ok(())
    }
    fn weight_check(&self) -> WeightCheck {
        self.gpu.weight_check()
    }
    fn weight_xxh3(&self, w: WeightRef<'_, Self>) -> Result<Vec<u64>> {
        use super::ops::xxh3::xxh3_of;
        let g = &*self.gpu;
        Ok(match w {
            WeightRef::Mat(m) => vec![xxh3_of(g, &m.view())?],
            WeightRef::Vector(v) => vec![xxh3_of(g, &v.as_view())?],
            WeightRef::VectorF32(v) => vec![xxh3_of(g, &v.as_view())?],
            WeightRef::I4(s) if s.k == s.k_src => {
                vec![xxh3_of(g, &s.packed.as_view())?, xxh3_of(g, &s.scales.as_view())?]
            }
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
        Ok(DMat::new(self.filled_bf16(rows * cols, f)?, rows, cols))
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
            causal: v.is_causal(),
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
    fn ids_gather(&self, dst: &mut CudaSlice<u32>, srcs: &[(&CudaSlice<u32>, usize)]) {
        self.run("ids_copy", || {
            let mut at = 0;
            for chunk in srcs.chunks(round_state::MAX_SEGS) {
                let segs: Vec<_> = chunk
                    .iter()
                    .map(|&(src, n)| {
                        let s = (src.slice(..n.min(src.len())), n, at);
                        at += n;
                        s
                    })
                    .collect();
                round_state::copy_segs_u32(&self.gpu, &segs, &mut dst.as_view_mut())?;
            }
            Ok(())
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
    fn pos_add_host(&self, p: &mut DPos, n: usize) {
        p.host += n;
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
            let mut y = self.gpu.out::<f32>(n + x.len())?; // the two copies write every element
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
    fn cols(&self, x: &CudaSlice<f32>, ld: usize, from: usize, width: usize, t: usize) -> CudaSlice<f32> {
        self.run("cols", || {
            if from + width > ld || t * ld > x.len() {
                return Err(CudaError::Shape {
                    op: "cols",
                    msg: format!(
                        "columns {from}..{} of {t} rows of {ld} from {} values",
                        from + width,
                        x.len()
                    ),
                });
            }
            let mut y = self.gpu.out::<f32>(t * width)?; // the copy writes every element
            if t > 0 && width > 0 {
                act_f32::copy_rows_f32(&self.gpu, &x.slice(from..), ld, &mut y.as_view_mut(), width, t, width)?;
            }
            Ok(y)
        })
        .unwrap_or_else(|| self.empty())
    }
    fn ids_blocks(&self, dst: &mut CudaSlice<u32>, roots: &[&CudaSlice<u32>], block: usize, fill: u32) {
        self.run("ids_blocks", || {
            let mut at = 0;
            for chunk in roots.chunks(round_state::MAX_SEGS) {
                let views: Vec<_> = chunk.iter().map(|r| r.as_view()).collect();
                let n = chunk.len() * block;
                if at + n > dst.len() {
                    return Err(CudaError::Shape {
                        op: "ids_blocks",
                        msg: format!("{} blocks of {block} into {} ids", roots.len(), dst.len()),
                    });
                }
                round_state::ids_blocks(&self.gpu, &mut dst.slice_mut(at..at + n), &views, block, fill)?;
                at += n;
            }
            Ok(())
        });
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
            round_state::store_rows(
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
    fn write_rows_at_segs(&self, dsts: &mut [(&mut CudaSlice<f32>, &DPos, usize)], cols: usize, src: &CudaSlice<f32>) {
        self.run("write_rows_at", || {
            let total: usize = dsts.iter().map(|d| d.2).sum();
            if total * cols > src.len() {
                return Err(CudaError::Shape {
                    op: "write_rows_at",
                    msg: format!("{total} rows of {cols} from {} values", src.len()),
                });
            }
            let mut from = 0;
            for chunk in dsts.chunks_mut(round_state::MAX_SEGS) {
                let k: usize = chunk.iter().map(|d| d.2).sum();
                let mut segs: Vec<round_state::StoreSeg<'_, f32>> = chunk
                    .iter_mut()
                    .map(|(dst, at, n)| round_state::StoreSeg {
                        dst: dst.as_view_mut(),
                        pos: at.dev.as_view(),
                        committed: at.host,
                        n: *n,
                    })
                    .collect();
                round_state::store_rows_seg(&self.gpu, &mut segs, cols, &src.slice(from * cols..(from + k) * cols))?;
                from += k;
            }
            Ok(())
        });
    }
    fn stash_rows(
        &self,
        dsts: &mut [(&mut CudaSlice<f32>, &mut DPos)],
        cols: usize,
        src: &CudaSlice<f32>,
    ) -> Result<()> {
        self.run("stash_rows", || {
            let mut from = 0;
            for chunk in dsts.chunks_mut(round_state::MAX_SEGS) {
                let n = chunk.len();
                let mut segs: Vec<round_state::StashSeg<'_>> = chunk
                    .iter_mut()
                    .map(|(dst, pos)| round_state::StashSeg {
                        dst: dst.as_view_mut(),
                        pos: pos.dev.as_view_mut(),
                        at: pos.host,
                    })
                    .collect();
                round_state::stash_rows_seg_f32(
                    &self.gpu,
                    &mut segs,
                    cols,
                    &src.slice(from * cols..(from + n) * cols),
                )?;
                from += n;
            }
            Ok(())
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
        // A chain's path (a prefill chunk, a host AR step) leaves every row where it is: no upload and no kernel
        // (the kernel walks the path row by row in every layer's block: 16K rows took ~50 ms a prefill chunk).
        if path.iter().enumerate().all(|(i, &p)| p == i) {
            round_state::pos_add(&self.gpu, &mut kv.pos.as_view_mut(), path.len())?;
            kv.committed += path.len();
            kv.scratch = 0;
            return self.check();
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
    fn kv_commit_rows_segs(&self, kvs: &mut [&mut DKv], n: usize) -> Result<()> {
        if let Some(kv) = kvs.iter().find(|kv| n > kv.scratch) {
            bail!("kv_commit_rows: {n} rows of {} scratch rows", kv.scratch);
        }
        for chunk in kvs.chunks_mut(round_state::MAX_SEGS) {
            let mut pos: Vec<_> = chunk.iter_mut().map(|kv| kv.pos.as_view_mut()).collect();
            round_state::pos_add_segs(&self.gpu, &mut pos, n)?;
        }
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
    fn graph_stats(&self) -> Option<crate::api::GraphStats> {
        Some(self.gpu.stats.graphs())
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
}
