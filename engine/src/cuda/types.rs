//! The CUDA backend's device types: the associated types of `Backend for CudaBackend` (matrices, INT4
//! stacks, the latent KV cache, position counters, router decisions, RoPE rows, captured rounds).

use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use std::sync::Arc;

/// A bf16 matrix `[rows, cols]` on the device: elements `off .. off + rows·cols` of `w`, a buffer it may share
/// with the matrices stacked with it by rows ([`crate::backend::Resources::stack_rows`]: one GEMM over an input
/// they share).
pub struct DMat {
    pub w: Arc<CudaSlice<bf16>>,
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
}

impl DMat {
    /// A matrix that owns its buffer.
    pub fn new(w: CudaSlice<bf16>, rows: usize, cols: usize) -> DMat {
        DMat {
            w: Arc::new(w),
            off: 0,
            rows,
            cols,
        }
    }
    /// Its `rows · cols` elements.
    pub fn view(&self) -> CudaView<'_, bf16> {
        self.w.slice(self.off..self.off + self.rows * self.cols)
    }
    /// Whether `next` starts where this matrix ends in the same buffer (same width): the two are one `[rows +
    /// next.rows, cols]` matrix.
    pub fn precedes(&self, next: &DMat) -> bool {
        Arc::ptr_eq(&self.w, &next.w) && self.cols == next.cols && self.off + self.rows * self.cols == next.off
    }
}

/// A rank's INT4 group-32 expert stack on the device (the converter's layout, unchanged).
pub struct DI4 {
    pub packed: CudaSlice<u8>,
    pub scales: CudaSlice<bf16>,
    pub first: usize,
    pub count: usize,
    pub n: usize,
    pub k: usize,
    /// K of the converter's layout: `k` unless the upload zero-padded K to the kernel's step (`pad_k`).
    pub k_src: usize,
}

/// The latent KV cache of all layers: `[layers, cap, width]` bf16; rows `[0, committed)` committed, then
/// `scratch` rows of the last forward. Grows (doubling, copying the committed rows) when a forward needs
/// more rows: an allocation only when the context outgrows it.
/// `pos` is the committed length where the kernels read it (kept equal to `committed` by every host-side
/// change; the device round advances it on the device and the host copy follows after the read back).
pub struct DKv {
    pub(super) buf: CudaSlice<bf16>,
    pub(super) layers: usize,
    pub(super) width: usize,
    pub(super) cap: usize,
    pub(super) committed: usize,
    pub(super) scratch: usize,
    pub(super) pos: CudaSlice<i32>,
    /// A new value whenever `buf` moves (a captured round is keyed by it).
    pub(super) id: u64,
}

/// A position counter: the device copy the kernels read and the host copy.
pub struct DPos {
    pub host: usize,
    pub dev: CudaSlice<i32>,
}

/// A captured DDTree round: the graph, its key and how many kernels and cuBLAS calls it holds.
pub struct DGraph {
    pub(super) key: u64,
    pub(super) graph: cudarc::driver::CudaGraph,
    pub kernels: u64,
    pub blas_calls: u64,
}

// SAFETY: CUDA graph objects may be used from any thread as long as calls on one graph are serialised
// (CUDA driver API, graph thread safety). A DGraph is owned by one target session and only touched through
// `&mut` (Backend::graph_run), so moving it to another thread cannot make two calls concurrent.
unsafe impl Send for DGraph {}

static NEXT_STORAGE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
pub(super) fn storage_id() -> u64 {
    NEXT_STORAGE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One MoE layer's router decisions on the device.
pub struct DRoutes {
    pub(super) ids: CudaSlice<i32>,
    pub(super) wts: CudaSlice<f32>,
    pub(super) t: usize,
    pub(super) k: usize,
    pub(super) experts: usize,
}

/// One forward's cos/sin rows on the device, `[rows, half]` each.
pub struct DRope {
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
    pub half: usize,
    pub rows: usize,
}

/// INT4 group-32 rows of `k` (`rows` of them: packed `k/2` bytes and `k/32` scales each) widened to the next
/// multiple of `step` with zero nibbles and zero scales (dequantised: exact zeros); the new width too.
pub(super) fn pad_k(packed: &[u8], scales: &[bf16], rows: usize, k: usize, step: usize) -> (Vec<u8>, Vec<bf16>, usize) {
    let kp = k.div_ceil(step) * step;
    let (mut p, mut s) = (vec![0u8; rows * kp / 2], vec![bf16::ZERO; rows * kp / 32]);
    for r in 0..rows {
        p[r * kp / 2..r * kp / 2 + k / 2].copy_from_slice(&packed[r * k / 2..(r + 1) * k / 2]);
        s[r * kp / 32..r * kp / 32 + k / 32].copy_from_slice(&scales[r * k / 32..(r + 1) * k / 32]);
    }
    (p, s, kp)
}
