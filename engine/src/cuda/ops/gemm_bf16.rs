//! Dense bf16 GEMM through cuBLAS (`cublasGemmEx`, bf16 inputs, f32 compute) for the dense projections,
//! the shared expert and lm_head. CPU twin: `crate::cpu::ops::matmul_bf16`.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{as_i32, need_len};
use crate::cuda::{ensure, CudaError, Gpu, Result};

const OP: &str = "gemm_bf16";

/// Output element type: bf16 (activations) or f32 (router logits, lm_head logits for argmax/sampling).
pub trait GemmOut: cudarc::driver::DeviceRepr {
    const TYPE: cudaDataType_t;
    /// The decode GEMV kernels (kernels/cuda/gemv_bf16.cu) for a block of 1, 2, 3, 4, 8 or 16 rows of x
    /// ([`GEMV_ROWS`]).
    const GEMV: [&'static str; 6];
}
impl GemmOut for bf16 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
    const GEMV: [&'static str; 6] = [
        "kdtree_gemv_bf16_bf16_m1",
        "kdtree_gemv_bf16_bf16_m2",
        "kdtree_gemv_bf16_bf16_m3",
        "kdtree_gemv_bf16_bf16_m4",
        "kdtree_gemv_bf16_bf16_m8",
        "kdtree_gemv_bf16_bf16_m16",
    ];
}
impl GemmOut for f32 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
    const GEMV: [&'static str; 6] = [
        "kdtree_gemv_bf16_f32_m1",
        "kdtree_gemv_bf16_f32_m2",
        "kdtree_gemv_bf16_f32_m3",
        "kdtree_gemv_bf16_f32_m4",
        "kdtree_gemv_bf16_f32_m8",
        "kdtree_gemv_bf16_f32_m16",
    ];
}

/// Rows of x up to which the GEMV kernel replaces cuBLAS when it is on ([`crate::cuda::Gpu::gemv`], opt in), by
/// default ([`crate::cuda::Gpu::gemv_rows`], `KDTREE_GEMV_ROWS`, sets another bound).
pub const GEMV_MAX_ROWS: usize = 4;

/// Rows a GEMV block takes, one kernel each ([`GemmOut::GEMV`]).
pub const GEMV_ROWS: [usize; 6] = [1, 2, 3, 4, 8, 16];

/// The launches of a GEMV over `t` rows: (index into [`GEMV_ROWS`], row groups, first row), largest blocks first.
/// A row's sums do not depend on its block's size, so any split of the rows gives the same bits.
pub fn gemv_launches(t: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    for (i, &m) in GEMV_ROWS.iter().enumerate().rev() {
        let groups = (t - at) / m;
        if groups > 0 {
            out.push((i, groups, at));
            at += groups * m;
        }
    }
    out
}

/// Warps per output row of the GEMV: enough rows x warps to fill the GPU (~24 warps per SM) on short N.
fn gemv_warps_per_row(gpu: &Gpu, n: usize) -> usize {
    let want = (24 * gpu.sms).div_ceil(n.max(1));
    match want {
        0..=1 => 1,
        2..=3 => 2,
        4..=7 => 4,
        _ => 8,
    }
}

/// `y[T, N] = x[T, K] · W[N, K]^T` (row-major, W as `nn.Linear.weight`), bf16 inputs, f32 accumulation,
/// output bf16 or f32. Launch contract: no allocation (cuBLAS's own workspace), no host sync; capture in a
/// graph needs a cuBLAS workspace set first (cublasSetWorkspace), as cuBLAS documents.
pub fn gemm_bf16<O: GemmOut>(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, O>,
    t: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    gemm_bf16_ld(gpu, x, w, y, t, k, n, n)
}

/// [`gemm_bf16`] with the rows of y `ld_y >= n` apart (a vocab shard's logits written into its columns of the
/// merged `[T, V]`).
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_ld<O: GemmOut>(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, O>,
    t: usize,
    k: usize,
    n: usize,
    ld_y: usize,
) -> Result<()> {
    ensure(OP, w.len() == n * k, || {
        format!("W has {} elements, expected N={n} x K={k}", w.len())
    })?;
    ensure(OP, ld_y >= n, || format!("ld_y={ld_y} must be >= N={n}"))?;
    need_len(OP, "x", x.len(), t * k)?;
    need_len(OP, "y", y.len(), super::span(t, ld_y, n))?;
    if t == 0 || n == 0 {
        return Ok(());
    }
    let gemv_rows = if gpu.batch_invariant() {
        super::w4a16_gemm::INVARIANT_MAX_ROWS
    } else if gpu.gemv() {
        gpu.gemv_rows()
    } else {
        0
    };
    if t <= gemv_rows
        && k.is_multiple_of(8)
        && super::addr(gpu, x).is_multiple_of(16)
        && super::addr(gpu, w).is_multiple_of(16)
    {
        return gemv(gpu, x, w, y, t, k, n, ld_y);
    }
    let (tt, kk, nn, ly) = (
        as_i32(OP, "T", t)?,
        as_i32(OP, "K", k)?,
        as_i32(OP, "N", n)?,
        as_i32(OP, "ld_y", ld_y)?,
    );
    // Column-major view: Y^T [N, T] = W^T... i.e. C(N x T) = op(A) B with A = W stored K x N (lda K),
    // transposed, and B = X stored K x T (ldb K).
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (pw, _sw) = w.device_ptr(&gpu.stream);
    let (px, _sx) = x.device_ptr(&gpu.stream);
    let (py, _sy) = y.device_ptr_mut(&gpu.stream);
    crate::cuda::GpuStats::bump(&gpu.stats.blas_calls);
    // SAFETY: pointers are live device buffers whose lengths were checked above for these dimensions.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *gpu.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            nn,
            tt,
            kk,
            (&alpha) as *const f32 as *const _,
            pw as *const _,
            cudaDataType_t::CUDA_R_16BF,
            kk,
            px as *const _,
            cudaDataType_t::CUDA_R_16BF,
            kk,
            (&beta) as *const f32 as *const _,
            py as *mut _,
            O::TYPE,
            ly,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|source| CudaError::Blas { op: OP, source })
}

/// The decode GEMV (kernels/cuda/gemv_bf16.cu) for `t` rows, in blocks of 16, 8, 4, 3, 2 or 1 rows
/// ([`gemv_launches`]): same contract as [`gemm_bf16_ld`].
#[allow(clippy::too_many_arguments)]
fn gemv<O: GemmOut>(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, O>,
    t: usize,
    k: usize,
    n: usize,
    ld_y: usize,
) -> Result<()> {
    use cudarc::driver::PushKernelArg;
    let wpr = gemv_warps_per_row(gpu, n);
    let (lx, ly, nn, kk, wp) = (
        as_i32(OP, "K", k)?,
        as_i32(OP, "ld_y", ld_y)?,
        as_i32(OP, "N", n)?,
        as_i32(OP, "K", k)?,
        wpr as i32,
    );
    let blocks = n.div_ceil(8 / wpr) as u32;
    for (i, groups, r0) in gemv_launches(t) {
        let xs = x.slice(r0 * k..);
        let mut ys = y.slice_mut(r0 * ld_y..);
        let mut b = gpu.stream.launch_builder(gpu.func(O::GEMV[i]));
        b.arg(&xs)
            .arg(&lx)
            .arg(w)
            .arg(&mut ys)
            .arg(&ly)
            .arg(&nn)
            .arg(&kk)
            .arg(&wp);
        // SAFETY: x holds t rows of k, w is n x k, y holds t rows ld_y apart (checked by the caller); this launch
        // covers rows r0 .. r0 + groups * GEMV_ROWS[i] (row group blockIdx.y at r0 + its index times the block's
        // rows); the kernel reads 16-byte chunks of 16-byte aligned rows (k % 8 == 0 and aligned bases, checked,
        // so every row start is aligned too) and writes y[m, n].
        unsafe { b.launch(super::launch_cfg((blocks, groups as u32, 1), 256, 0)) }.map_err(crate::cuda::drv(OP))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_launches_cover_every_row_once_in_order() {
        for t in 0..2100 {
            let mut next = 0;
            for (i, groups, r0) in gemv_launches(t) {
                assert_eq!(r0, next, "t={t}: a gap or an overlap");
                assert!(groups > 0);
                next += groups * GEMV_ROWS[i];
            }
            assert_eq!(next, t, "t={t}");
            assert!(gemv_launches(t).len() <= 5, "t={t}: {:?}", gemv_launches(t));
        }
        assert_eq!(gemv_launches(1), vec![(0, 1, 0)]);
        assert_eq!(gemv_launches(65), vec![(5, 4, 0), (0, 1, 64)]);
    }
}
