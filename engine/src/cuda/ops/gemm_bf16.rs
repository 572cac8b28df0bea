//! Dense bf16 GEMM for the dense projections, the shared expert, the router's logits and lm_head: cuBLAS
//! (`cublasGemmEx`, bf16 inputs, f32 compute), or the small-M tensor-core kernel (kernels/cuda/gemm_small_bf16.cu:
//! its k-split fixed by the weight's shape, so a row's bits do not depend on the call's rows) for the batch-invariant
//! forwards (up to [`super::w4a16_gemm::INVARIANT_MAX_ROWS`] rows) and up to [`crate::cuda::Gpu::small_gemm_rows`]
//! rows otherwise (none by default). CPU twin: `crate::cpu::ops::matmul_bf16`.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{as_i32, need_len};
use crate::cuda::{ensure, CudaError, Gpu, Result};

const OP: &str = "gemm_bf16";

/// Output element type: bf16 (activations) or f32 (router logits, lm_head logits for argmax/sampling).
pub trait GemmOut: cudarc::driver::DeviceRepr {
    const TYPE: cudaDataType_t;
    /// The small-M tensor-core GEMM (kernels/cuda/gemm_small_bf16.cu) for token tiles of 8, 16, 32 and 64 rows.
    const SMALL: [&'static str; 4];
}
impl GemmOut for bf16 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
    const SMALL: [&'static str; 4] = [
        "kdtree_gemm_small_bf16_bf16_m1",
        "kdtree_gemm_small_bf16_bf16_m2",
        "kdtree_gemm_small_bf16_bf16_m4",
        "kdtree_gemm_small_bf16_bf16_m8",
    ];
}
impl GemmOut for f32 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
    const SMALL: [&'static str; 4] = [
        "kdtree_gemm_small_bf16_f32_m1",
        "kdtree_gemm_small_bf16_f32_m2",
        "kdtree_gemm_small_bf16_f32_m4",
        "kdtree_gemm_small_bf16_f32_m8",
    ];
}

/// Output features a CTA of the small-M GEMM takes (4 warps of 16).
const SMALL_BN: usize = 64;
/// k a step of the small-M GEMM's warps.
const SMALL_KSTEP: usize = 64;
/// Most k-splits of the small-M GEMM (its last CTA sums an output's partials one after another).
const SMALL_MAX_SPLITS: usize = 32;
/// Fewest steps a k-split takes.
const SMALL_MIN_STEPS: usize = 2;
/// f32 elements of a GPU's small-GEMM split-K workspace (16 MiB): a launch takes as many rows as fit.
pub(crate) const SMALL_WS: usize = 4 << 20;
/// Arrival counters of the small GEMM's split-K sum: one per (column block, token group) of a launch.
pub(crate) const SMALL_COUNTERS: usize = 1 << 16;

/// The small-M GEMM's k-split of an `[n, k]` weight aiming at `target_ctas` CTAs: (splits, steps per split). It
/// depends on the weight's shape and the target only, never on the rows, so a row's sums are the same in every call.
pub fn small_plan(target_ctas: usize, n: usize, k: usize) -> (usize, usize) {
    let blocks = n.div_ceil(SMALL_BN).max(1);
    let steps = k.div_ceil(SMALL_KSTEP).max(1);
    let want = target_ctas.div_ceil(blocks).clamp(1, SMALL_MAX_SPLITS);
    let per = steps.div_ceil(want).max(SMALL_MIN_STEPS).min(steps);
    (steps.div_ceil(per), per)
}

/// [`small_plan`] on `gpu`: [`crate::cuda::Gpu::small_ctas_per_sm`] CTAs on each of its SMs.
pub fn small_plan_on(gpu: &Gpu, n: usize, k: usize) -> (usize, usize) {
    small_plan(gpu.small_ctas_per_sm() * gpu.sms, n, k)
}

/// The launches of the small-M GEMM over `t` rows with `splits` k-splits of an N-wide output: (first row, rows,
/// token-tile index 0..4 for 8/16/32/64 rows a tile); None when not one row's partials fit the workspace. A launch
/// keeps its token groups within the grid (65,535) and, with splits, its (column block, token group) tiles within
/// the arrival counters.
pub fn small_launches(t: usize, splits: usize, n: usize) -> Option<Vec<(usize, usize, usize)>> {
    let blocks = n.div_ceil(SMALL_BN).max(1);
    let max_groups = if splits == 1 {
        65535
    } else {
        (SMALL_COUNTERS / blocks).min(65535)
    };
    if max_groups == 0 {
        return None;
    }
    let per = if splits == 1 {
        t.max(1)
    } else {
        let fit = SMALL_WS / (splits * n).max(1);
        if fit == 0 {
            return None;
        }
        if fit >= 64 {
            fit / 64 * 64
        } else {
            fit
        }
    };
    // Launches of 64 rows or more take 64-row tiles: at most max_groups of them.
    let per = if per >= 64 { per.min(max_groups * 64) } else { per };
    let mut out = Vec::new();
    let mut at = 0;
    while at < t {
        let rows = per.min(t - at);
        let tile = match rows {
            0..=8 => 0,
            9..=16 => 1,
            17..=32 => 2,
            _ => 3,
        };
        out.push((at, rows, tile));
        at += rows;
    }
    Some(out)
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
    let small_rows = if gpu.batch_invariant() {
        super::w4a16_gemm::INVARIANT_MAX_ROWS
    } else {
        gpu.small_gemm_rows()
    };
    if t <= small_rows
        && k.is_multiple_of(8)
        && super::addr(gpu, x).is_multiple_of(16)
        && super::addr(gpu, w).is_multiple_of(16)
    {
        let (splits, per) = small_plan_on(gpu, n, k);
        if let Some(launches) = small_launches(t, splits, n) {
            return small(gpu, x, w, y, k, n, ld_y, splits, per, &launches);
        }
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

/// The small-M GEMM (kernels/cuda/gemm_small_bf16.cu): `splits` k-splits of `per` steps ([`small_plan`]), the
/// rows in `launches` ([`small_launches`]); same contract as [`gemm_bf16_ld`] (the split-K workspace and counters
/// are the GPU's own).
#[allow(clippy::too_many_arguments)]
fn small<O: GemmOut>(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, O>,
    k: usize,
    n: usize,
    ld_y: usize,
    splits: usize,
    per: usize,
    launches: &[(usize, usize, usize)],
) -> Result<()> {
    use super::{addr, addr_mut, launch_cfg, launch_pdl};
    use cudarc::driver::DevicePtr;
    let blocks = n.div_ceil(SMALL_BN);
    let (mut nn, mut kk, mut pp, mut ly) = (
        as_i32(OP, "N", n)?,
        as_i32(OP, "K", k)?,
        as_i32(OP, "steps per split", per)?,
        as_i32(OP, "ld_y", ld_y)?,
    );
    let mut lx = kk;
    let mut wp = addr(gpu, w);
    let (wsp, cp) = {
        let (a, _s) = gpu.small_ws.device_ptr(&gpu.stream);
        let (b, _t) = gpu.small_counters.device_ptr(&gpu.stream);
        (a, b)
    };
    let (mut wsp, mut cp) = (wsp, cp);
    let x0 = addr(gpu, x);
    let y0 = addr_mut(gpu, y);
    for &(r0, rows, tile) in launches {
        let groups = rows.div_ceil(8 << tile);
        ensure(
            OP,
            groups <= 65535 && (splits == 1 || groups * blocks <= SMALL_COUNTERS),
            || format!("{rows} rows x {blocks} column blocks exceed the small GEMM's grid or counters"),
        )?;
        let mut xp = x0 + (r0 * k * 2) as u64;
        let mut yp = y0 + (r0 * ld_y * std::mem::size_of::<O>()) as u64;
        let mut mm = as_i32(OP, "M", rows)?;
        let mut params = [
            arg(&mut xp),
            arg(&mut lx),
            arg(&mut mm),
            arg(&mut wp),
            arg(&mut nn),
            arg(&mut kk),
            arg(&mut pp),
            arg(&mut wsp),
            arg(&mut yp),
            arg(&mut ly),
            arg(&mut cp),
        ];
        let grid = (blocks as u32, splits as u32, groups as u32);
        // SAFETY: x holds t rows of k (this launch reads rows r0 .. r0 + rows), w is n x k, y holds t rows ld_y
        // apart (checked by the caller); 16-byte loads of 16-byte aligned rows (k % 8 == 0, aligned bases,
        // checked); the workspace holds splits x rows x n f32 (small_launches) and the counters the grid (above).
        unsafe { launch_pdl(gpu, OP, O::SMALL[tile], launch_cfg(grid, 128, 0), &mut params) }?;
    }
    Ok(())
}

/// A kernel argument for [`super::launch_pdl`].
fn arg<T>(v: &mut T) -> *mut std::ffi::c_void {
    (v as *mut T).cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_plan_depends_on_the_weight_only_and_covers_k() {
        for &(n, k) in &[
            (2112, 7168),
            (384, 7168),
            (7168, 1024),
            (20480, 7168),
            (7168, 256),
            (33, 100),
            (8, 8),
        ] {
            let (splits, per) = small_plan(528, n, k);
            let steps = k.div_ceil(SMALL_KSTEP);
            assert!(splits >= 1 && per >= 1 && splits <= SMALL_MAX_SPLITS, "{n}x{k}");
            assert!(
                splits * per >= steps && (splits - 1) * per < steps,
                "{n}x{k}: every split has steps"
            );
        }
        assert_eq!(small_plan(528, 20480, 7168), (2, 56));
        assert_eq!(small_plan(528, 2112, 7168).0, 16);
        assert_eq!(small_plan(528, 384, 7168), (28, 4));
    }

    #[test]
    fn small_launches_cover_every_row_once_in_order() {
        for &(splits, n) in &[(1usize, 7168usize), (16, 2112), (28, 384), (2, 20480)] {
            for t in [1usize, 7, 8, 9, 17, 64, 65, 129, 257, 1025, 2048] {
                let l = small_launches(t, splits, n).unwrap();
                let mut next = 0;
                for &(r0, rows, tile) in &l {
                    assert_eq!(r0, next);
                    assert!(rows > 0 && (splits == 1 || splits * rows * n <= SMALL_WS));
                    assert!(rows <= 8 << tile || tile == 3);
                    next += rows;
                }
                assert_eq!(next, t, "splits={splits} n={n} t={t}");
            }
        }
        assert!(small_launches(1, 2, SMALL_WS).is_none());
        // One rank's whole lm_head (vocab 163,840: 2,560 column blocks, one split) over a batch's 2,048 rows: one
        // launch (no counters without splits); and every launch of a split GEMM keeps its tiles within the counters.
        let (splits, _) = small_plan(528, 163_840, 7168);
        assert_eq!(splits, 1);
        assert_eq!(small_launches(2048, splits, 163_840).unwrap(), vec![(0, 2048, 3)]);
        for &(splits, n) in &[(2usize, 20480usize), (16, 2112), (28, 384)] {
            for (_, rows, tile) in small_launches(100_000, splits, n).unwrap() {
                assert!(rows.div_ceil(8 << tile) * n.div_ceil(SMALL_BN) <= SMALL_COUNTERS);
            }
        }
    }
}
