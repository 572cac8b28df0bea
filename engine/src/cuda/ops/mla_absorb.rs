//! The two per-head GEMMs around the latent attention (absorbed MLA, k26-format §4.3), as cuBLAS
//! strided-batched GEMMs over the heads of a rank, bf16 in and out, f32 accumulation:
//! * [`absorb_q`]: `q_lat[t, h, :C] = q_nope[t, h, :] · W_UK_h` (W_UK_h = rows `h·(Dn+Dv) .. +Dn` of kv_b);
//! * [`apply_uv`]: `o[t, h, :Dv] = W_UV_h · o_lat[t, h, :]` (W_UV_h = rows `h·(Dn+Dv)+Dn .. +Dv` of kv_b).
//!
//! CPU twin: the absorbed branch of `crate::cpu::ops::mla_attention` (same sums, another f32 order).

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{as_i32, need_len, span};
use crate::cuda::{ensure, CudaError, Gpu, Result};

const OP: &str = "mla_absorb";

/// Shapes: T nodes, Hr heads, Dn nope dims, Dv v dims, C kv_lora.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbsorbDims {
    pub t: usize,
    pub heads: usize,
    pub nope: usize,
    pub v: usize,
    pub kv_lora: usize,
}

#[allow(clippy::too_many_arguments)]
unsafe fn batched(
    gpu: &Gpu,
    trans_a: cublasOperation_t,
    (m, n, k): (usize, usize, usize),
    a: u64,
    lda: usize,
    stride_a: usize,
    b: u64,
    ldb: usize,
    stride_b: usize,
    c: u64,
    ldc: usize,
    stride_c: usize,
    batch: usize,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let i = |what: &str, v: usize| as_i32(OP, what, v);
    crate::cuda::GpuStats::bump(&gpu.stats.blas_calls);
    // SAFETY (caller): a, b, c are live device buffers covering every element these strides address.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *gpu.blas.handle(),
            trans_a,
            cublasOperation_t::CUBLAS_OP_N,
            i("m", m)?,
            i("n", n)?,
            i("k", k)?,
            (&alpha) as *const f32 as *const _,
            a as *const _,
            cudaDataType_t::CUDA_R_16BF,
            i("lda", lda)?,
            stride_a as i64,
            b as *const _,
            cudaDataType_t::CUDA_R_16BF,
            i("ldb", ldb)?,
            stride_b as i64,
            (&beta) as *const f32 as *const _,
            c as *mut _,
            cudaDataType_t::CUDA_R_16BF,
            i("ldc", ldc)?,
            stride_c as i64,
            i("batch", batch)?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|source| CudaError::Blas { op: OP, source })
}

/// `q_lat` for every node and head: `q` `[T, Hr·(Dn+P)]` bf16 (per head q_nope | q_pe; only q_nope is
/// read), `kv_b` `[Hr·(Dn+Dv), C]` bf16, into `qcat` `[T, Hr, C+P]` (columns `0..C` of each head's row;
/// `p` = P). Launch contract: no allocation, no host sync.
pub fn absorb_q(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    p: usize,
    kv_b: &CudaView<'_, bf16>,
    qcat: &mut CudaViewMut<'_, bf16>,
    d: AbsorbDims,
) -> Result<()> {
    let (qk, kvw, lw) = (d.nope + p, d.nope + d.v, d.kv_lora + p);
    if !check_absorb(OP, (q.len(), kv_b.len(), qcat.len()), p, d)? {
        return Ok(());
    }
    let (pw, _a) = kv_b.device_ptr(&gpu.stream);
    let (pq, _b) = q.device_ptr(&gpu.stream);
    let (pc, _c) = qcat.device_ptr_mut(&gpu.stream);
    // Column-major: C_h [C, T] = W_UK_h^T (the row-major [Dn, C] block read as [C, Dn], ld C) x q_nope_h^T.
    // SAFETY: strides stay inside the buffers checked above (head h's blocks end before head h+1's).
    unsafe {
        batched(
            gpu,
            cublasOperation_t::CUBLAS_OP_N,
            (d.kv_lora, d.t, d.nope),
            pw,
            d.kv_lora,
            kvw * d.kv_lora,
            pq,
            d.heads * qk,
            qk,
            pc,
            d.heads * lw,
            lw,
            d.heads,
        )
    }
}

/// The lengths of an absorption's `(q, kv_b, qcat)` for `d` and P = `p`; Ok(false) when there is nothing to do.
pub(crate) fn check_absorb(
    op: &'static str,
    (q, kv_b, qcat): (usize, usize, usize),
    p: usize,
    d: AbsorbDims,
) -> Result<bool> {
    let (qk, kvw, lw) = (d.nope + p, d.nope + d.v, d.kv_lora + p);
    ensure(op, kv_b == d.heads * kvw * d.kv_lora, || {
        format!(
            "kv_b has {kv_b} elements, expected Hr={} x (Dn+Dv)={kvw} x C={}",
            d.heads, d.kv_lora
        )
    })?;
    need_len(op, "q", q, d.t * d.heads * qk)?;
    need_len(op, "qcat", qcat, span(d.t, d.heads * lw, d.heads * lw))?;
    Ok(d.t > 0 && d.heads > 0 && d.kv_lora > 0)
}

/// The lengths of a W_UV's `(o_lat, kv_b, o)` for `d`; Ok(false) when there is nothing to do.
pub(crate) fn check_uv(op: &'static str, (o_lat, kv_b, o): (usize, usize, usize), d: AbsorbDims) -> Result<bool> {
    let kvw = d.nope + d.v;
    ensure(op, kv_b == d.heads * kvw * d.kv_lora, || {
        format!(
            "kv_b has {kv_b} elements, expected Hr={} x (Dn+Dv)={kvw} x C={}",
            d.heads, d.kv_lora
        )
    })?;
    need_len(op, "o_lat", o_lat, d.t * d.heads * d.kv_lora)?;
    need_len(op, "o", o, d.t * d.heads * d.v)?;
    Ok(d.t > 0 && d.heads > 0 && d.v > 0)
}

/// `o` `[T, Hr·Dv]` bf16 from `o_lat` `[T, Hr, C]` bf16 and `kv_b` `[Hr·(Dn+Dv), C]`.
/// Launch contract: no allocation, no host sync.
pub fn apply_uv(
    gpu: &Gpu,
    o_lat: &CudaView<'_, bf16>,
    kv_b: &CudaView<'_, bf16>,
    o: &mut CudaViewMut<'_, bf16>,
    d: AbsorbDims,
) -> Result<()> {
    let kvw = d.nope + d.v;
    if !check_uv(OP, (o_lat.len(), kv_b.len(), o.len()), d)? {
        return Ok(());
    }
    let (pw, _a) = kv_b.device_ptr(&gpu.stream);
    let (pl, _b) = o_lat.device_ptr(&gpu.stream);
    let (po, _c) = o.device_ptr_mut(&gpu.stream);
    let w_uv = pw + (d.nope * d.kv_lora * std::mem::size_of::<bf16>()) as u64;
    // Column-major: O_h [Dv, T] = (W_UV_h read as [C, Dv], ld C)^T x o_lat_h^T ([C, T], ld Hr·C).
    // SAFETY: as above.
    unsafe {
        batched(
            gpu,
            cublasOperation_t::CUBLAS_OP_T,
            (d.v, d.t, d.kv_lora),
            w_uv,
            d.kv_lora,
            kvw * d.kv_lora,
            pl,
            d.heads * d.kv_lora,
            d.kv_lora,
            po,
            d.heads * d.v,
            d.v,
            d.heads,
        )
    }
}
