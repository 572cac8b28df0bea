//! Per-row top-K log-probs wrapper for kernels/cuda/topk_logprobs.cu. CPU twin:
//! `crate::ddtree::top_k_log_probs` (rank order of `sampling::top_k`, `logit - sampling::log_sum_exp`).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "topk_logprobs";

/// Largest K the kernel selects (its shared-memory sort holds 2048 keys).
pub const MAX_K: usize = 2048;

/// For each of `rows` rows of `x` (`[rows, ld]` f32, first `v` used): the `k` best tokens in rank order into
/// `tok` `[rows, k]` and their `logit - logsumexp(row)` into `lp` `[rows, k]`. `k <= min(v, MAX_K)`.
/// One block of 1024 threads per row. Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn topk_logprobs(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    rows: usize,
    v: usize,
    ld: usize,
    k: usize,
    lp: &mut CudaViewMut<'_, f32>,
    tok: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    ensure(OP, v > 0 && ld >= v, || {
        format!("vocab v={v} must be > 0 and <= ld={ld}")
    })?;
    ensure(OP, k > 0 && k <= v && k <= MAX_K, || {
        format!("k={k} must be in 1..=min(v={v}, {MAX_K})")
    })?;
    need_len(OP, "x", x.len(), span(rows, ld, v))?;
    need_len(OP, "lp", lp.len(), rows * k)?;
    need_len(OP, "tok", tok.len(), rows * k)?;
    if rows == 0 {
        return Ok(());
    }
    ensure(OP, rows <= 65535, || {
        format!("rows={rows} exceeds the grid")
    })?;
    let (vv, l, kk) = (
        as_i32(OP, "v", v)?,
        as_i32(OP, "ld", ld)?,
        as_i32(OP, "k", k)?,
    );
    let mut b = gpu
        .stream
        .launch_builder(gpu.func("kdtree_topk_logprobs_f32"));
    b.arg(x).arg(&vv).arg(&l).arg(&kk).arg(lp).arg(tok);
    // SAFETY: lengths checked above; k <= MAX_K bounds the kernel's shared arrays.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(drv(OP))?;
    Ok(())
}
