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
}
impl GemmOut for bf16 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}
impl GemmOut for f32 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
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
    ensure(OP, w.len() == n * k, || format!("W has {} elements, expected N={n} x K={k}", w.len()))?;
    ensure(OP, ld_y >= n, || format!("ld_y={ld_y} must be >= N={n}"))?;
    need_len(OP, "x", x.len(), t * k)?;
    need_len(OP, "y", y.len(), super::span(t, ld_y, n))?;
    if t == 0 || n == 0 {
        return Ok(());
    }
    let (tt, kk, nn, ly) = (as_i32(OP, "T", t)?, as_i32(OP, "K", k)?, as_i32(OP, "N", n)?, as_i32(OP, "ld_y", ld_y)?);
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
